"""The ctypes structs in tinyserve_trt/cuda/library.py match qsa_launch.h byte for byte.

Compiles a tiny host C program against the header (no CUDA needed) that
prints each field's offset and each struct's size, and compares.
"""

import ctypes
import json
import shutil
import subprocess

import pytest

from tinyserve_trt.cuda import library

from .conftest import ROOT

STRUCTS = {"QsaDims": library.QsaDims, "QsaAttrs": library.QsaAttrs, "QsaColdDims": library.QsaColdDims,
           "QsaForwardParams": library.QsaForwardParams, "QsaAppendParams": library.QsaAppendParams}


def _c_program() -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "qsa_launch.h"', "int main(void) {",
             '  printf("{");']
    first = True
    for name, cls in STRUCTS.items():
        for field, _ in cls._fields_:
            sep = "" if first else ","
            first = False
            lines.append(f'  printf("{sep}\\"{name}.{field}\\": %zu", offsetof({name}, {field}));')
        lines.append(f'  printf(",\\"{name}.sizeof\\": %zu", sizeof({name}));')
    lines += ['  printf("}\\n");', "  return 0;", "}"]
    return "\n".join(lines)


def test_ctypes_layout_matches_header(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no host C compiler (cc/gcc/clang) to compile qsa_launch.h")
    src = tmp_path / "abi.c"
    src.write_text(_c_program())
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", f"-I{ROOT / 'plugins' / 'kernels'}", str(src), "-o",
                    str(exe)], check=True)
    c_layout = json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    py_layout = {}
    for name, cls in STRUCTS.items():
        for field, _ in cls._fields_:
            py_layout[f"{name}.{field}"] = getattr(cls, field).offset
        py_layout[f"{name}.sizeof"] = ctypes.sizeof(cls)
    assert py_layout == c_layout


def test_enum_ids_match_header():
    text = (ROOT / "plugins" / "generated" / "qsa_schema.h").read_text()
    for name, i in library.POLICY_IDS.items():
        assert f"#define QSA_POLICY_{name.upper()} {i}\n" in text
    launch = (ROOT / "plugins" / "kernels" / "qsa_launch.h").read_text()
    for name, i in library.DTYPES.items():
        assert f"QSA_DTYPE_{name.upper()} = {i}" in launch
