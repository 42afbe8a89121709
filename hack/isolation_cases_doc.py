"""Regenerate the catalog table of docs/isolation-cases.md from the code
(roles/cell_runtime/files/chv_cell/counterproof.py); the unit test
tests/unit/cell_runtime/test_audit.py fails while the two differ."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "roles", "cell_runtime", "files"))

from chv_cell import counterproof  # noqa: E402

DOC = os.path.join(ROOT, "docs", "isolation-cases.md")
START, END = "## The catalog\n\n", "\n## Counter-proofs\n"

with open(DOC) as fh:
    text = fh.read()
head, rest = text.split(START, 1)
tail = rest[rest.index(END):]
with open(DOC, "w") as fh:
    fh.write(head + START + counterproof.catalog_markdown() + tail)
