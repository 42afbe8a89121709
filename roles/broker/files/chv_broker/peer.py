"""Peer check: which live cell (if any) is on the other end of a connection.

A peer belongs to slot S when, for the live cell record of S written by the
launcher in the root-only state directory:
  * the peer's SO_PEERCRED uid lies in [uid_base, uid_base + uid_size), and
  * the peer's pid namespace (readlink /proc/<peer>/ns/pid) is the pid
    namespace of the cell's leader process (readlink /proc/<leader>/ns/pid).

Nothing a cell can write takes part in the decision: the records come from a
directory cells never see, the namespace identity comes from the kernel.
Reading another user's /proc/<pid>/ns/* needs CAP_SYS_PTRACE (ptrace read
access); the broker keeps that capability for this reason only.

Pid reuse: where the kernel supports SO_PEERPIDFD (Linux >= 6.5) the broker
holds a pidfd for the very process that connected; otherwise it opens one
right after SO_PEERCRED.  After reading the namespace it checks the pidfd's
process is still alive, so a recycled pid cannot pass for the peer.
"""
import json
import os
import signal
import socket
import struct

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")


class PeerRejected(Exception):
    """The peer is not a process of any live cell."""

    def __init__(self, reason, pid=None, uid=None):
        super().__init__(reason)
        self.reason = reason
        self.pid = pid
        self.uid = uid


def peer_credentials(conn):
    """(pid, uid, gid) of the process that connected ``conn``."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def _peer_pidfd(conn, pid):
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _alive(pidfd):
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # The process exists; we may not signal it, which is fine.
        return True


def pid_namespace(pid, proc="/proc"):
    return os.readlink(os.path.join(proc, str(pid), "ns", "pid"))


def load_cells(cells_dir):
    """Read every live cell record; malformed records are skipped.

    Returns a list of dicts with slot, pid, uid_base, uid_size.
    """
    cells = []
    try:
        names = sorted(os.listdir(cells_dir))
    except FileNotFoundError:
        return cells
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
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
        cells.append({"slot": slot, "pid": pid, "uid_base": base, "uid_size": size})
    return cells


def match_cell(pid, uid, cells, ns_of=pid_namespace):
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


class PeerChecker:
    def __init__(self, cells_dir, proc="/proc"):
        self.cells_dir = cells_dir
        self.proc = proc

    def live_slots(self):
        return {c["slot"] for c in load_cells(self.cells_dir)
                if os.path.exists(os.path.join(self.proc, str(c["pid"])))}

    def identify(self, conn):
        """Return the matching cell record, or raise PeerRejected."""
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
