"""The cold page format is encoded and decoded once in Python (STYLE principle 7).

``ops/cold_codec.py`` holds the rule, on the nibbles and the level step of ``ops/fine_bounds.py``,
for numpy arrays and torch tensors alike (``ops/array_ns.py``); the ONNX body
(``ops/int4_onnx.py``, its own language) takes its constants from there. No other module of the
package extracts a nibble, spells the 1/15 step, rounds or re-expands scales in torch, or defines
a quantizer of its own. The C++ side: ``tests/kernels/test_schema_header.py::
test_cold_and_bound_decode_exist_once_per_language`` (``qsa_math.h``).
"""

import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tinyserve_trt"

_Q = r"(\w+\s*\.\s*)*"  # a name may come qualified: fine_bounds.BITS
# pattern -> the modules (relative to the package) allowed to hold it
RULES = {
    rf"&\s*{_Q}(15|0[xX][fF]|LEVELS)\b": {"ops/fine_bounds.py"},  # a low nibble: split_nibbles
    rf">>\s*{_Q}(4|BITS)\b": {"ops/fine_bounds.py"},  # a high nibble: split_nibbles
    rf"(?<!\b1 )<<\s*{_Q}(4|BITS)\b": {"ops/fine_bounds.py", "ops/cold_codec.py"},  # packing (1 << 4: 16)
    rf"\b1(\.0*)?\s*/\s*{_Q}(15|LEVELS)\b": {"ops/fine_bounds.py"},  # the level step's constant
    r"\bINV_LEVELS\b": {"ops/fine_bounds.py", "ops/int4_onnx.py", "ops/two_level_onnx.py"},  # ONNX reads it
    r"\b127\b": {"ops/cold_codec.py", "ops/quantization.py"},  # the INT8 range
    r"repeat_interleave|torch\.round\b|\.view\(\s*torch\.|nextafter": {"ops/array_ns.py"},  # torch spellings
    r"\bdef\s+_?(de)?quantize(_\w+)?\s*\(": {"ops/cold_codec.py", "ops/int4_onnx.py"},
    r"\bdef\s+_?(un)?pack(_int4|_nibbles)?\s*\(": {"ops/cold_codec.py", "ops/int4_onnx.py"},
}


def code_of(text: str) -> str:
    """Python source without its comments and strings (docstrings may quote the rule)."""
    skip = {tokenize.COMMENT, tokenize.STRING} | {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",)
                                                   if hasattr(tokenize, n)}
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return " ".join(t.string for t in toks if t.type not in skip)


def offenders(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        code = code_of(path.read_text())
        found += [f"{rel}: {pattern!r}" for pattern, allowed in RULES.items()
                  if rel not in allowed and re.search(pattern, code)]
    return found


def test_the_cold_format_is_coded_once():
    assert not offenders(), "decodes or encodes the cold format itself: call ops/cold_codec.py"


def test_one_nibble_split_one_packer():
    code = {m: code_of((PACKAGE / "ops" / m).read_text()) for m in ("fine_bounds.py", "cold_codec.py")}
    assert len(re.findall(r"&\s*LEVELS\b", code["fine_bounds.py"])) == 1
    assert len(re.findall(r">>\s*BITS\b", code["fine_bounds.py"])) == 1
    assert len(re.findall(r"<<\s*BITS\b", code["cold_codec.py"])) == 1 and code["cold_codec.py"].count("<<") == 1
    onnx = code_of((PACKAGE / "ops" / "int4_onnx.py").read_text())
    assert "split_nibbles" in onnx and not re.search(r"const\(\s*(15|4)\s*,", onnx)  # constants: the contract's


def test_the_scan_sees_a_copy(tmp_path):
    """The checker on a throwaway package: a torch re-derivation of the decode is caught, the same
    words in a comment or a docstring are not."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "pages.py").write_text(
        '"""p & 15, p >> 4"""\n# q * scale.repeat_interleave(D // C)\n'
        "def _unpack(torch, p):\n    return torch.cat([p & 15, p >> fine_bounds.BITS], dim=-1)\n")
    (tmp_path / "runtime" / "fine.py").write_text('"""Docs may say (hi - lo) * (1 / 15)."""\nx = 1\n')
    assert offenders(tmp_path) == [f"runtime/pages.py: {p!r}" for p in list(RULES)[:2]] + \
        [f"runtime/pages.py: {list(RULES)[-1]!r}"]
