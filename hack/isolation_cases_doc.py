"""Regenerate the catalog table of docs/isolation-cases.md from the case
objects (src/chv_guest/cell/catalog/); the unit test
tests/unit/cell_runtime/test_audit.py fails while the two differ. Run with
src/ on PYTHONPATH, as the tests import it (pytest.ini)."""

import os

from chv_guest.cell import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOC = os.path.join(ROOT, "docs", "isolation-cases.md")
START, END = "## The catalog\n\n", "\n## Counter-proofs\n"

with open(DOC) as fh:
    text = fh.read()
head, rest = text.split(START, 1)
tail = rest[rest.index(END):]
with open(DOC, "w") as fh:
    fh.write(head + START + catalog.catalog_markdown() + tail)
