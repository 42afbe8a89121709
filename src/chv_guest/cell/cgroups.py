"""The cells' cgroups: where this process's cgroups are, the directory a
cell gets in standalone scope, what of the policy's limits a directory
enforces, and removing a cell's tree."""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Dict, Iterable, List, Optional, Tuple, Union

from . import limits as limitsmod
from .fsutil import read_text


def mounts(mountinfo: str = "/proc/self/mountinfo") -> Dict[str, Tuple[str, str]]:
    """{"": (root, mountpoint) of cgroup2, "name=systemd": (...) of the v1 one}."""
    out: Dict[str, Tuple[str, str]] = {}
    with open(mountinfo) as fh:
        for line in fh:
            left, right = line.split(" - ", 1)
            lf, rf = left.split(), right.split()
            root, mnt, fstype, opts = lf[3], lf[4], rf[0], rf[2]
            if fstype == "cgroup2":
                out.setdefault("", (root, mnt))
            elif fstype == "cgroup" and "name=systemd" in opts.split(","):
                out.setdefault("name=systemd", (root, mnt))
    return out


def dirs_of(pid: Union[int, str] = "self") -> Dict[str, str]:
    """{"": cgroup2 dir, "name=systemd": v1 dir} of a process, as host paths."""
    known = mounts()
    out = {}
    with open("/proc/%s/cgroup" % pid) as fh:
        for line in fh:
            hier, ctrls, path = line.rstrip("\n").split(":", 2)
            key = "" if hier == "0" else ctrls
            if key in known:
                root, mnt = known[key]
                rel = path[len(root):] if root != "/" and path.startswith(root) else path
                out[key] = os.path.normpath(mnt + "/" + rel.lstrip("/"))
    return out


def dirs_for(slot_name: str) -> List[str]:
    """A standalone cell's cgroup directories: beside this process's own
    (cgroup2, and name=systemd on hybrid hosts: those nspawn would use)."""
    return [os.path.join(d, "chv-cell-" + slot_name) for d in dirs_of().values()]


def cgroup2_dir_for(slot_name: str) -> Optional[str]:
    """The cell's cgroup2 directory in standalone scope (None without cgroup2)."""
    d = dirs_of().get("")
    return os.path.join(d, "chv-cell-" + slot_name) if d else None


def scope_limit_problems(limits: Iterable[limitsmod.Limit], d: str, page: Optional[int] = None) -> List[str]:
    """What of ``limits`` the cgroup directory ``d`` does not enforce."""
    page = page or os.sysconf("SC_PAGE_SIZE")
    problems = []
    for lim in limits:
        try:
            got = read_text(os.path.join(d, lim.file))
        except OSError:
            problems.append("%s (%s): %s is absent in %s (controller %s not delegated)"
                            % (lim.prop, lim.file, lim.file, d, lim.controller))
            continue
        if not limitsmod.matches(lim, got, page):
            problems.append("%s (%s): reads %r in %s, asked %s" % (lim.prop, lim.file, got.strip(), d, lim.value))
    return problems


def host_facts_for_limits() -> Tuple[Optional[int], Optional[int]]:
    """Memory size and the system's task limit (for percentages)."""
    mem_total = tasks = None
    try:
        for line in read_text("/proc/meminfo").splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        tasks = min(int(read_text("/proc/sys/kernel/pid_max")), int(read_text("/proc/sys/kernel/threads-max")))
    except (OSError, ValueError):
        pass
    return mem_total, tasks


def _pids(top: str) -> List[int]:
    pids = []
    for dirpath, _dirs, files in os.walk(top):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(dirpath, "cgroup.procs")) as fh:
                    pids += [int(x) for x in fh.read().split()]
            except OSError:
                pass
    return pids


def remove_tree(top: str, kill: bool = False, wait: float = 2.0) -> None:
    if not os.path.isdir(top):
        return
    deadline = time.monotonic() + wait
    while True:
        pids = _pids(top)
        if not pids or not kill:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
        for dummy in range(50):
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    break
                time.sleep(0.02)
