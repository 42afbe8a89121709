"""A file of a fake host tree (a tmp directory standing for /), for the unit
tests of modules that read a host through a root prefix (chv.fleet.preflight)."""

import os


def write(root, path, text=""):
    """Write `text` at `path` (absolute, as on the host) under `root`; return the file's real path."""
    full = os.path.join(str(root), path.lstrip("/"))
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)
    return full
