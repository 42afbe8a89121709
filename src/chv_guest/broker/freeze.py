"""Freeze the requesting cell while chv-broker syncs its repository (standard library only).

The worker's checks and git read the same cell-owned files: a frozen cell
cannot swap them in between. Which cgroup, how it is frozen, the counting
and --thaw-all: docs/security.md ("Check = use").
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from . import peer

if TYPE_CHECKING:
    from .peer import Cell


class FreezeError(Exception):
    pass


def cgroup2_root(mountinfo: str = "/proc/self/mountinfo") -> Optional[str]:
    """Mount point of the cgroup2 hierarchy (pure cgroup2: /sys/fs/cgroup; hybrid: .../unified)."""
    try:
        with open(mountinfo, encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == "cgroup2":
                    return fields[4]
    except (OSError, ValueError, IndexError):
        pass
    return None


def cell_cgroup_path(proc_cgroup_text: str, slot: str) -> str:
    """The cell's cgroup (a path relative to the cgroup2 root) from ``/proc/<leader>/cgroup``.

    Pure. The outermost component named for ``slot`` (``chv-cell-<slot>`` or
    ``chv-cell-<slot>-<run>.scope``) ends the path. Raises FreezeError when
    there is no cgroup2 line or no such component.
    """
    rel = None
    for line in proc_cgroup_text.splitlines():
        hier, _c, rest = line.partition(":")
        controllers, _c, path = rest.partition(":")
        if hier == "0" and controllers == "":
            rel = path
    if rel is None:
        raise FreezeError("the cell's leader is in no cgroup v2 cgroup")
    parts = [p for p in rel.split("/") if p]
    own = re.compile(r"chv-cell-%s(-[A-Za-z0-9_.@-]+\.scope)?" % re.escape(slot))
    for i, part in enumerate(parts):
        if own.fullmatch(part):
            return "/" + "/".join(parts[:i + 1])
    raise FreezeError("the cell's leader is not in a cgroup of slot %s (%s)" % (slot, rel))


def unit_of(path: str) -> Optional[str]:
    """The systemd unit a cgroup path ends in (``....scope``), or None."""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last if last.endswith((".scope", ".service")) else None


class Freezer:
    """Freezes and thaws cells' cgroups, counted per cgroup."""

    def __init__(self, root: Optional[str] = None, systemctl: str = "/usr/bin/systemctl", timeout: float = 5.0,
                 proc: str = "/proc") -> None:
        self.root = root if root is not None else cgroup2_root()
        self.systemctl = systemctl
        self.timeout = timeout
        self.proc = proc
        self._lock = threading.Lock()
        self._count: Dict[str, int] = {}

    def cgroup_of(self, cell: Cell) -> str:
        try:
            with open(os.path.join(self.proc, str(int(cell["pid"])), "cgroup"), encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise FreezeError("the cell's leader is gone: %s" % exc.strerror) from None
        if not self.root:
            raise FreezeError("no cgroup v2 hierarchy is mounted")
        return os.path.join(self.root, cell_cgroup_path(text, cell["slot"]).lstrip("/"))

    def _write(self, d: str, value: str) -> None:
        try:
            with open(os.path.join(d, "cgroup.freeze"), "w", encoding="ascii") as fh:
                fh.write(value)
            return
        except OSError as exc:
            unit = unit_of(d)
            if unit is None or not os.path.exists(self.systemctl) or exc.errno not in (1, 13, 30):
                raise FreezeError("cannot write %s/cgroup.freeze: %s" % (d, exc.strerror)) from None
        # read-only cgroup file system (ProtectControlGroups=yes): systemd freezes its unit
        proc = subprocess.run([self.systemctl, "freeze" if value == "1" else "thaw", "--", unit],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout, check=False)
        if proc.returncode != 0:
            raise FreezeError("systemctl %s %s: %s" % ("freeze" if value == "1" else "thaw", unit,
                                                       proc.stderr.decode("utf-8", "replace").strip()[:200]))

    def frozen(self, d: str) -> bool:
        try:
            with open(os.path.join(d, "cgroup.events"), encoding="ascii") as fh:
                return "frozen 1" in fh.read().splitlines()
        except OSError:
            return False

    def freeze(self, cell: Cell) -> str:
        """Freeze the cell's cgroup (and wait until the kernel says it is frozen); returns it."""
        d = self.cgroup_of(cell)
        with self._lock:
            n = self._count.get(d, 0)
            if n == 0:
                self._write(d, "1")
            self._count[d] = n + 1
        deadline = time.monotonic() + self.timeout
        while not self.frozen(d):
            if time.monotonic() > deadline:
                self.thaw(d)
                raise FreezeError("the cell's cgroup did not freeze within %ss" % self.timeout)
            time.sleep(0.002)
        return d

    def thaw(self, d: str) -> None:
        with self._lock:
            n = self._count.get(d, 0) - 1
            if n > 0:
                self._count[d] = n
                return
            self._count.pop(d, None)
            try:
                self._write(d, "0")
            except FreezeError:
                if os.path.isdir(d):
                    raise


def thaw_all(cells_dir: str, freezer: Optional[Freezer] = None) -> List[str]:
    """Thaw the cgroup of every cell record (chv-broker --thaw-all). Returns the ones thawed."""
    freezer = freezer or Freezer()
    done: List[str] = []
    for name in peer.record_names(cells_dir):
        try:
            with open(os.path.join(cells_dir, name), encoding="utf-8") as fh:
                rec = json.load(fh)
            d = freezer.cgroup_of(rec)
            if freezer.frozen(d):
                freezer._write(d, "0")  # pylint: disable=protected-access
                done.append(d)
        except (OSError, ValueError, KeyError, TypeError, FreezeError):
            continue
    return done
