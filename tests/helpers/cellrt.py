"""A small, valid policy for the launcher's tests and the entry point
(src/chv-cell) they run (fixtures: tests/unit/cell_runtime/conftest.py)."""

import os
import shutil

import pytest

from testpaths import SRC

ENTRY = os.path.join(SRC, "chv-cell")


def make_slot(i, base=10, uid_base=None, host_prefix="lth"):
    return {
        "name": "slot%d" % i,
        "index": i,
        "machine": "lt-slot%d" % i,
        "host_ifname": "%s%d" % (host_prefix, i),
        "cell_ifname": "eth0",
        "subnet": "10.231.%d.0/24" % (base + i),
        "gateway": "10.231.%d.1" % (base + i),
        "address": "10.231.%d.2" % (base + i),
        "prefixlen": 24,
        "uid_base": uid_base if uid_base is not None else 3000000 + i * 65536,
        "uid_size": 65536,
    }


BASE_POLICY = {
    "version": 1,
    "state_dir": "/run/chv-fleet-unit",
    "workspace_root": "/nonexistent/ws",
    "agent_state_root": "/nonexistent/state",
    "inaccessible": ["/etc/chv", "/root/.git-credentials", "/usr/lib/chromium", "/opt/chv-browser"],
    "readonly_binds": [
        {"source": "/app", "target": "/app", "optional": True},
        {"source": "/etc/ssl/certs", "target": "/etc/ssl/certs", "optional": True},
    ],
    "writable_binds": [{"source": "/run/chv", "target": "/run/chv", "optional": False}],
    "properties": {"MemoryMax": "2G", "TasksMax": 512},
    "rlimits": {"NOFILE": "4096:8192"},
    "slots": [make_slot(0), make_slot(1)],
}


# What a test module of real cells needs on this machine (its pytestmark):
# root, and nspawn, ip and nsenter.
NEEDS_REAL_CELLS = [
    pytest.mark.skipif(os.geteuid() != 0, reason="real cells need root"),
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("systemd-nspawn", "ip", "nsenter")),
        reason="systemd-nspawn, ip and nsenter are needed for real cells",
    ),
]


def real_cells_marks(tools, root_reason="real cells need root"):
    """The pytestmark of a module of real cells that needs ``tools`` (named in its skip reason)."""
    return [
        pytest.mark.cells,
        pytest.mark.skipif(os.geteuid() != 0, reason=root_reason),
        pytest.mark.skipif(not all(shutil.which(t) for t in tools),
                           reason="%s and %s are needed" % (", ".join(tools[:-1]), tools[-1])),
    ]


# nspawn's line at a cell's end on these machines (the host's /run is no tmpfs):
# noise the tests leave out of the launcher's stderr
NOISE = 'Attempted to remove disk file system under "/run/systemd/nspawn/propagate/'
