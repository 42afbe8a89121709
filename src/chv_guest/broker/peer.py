"""Peer check: which live cell (if any) is on the other end of a connection.

A peer is slot S's when its uid lies in S's range and its pid namespace is
that of S's leader (on macOS: its uid is S's slot user), by the launcher's
records and the kernel only; the steps, and why each: docs/services.md
("The peer check"), docs/macos.md for macOS.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import Callable, List, Optional, Set, Tuple, TypedDict

from ..wire import protocol

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")
# macOS <sys/un.h> and <sys/ucred.h>: getsockopt(fd, SOL_LOCAL,
# LOCAL_PEERCRED) fills a struct xucred {u_int cr_version; uid_t cr_uid;
# short cr_ngroups; gid_t cr_groups[NGROUPS (16)];} (76 bytes, the short
# padded to 4); LOCAL_PEERPID gives the peer's pid as an int.
SOL_LOCAL = 0
LOCAL_PEERCRED = 0x001
LOCAL_PEERPID = 0x002
XUCRED_VERSION = 0
XUCRED = struct.Struct("=IIhxx16I")


class _CellRequired(TypedDict):
    slot: str
    pid: int
    uid_base: int
    uid_size: int


class Cell(_CellRequired, total=False):
    """A live cell record as load_cells checked it (started, egress_proxy: where the record has them)."""
    started: float
    egress_proxy: str  # proxy mode: the cell's proxy URL (chv_guest.cell.argv.proxy_url), for its doors


class PeerRejected(Exception):
    """The peer is not a process of any live cell."""

    def __init__(self, reason: str, pid: Optional[int] = None, uid: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pid = pid
        self.uid = uid


def peer_credentials(conn: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``conn``."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def _peer_pidfd(conn: socket.socket, pid: int) -> Optional[int]:
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _exists(signal_zero: Callable[[], None]) -> bool:
    """Whether the process that ``signal_zero`` sends signal 0 to exists."""
    try:
        signal_zero()
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # The process exists; we may not signal it, which is fine.
        return True


def _alive(pidfd: int) -> bool:
    return _exists(lambda: signal.pidfd_send_signal(pidfd, 0))


def pid_namespace(pid: int, proc: str = "/proc") -> str:
    return os.readlink(os.path.join(proc, str(pid), "ns", "pid"))


def record_names(cells_dir: str) -> List[str]:
    """The file names of the cell records (NAME.json) in ``cells_dir``, sorted; none when it is missing."""
    try:
        return sorted(n for n in os.listdir(cells_dir) if n.endswith(".json"))
    except FileNotFoundError:
        return []


def load_cells(cells_dir: str) -> List[Cell]:
    """Read every live cell record; malformed records are skipped.

    Returns a list of dicts with slot, pid, uid_base, uid_size (and started, the
    launcher's start time, where the record has it).
    """
    cells: List[Cell] = []
    for name in record_names(cells_dir):
        if name.startswith("."):
            continue
        try:
            with open(os.path.join(cells_dir, name), "rb") as fh:
                rec = json.loads(fh.read(65536))
            slot = rec["slot"]
            pid, base, size = rec["pid"], rec["uid_base"], rec["uid_size"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not (isinstance(slot, str) and slot and name == slot + ".json"):
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, base, size)):
            continue
        if pid <= 1 or base < 0 or size <= 0:
            continue
        cell: Cell = {"slot": slot, "pid": pid, "uid_base": base, "uid_size": size}
        started = rec.get("started")
        if isinstance(started, (int, float)) and not isinstance(started, bool) and started > 0:
            cell["started"] = started
        proxy = rec.get("egress_proxy")
        if isinstance(proxy, str) and protocol.PROXY_URL_RE.fullmatch(proxy):
            cell["egress_proxy"] = proxy
        cells.append(cell)
    return cells


def incarnation(cell: Cell) -> str:
    """Which run of its slot a cell is, as chv-browser's "cell" field: the leader's pid and
    the launcher's start time from the root-owned record (nothing a cell writes). Two runs
    of one slot never share it, even when a pid is reused."""
    if "started" in cell:
        return "%d.%d" % (cell["pid"], round(cell["started"] * 1000))
    return "%d" % cell["pid"]


def match_cell(pid: int, uid: int, cells: List[Cell], ns_of: Callable[[int], str] = pid_namespace) -> Cell:
    """Pure decision: the cell whose uid range and pid namespace hold the peer."""
    in_range = [c for c in cells if c["uid_base"] <= uid < c["uid_base"] + c["uid_size"]]
    if not in_range:
        raise PeerRejected("uid outside every live cell's range", pid, uid)
    try:
        peer_ns = ns_of(pid)
    except OSError as exc:
        raise PeerRejected("cannot read peer pid namespace: %s" % exc.strerror, pid, uid) from None
    for cell in in_range:
        try:
            cell_ns = ns_of(cell["pid"])
        except OSError:
            continue  # cell leader gone: record is stale
        if cell_ns == peer_ns:
            return cell
    raise PeerRejected("pid namespace is not a live cell's", pid, uid)


def parse_xucred(raw: bytes) -> Tuple[int, Tuple[int, ...]]:
    """(uid, groups) from the bytes of a macOS struct xucred (pure)."""
    if len(raw) < XUCRED.size:
        raise PeerRejected("LOCAL_PEERCRED returned %d bytes, not a struct xucred" % len(raw))
    version, uid, ngroups, *groups = XUCRED.unpack(raw[:XUCRED.size])
    if version != XUCRED_VERSION:
        raise PeerRejected("struct xucred version %d is not %d" % (version, XUCRED_VERSION), uid=uid)
    if not 0 <= ngroups <= len(groups):
        raise PeerRejected("struct xucred holds %d groups" % ngroups, uid=uid)
    return uid, tuple(groups[:ngroups])


def peer_credentials_darwin(conn: socket.socket) -> Tuple[int, int]:
    """(pid, uid) of the process that connected ``conn`` (macOS)."""
    uid, _groups = parse_xucred(conn.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED.size))
    try:
        pid = conn.getsockopt(SOL_LOCAL, LOCAL_PEERPID)
    except OSError:
        pid = 0
    return pid, uid


def match_slot_user(uid: int, cells: List[Cell], alive: Callable[[int], bool]) -> Cell:
    """Pure decision (macOS): the live cell whose slot user is ``uid``.

    A record counts only with uid_size 1 (a slot user, as the macOS launcher
    writes it) and while ``alive(record pid)``."""
    for cell in cells:
        if cell["uid_size"] == 1 and cell["uid_base"] == uid:
            if alive(cell["pid"]):
                return cell
            raise PeerRejected("the cell of slot %s has ended" % cell["slot"], uid=uid)
    raise PeerRejected("uid is no live cell's slot user", uid=uid)


def pid_alive(pid: int) -> bool:
    return _exists(lambda: os.kill(pid, 0))


class PeerChecker:
    def __init__(self, cells_dir: str, proc: str = "/proc", platform: str = sys.platform) -> None:
        self.cells_dir = cells_dir
        self.proc = proc
        self.darwin = platform == "darwin"

    def live_slots(self) -> Set[str]:
        if self.darwin:
            return {c["slot"] for c in load_cells(self.cells_dir) if pid_alive(c["pid"])}
        return {c["slot"] for c in load_cells(self.cells_dir)
                if os.path.exists(os.path.join(self.proc, str(c["pid"])))}

    def identify(self, conn: socket.socket) -> Cell:
        """Return the matching cell record, or raise PeerRejected."""
        if self.darwin:
            _pid, uid = peer_credentials_darwin(conn)
            return match_slot_user(uid, load_cells(self.cells_dir), pid_alive)
        pid, uid, _gid = peer_credentials(conn)
        if pid <= 0:
            raise PeerRejected("peer has no pid in our pid namespace", pid, uid)
        pidfd = _peer_pidfd(conn, pid)
        if pidfd is None:
            raise PeerRejected("peer process is gone", pid, uid)
        try:
            cell = match_cell(pid, uid, load_cells(self.cells_dir),
                              lambda p: pid_namespace(p, self.proc))
            if not _alive(pidfd):
                raise PeerRejected("peer process exited during the check", pid, uid)
            return cell
        finally:
            os.close(pidfd)
