"""The per-slot disk quota (policy ``disk_max``; role variable chv_cell_disk_max).

A slot's workspace and agent state (its home) live on a file system of
their own: one preallocated ext4 image per slot, loop-mounted by static
systemd mount units of the chv.fleet.cell_runtime role (tasks/disk.yml),
with the slot's two directories bind mounts of the image's ``workspace``
and ``home`` directories.  A cell that fills them gets ENOSPC from its own
file system; the guest's root file system is untouched.

The launcher does not mount anything: it refuses a run (exit 125) unless the
slot's directories are on the slot's own file system (``check_slot``):

- the workspace and the home are both mount points, of one device;
- that device is not the one of the directories around them (the guest's
  root file system when the mounts are missing, or a bind mount of a
  directory of it), and no other slot's workspace or home is on it;
- the mounts carry ``nodev`` and ``nosuid``;
- the file system is no larger than ``disk_max``.

Pure parts: ``parse_size``, ``parse_mountinfo`` and
``mount_problems`` (unit-tested with a fake mountinfo); ``check_slot`` reads
/proc/self/mountinfo and statvfs.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Iterable, List, Mapping, Optional, Sequence, Set, Type, TypedDict

if TYPE_CHECKING:
    from .policy import Policy, Slot  # policy imports this module

# Sizes as the role variable takes them: a whole number of KiB, MiB, GiB or
# TiB (base 1024, the unit letter required; what fallocate -l, truncate -s
# and systemd's MemoryMax= read the same way).
_SIZE_RE = re.compile(r"^([1-9][0-9]{0,12})([KMGT])\Z")
_FACTORS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ext4 with a journal needs some room; below this a slot could not hold a
# checkout at all.
MIN_SIZE = 16 << 20
MAX_SIZE = 64 << 40
ROLE_VARIABLE = "chv_cell_disk_max"
# Options every mount of a slot's file system carries.
REQUIRED_OPTIONS = ("nodev", "nosuid")
MOUNTINFO = "/proc/self/mountinfo"


class DiskError(Exception):
    """The slot's disk quota is not in force; the message says what is missing."""


if TYPE_CHECKING:  # a TypedDict compiles its annotations at import (about 1 ms): for the checker only
    class Mount(TypedDict):
        """One line of a mountinfo text (parse_mountinfo)."""

        dev: str
        root: str
        mountpoint: str
        options: Set[str]
        fstype: str
        source: str


def parse_size(text: object) -> int:
    """Bytes of a size string such as ``2G`` or ``64M``; ValueError (naming
    the role variable) for anything else or a size out of range."""
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(
            "%s %r is not a size: a whole number with K, M, G or T (base 1024), such as 2G" % (ROLE_VARIABLE, text)
        )
    n = int(m.group(1)) * _FACTORS[m.group(2)]
    if not MIN_SIZE <= n <= MAX_SIZE:
        raise ValueError("%s %r must be between 16M and 64T" % (ROLE_VARIABLE, text))
    return n


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[Mount]:
    """The mounts of a /proc/PID/mountinfo text, in order: dicts with
    ``dev`` ("major:minor"), ``root``, ``mountpoint``, ``options`` (the
    per-mount ones, a set), ``fstype`` and ``source``."""
    out: List[Mount] = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf, rf = left.split(), right.split()
        if len(lf) < 6 or len(rf) < 2:
            continue
        out.append({
            "dev": lf[2],
            "root": _unescape(lf[3]),
            "mountpoint": _unescape(lf[4]),
            "options": set(lf[5].split(",")),
            "fstype": rf[0],
            "source": _unescape(rf[1]),
        })
    return out


def _is_under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def mount_of(mounts: Iterable[Mount], path: str) -> Optional[Mount]:
    """The mount that holds ``path`` (the last one mounted at the longest
    mount point above or at it)."""
    best = None
    for m in mounts:
        if _is_under(path, m["mountpoint"]) and (best is None or len(m["mountpoint"]) >= len(best["mountpoint"])):
            best = m
    return best


def mount_problems(mounts: Sequence[Mount], paths: Mapping[str, str], other_paths: Iterable[str],
                   fs_size: Optional[int] = None, disk_max: Optional[int] = None) -> List[str]:
    """What keeps a slot's disk quota from being in force.

    ``paths``: {"workspace": path, "home": path} of the slot (resolved);
    ``other_paths``: the other slots' workspaces and homes; ``fs_size``: the
    bytes of the file system at the workspace (statvfs), checked against
    ``disk_max`` bytes when both are given.  An empty list: in force."""
    problems = []
    found = {}
    for kind, path in sorted(paths.items()):
        m = mount_of(mounts, path)
        if m is None or m["mountpoint"] != path:
            where = " (it is on the file system mounted at %s)" % m["mountpoint"] if m else ""
            problems.append("the %s %s is not a mount point of the slot's own file system%s" % (kind, path, where))
            continue
        parent = mount_of([x for x in mounts if x is not m and x["mountpoint"] != path], os.path.dirname(path))
        if parent is not None and parent["dev"] == m["dev"]:
            problems.append(
                "the %s %s is a bind mount of the file system of %s (%s), not the slot's own"
                % (kind, path, parent["mountpoint"], m["dev"])
            )
            continue
        missing = [o for o in REQUIRED_OPTIONS if o not in m["options"]]
        if missing:
            problems.append("the %s %s is mounted without %s" % (kind, path, ",".join(missing)))
        found[kind] = m
    devs = {m["dev"] for m in found.values()}
    if len(devs) > 1:
        problems.append(
            "the workspace and the home are on different file systems (%s)"
            % ", ".join("%s %s" % (k, found[k]["dev"]) for k in sorted(found))
        )
    for other in other_paths:
        m = mount_of(mounts, other)
        if m is not None and m["mountpoint"] == other and m["dev"] in devs:
            problems.append("another slot's %s is on the same file system (%s)" % (other, m["dev"]))
    if fs_size is not None and disk_max is not None and fs_size > disk_max and found:
        problems.append("the file system has %d bytes, more than disk_max (%d bytes)" % (fs_size, disk_max))
    return problems


def _fs_size(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def check_slot(policy: Policy, slot: Slot, paths: Mapping[str, str],
               error: Type[Exception] = DiskError, mountinfo: str = MOUNTINFO) -> None:
    """Raise ``error`` unless the slot's disk quota is in force (policy
    ``disk_max`` set); nothing to check when it is null.  ``paths``: the
    slot's argv.cell_paths()."""
    limit = policy.get("disk_max")
    if limit is None:
        return
    disk_max = parse_size(limit)
    own = {"workspace": os.path.realpath(paths["workspace"]), "home": os.path.realpath(paths["agent_state"])}
    others = []
    for s in policy["slots"]:
        if s["name"] != slot["name"]:
            for root in (policy["workspace_root"], policy["agent_state_root"]):
                others.append(os.path.realpath(os.path.join(root, s["name"])))
    with open(mountinfo) as fh:
        mounts = parse_mountinfo(fh.read())
    try:
        size = _fs_size(own["workspace"])
    except OSError:
        size = None
    problems = mount_problems(mounts, own, others, size, disk_max)
    if problems:
        raise error(
            "disk quota (disk_max %s, role variable %s) not in force, refusing the run: %s; the role's mount units "
            "(chv-cell-disks.target) mount them" % (limit, ROLE_VARIABLE, "; ".join(problems))
        )
