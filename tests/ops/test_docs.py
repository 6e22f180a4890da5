from pathlib import Path

from tinyserve_dev.doc_tables import BEGIN, END, tables

DOC = Path(__file__).resolve().parents[2] / "docs" / "op.md"


def test_op_doc_tables_are_generated_from_the_schema():
    text = DOC.read_text()
    block = text[text.index(BEGIN): text.index(END) + len(END)]
    assert block == tables(), "docs/op.md is stale: run python -m tinyserve_dev.doc_tables docs/op.md"
