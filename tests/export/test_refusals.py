"""Attention variants the op does not implement are refused by node and reason,
never rewritten into a different function."""

import pytest

from tinyserve_trt.export.errors import UnsupportedError
from tinyserve_trt.export.pipeline import export_model

from .refused_models import export

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind,reason", [
    ("softcap", r"soft-capping"),
    ("sliding_window", r"sliding-window"),
    ("alibi", r"ALiBi"),
])
def test_refused_with_node_and_reason(tmp_path, kind, reason):
    src = export(kind, tmp_path / "src")
    with pytest.raises(UnsupportedError, match=reason) as err:
        export_model(src, tmp_path / "pkg", quiet=True)
    assert "at node /" in str(err.value)  # names the node
    assert not (tmp_path / "pkg").exists()
