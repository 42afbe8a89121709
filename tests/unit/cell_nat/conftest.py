"""Make the collection importable as ansible_collections.chv.fleet for these tests.

The repository root is the collection root, so it is linked into a private
ansible_collections tree when no other conftest has done that already.
"""

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _ensure_collection_importable():
    try:
        import ansible_collections.chv.fleet.plugins.module_utils.cell_nat  # noqa: F401
        return
    except ImportError:
        pass
    root = Path(tempfile.gettempdir()) / ("chv-fleet-unit-%d" % os.getuid())
    link = root / "ansible_collections" / "chv" / "fleet"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != REPO:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(REPO)
    sys.path.insert(0, str(root))
    for name in list(sys.modules):
        if name == "ansible_collections" or name.startswith("ansible_collections."):
            del sys.modules[name]


_ensure_collection_importable()
