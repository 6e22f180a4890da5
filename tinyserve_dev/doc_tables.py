"""Markdown tables of the op's inputs, outputs and attributes, generated from the schema.

``docs/op.md`` embeds them between markers; ``python -m tinyserve_dev.doc_tables
docs/op.md`` refreshes them and a test fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tinyserve_trt.ops import schema

BEGIN, END = "<!-- BEGIN GENERATED: schema tables -->", "<!-- END GENERATED: schema tables -->"


def tables() -> str:
    def tensor_rows(specs):
        rows = ["| # | name | shape | dtype | optional | meaning |", "|---|---|---|---|---|---|"]
        for i, t in enumerate(specs):
            dtype = "T (float32 or float16)" if t.dtype == "T" else t.dtype
            rows.append(f"| {i} | `{t.name}` | `[{', '.join(t.shape)}]` | {dtype} | "
                        f"{'yes' if t.optional else 'no'} | {t.doc} |")
        return rows

    attr = ["| name | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for a in schema.ATTRIBUTES:
        allowed = ", ".join(f"`{c}`" for c in a.choices) if a.choices else \
            " ".join(x for x in (f">= {a.min:g}" if a.min is not None else "",
                                 f"<= {a.max:g}" if a.max is not None else "") if x)
        attr.append(f"| `{a.name}` | {a.type} | `{a.default!r}` | {allowed} | {a.doc} |")
    tol = ", ".join(f"{k}: atol {v['atol']:g} / rtol {v['rtol']:g}" for k, v in schema.TOLERANCES.items())
    return "\n".join([BEGIN, "", "### Inputs", "", *tensor_rows(schema.INPUTS), "", "### Outputs", "",
                      *tensor_rows(schema.OUTPUTS), "", "### Attributes", "", *attr, "",
                      f"Tolerances against the reference: {tol}.", "", END])


def refresh(path: Path) -> bool:
    """Rewrite the generated block of ``path``; return True if it changed."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + tables() + text[end:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    print("updated" if refresh(Path(sys.argv[1])) else "up to date")
