"""What the Linux launchers read from the host, and the one thing they
prepare on it for nspawn: the scope mode, which paths exist, the /proc
facts of a process, and systemd's inaccessible nodes."""

from __future__ import annotations

import os
import stat
from typing import Callable, FrozenSet, Iterable, List, Optional, Set, Tuple

from . import policy as policymod
from .errors import SetupError

INACCESSIBLE_DIR = "/run/systemd/inaccessible"


def resolve_scope(policy: policymod.Policy) -> str:
    """systemd: each cell runs in its own transient scope (systemd-run
    --scope, through the system bus; needs systemd as PID 1) that carries the
    policy's unit properties; standalone: the launcher gives each cell its own
    cgroup (no unit properties).  nspawn always keeps the unit it is in."""
    if policy["scope"] != "auto":
        return str(policy["scope"])
    if os.path.isdir("/run/systemd/system") and os.path.exists("/run/dbus/system_bus_socket"):
        return "systemd"
    return "standalone"


def probe(paths: Iterable[str]) -> FrozenSet[str]:
    return frozenset(p for p in paths if os.path.lexists(p))


def ensure_inaccessible_nodes(base: str = INACCESSIBLE_DIR) -> None:
    """nspawn's --inaccessible= over-mounts the path with the host's
    /run/systemd/inaccessible/<type> node.  systemd (PID 1) creates those at
    boot; on hosts where systemd is not PID 1 they are missing and the cell
    fails to start, so create the same mode-0000 nodes if they are absent."""
    if os.path.isdir(base) and os.path.exists(os.path.join(base, "reg")):
        return
    os.makedirs(base, mode=0o755, exist_ok=True)
    old = os.umask(0o777)
    try:
        makers: Tuple[Tuple[str, Callable[[str], None]], ...] = (
            ("reg", lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0))),
            ("dir", lambda p: os.mkdir(p, 0)),
            ("fifo", lambda p: os.mkfifo(p, 0)),
            ("chr", lambda p: os.mknod(p, stat.S_IFCHR, os.makedev(0, 0))),
            ("blk", lambda p: os.mknod(p, stat.S_IFBLK, os.makedev(0, 0))),
        )
        for name, make in makers:
            path = os.path.join(base, name)
            if not os.path.lexists(path):
                try:
                    make(path)
                except OSError as exc:
                    if name in ("reg", "dir"):
                        raise SetupError("cannot create %s: %s" % (path, exc.strerror))
    finally:
        os.umask(old)
    sock = os.path.join(base, "sock")
    if not os.path.lexists(sock):
        import socket  # noqa: PLC0415 (seldom needed: start-up time)

        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(sock)
            os.chmod(sock, 0)
        except OSError:
            pass
        finally:
            s.close()


def children(pid: int) -> List[int]:
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []


def pidns(pid: int) -> Optional[int]:
    try:
        return os.stat("/proc/%d/ns/pid" % pid).st_ino
    except OSError:
        return None


def uid_map_matches(pid: int, slot: policymod.Slot) -> bool:
    try:
        with open("/proc/%d/uid_map" % pid) as fh:
            first = fh.readline().split()
    except OSError:
        return False
    return first == ["0", str(slot["uid_base"]), str(slot["uid_size"])]


def netdev_names(pid: int) -> Set[str]:
    try:
        with open("/proc/%d/net/dev" % pid) as fh:
            lines = fh.read().splitlines()[2:]
    except OSError:
        return set()
    return {ln.split(":", 1)[0].strip() for ln in lines if ":" in ln}
