"""`chv-cell run`: claim a slot, start the cell, gate the payload on the
network, relay the exit code, clean up.  Side effects live here; the argv
and the resolver files come from the pure modules."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple,
                    TypedDict, Union)

from . import argv as argvmod
from .errors import Interrupted, RuntimeLimit, SetupError
from .exits import EXIT_BUSY, EXIT_CONFIG, EXIT_RUNTIME, EXIT_SETUP
from .log import log
from . import claim as claimmod
from . import disk as diskmod
from . import limits as limitsmod
from . import policy as policymod
from . import resolver
from . import ruleset as rulesetmod

if TYPE_CHECKING:
    from types import FrameType

SHARED_NETWORK_REFUSAL = (
    "--shared-network is not allowed by the policy (allow_shared_network is false; role variable "
    "chv_cell_allow_shared_network)"
)
USERNS_SYSCTL = "/proc/sys/user/max_user_namespaces"
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C", "LC_ALL": "C"}

SLOT_DIR_MODE = 0o700  # a slot's workspace and agent state directory (its cell root's uid and gid)
PROPAGATE_DIR = "/run/systemd/nspawn/propagate"
INACCESSIBLE_DIR = "/run/systemd/inaccessible"
_PR_SET_PDEATHSIG = 1


# poll() reports these for an fd whose peer went away: POLLHUP (the other
# end of a socket or tty closed) and POLLERR (a pipe with no reader left).
# A regular file or /dev/null never reports either.
HANGUP_EVENTS = select.POLLHUP | select.POLLERR


def hangup_watch_fds(fds: Iterable[int] = (1, 2)) -> List[int]:
    """The fds among ``fds`` (stdout, stderr) that are open and so can be
    watched for a disconnected peer."""
    out = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        out.append(fd)
    return out


def hangup_reason(fd: int, events: int) -> Optional[str]:
    """Why a poll() result of a watched fd means the peer went away (None if
    it does not).  POLLNVAL (fd not open) is not a hangup."""
    if not events & HANGUP_EVENTS:
        return None
    what = {1: "stdout", 2: "stderr"}.get(fd, "fd %d" % fd)
    kind = "closed (POLLHUP)" if events & select.POLLHUP else "has no reader (POLLERR)"
    return "the peer of %s %s: the caller is gone" % (what, kind)


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


def read_record(policy: policymod.Policy, slot: policymod.Slot) -> Optional[Dict[str, Any]]:
    """The slot's live record (write_record), or None when there is none."""
    try:
        with open(argvmod.cell_paths(policy, slot)["record"]) as fh:
            rec = json.load(fh)
    except FileNotFoundError:
        return None
    return rec if isinstance(rec, dict) else {}


def warm_idle(rec: Optional[Dict[str, Any]]) -> bool:
    """A record of a warm cell that has no payload (yet): starting or waiting."""
    return bool(rec and rec.get("warm") and not rec.get("payload"))


def warm_waiting(policy: policymod.Policy, slot: policymod.Slot, rec: Optional[Dict[str, Any]] = None) -> bool:
    """The slot's warm cell is started and waits for a payload (``rec``: its
    record, when the caller has read it already)."""
    rec = read_record(policy, slot) if rec is None else rec
    return warm_idle(rec) and os.path.exists(argvmod.cell_paths(policy, slot)["warm_socket"])


def payload_running(policy: policymod.Policy, slot: policymod.Slot) -> bool:
    """A payload runs in the slot, or a cold cell is starting for one (a
    record that is not an idle warm cell's)."""
    rec = read_record(policy, slot)
    return rec is not None and not warm_idle(rec)


# ---------------------------------------------------------------- cgroups
def _cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> Dict[str, Tuple[str, str]]:
    """{"": (root, mountpoint) of cgroup2, "name=systemd": (...) of the v1 one}."""
    mounts: Dict[str, Tuple[str, str]] = {}
    with open(mountinfo) as fh:
        for line in fh:
            left, right = line.split(" - ", 1)
            lf, rf = left.split(), right.split()
            root, mnt, fstype, opts = lf[3], lf[4], rf[0], rf[2]
            if fstype == "cgroup2":
                mounts.setdefault("", (root, mnt))
            elif fstype == "cgroup" and "name=systemd" in opts.split(","):
                mounts.setdefault("name=systemd", (root, mnt))
    return mounts


def _cgroup_dirs_of(pid: Union[int, str] = "self") -> Dict[str, str]:
    """{"": cgroup2 dir, "name=systemd": v1 dir} of a process, as host paths."""
    mounts = _cgroup_mounts()
    out = {}
    with open("/proc/%s/cgroup" % pid) as fh:
        for line in fh:
            hier, ctrls, path = line.rstrip("\n").split(":", 2)
            key = "" if hier == "0" else ctrls
            if key in mounts:
                root, mnt = mounts[key]
                rel = path[len(root):] if root != "/" and path.startswith(root) else path
                out[key] = os.path.normpath(mnt + "/" + rel.lstrip("/"))
    return out


def _own_cgroup_dirs() -> List[str]:
    """Directories of this process's cgroups that nspawn itself would use:
    the cgroup2 one and (on hybrid hosts) the name=systemd v1 one."""
    return list(_cgroup_dirs_of().values())


def cgroup_dirs_for(slot_name: str) -> List[str]:
    return [os.path.join(d, "chv-cell-" + slot_name) for d in _own_cgroup_dirs()]


def cgroup2_dir_for(slot_name: str) -> Optional[str]:
    """The cell's cgroup2 directory in standalone scope (None without cgroup2)."""
    d = _cgroup_dirs_of().get("")
    return os.path.join(d, "chv-cell-" + slot_name) if d else None


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def scope_limit_problems(limits: Iterable[limitsmod.Limit], d: str, page: Optional[int] = None) -> List[str]:
    """What of ``limits`` the cgroup directory ``d`` does not enforce."""
    page = page or os.sysconf("SC_PAGE_SIZE")
    problems = []
    for lim in limits:
        try:
            got = _read(os.path.join(d, lim.file))
        except OSError:
            problems.append("%s (%s): %s is absent in %s (controller %s not delegated)"
                            % (lim.prop, lim.file, lim.file, d, lim.controller))
            continue
        if not limitsmod.matches(lim, got, page):
            problems.append("%s (%s): reads %r in %s, asked %s" % (lim.prop, lim.file, got.strip(), d, lim.value))
    return problems


def _host_facts_for_limits() -> Tuple[Optional[int], Optional[int]]:
    """Memory size and the system's task limit (for percentages)."""
    mem_total = tasks = None
    try:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        tasks = min(int(_read("/proc/sys/kernel/pid_max")), int(_read("/proc/sys/kernel/threads-max")))
    except (OSError, ValueError):
        pass
    return mem_total, tasks


def _cgroup_pids(top: str) -> List[int]:
    pids = []
    for dirpath, _dirs, files in os.walk(top):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(dirpath, "cgroup.procs")) as fh:
                    pids += [int(x) for x in fh.read().split()]
            except OSError:
                pass
    return pids


def remove_cgroup_tree(top: str, kill: bool = False, wait: float = 2.0) -> None:
    if not os.path.isdir(top):
        return
    deadline = time.monotonic() + wait
    while True:
        pids = _cgroup_pids(top)
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
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(sock)
            os.chmod(sock, 0)
        except OSError:
            pass
        finally:
            s.close()


# ---------------------------------------------------------------- helpers
def _write_atomic(path: str, data: str, mode: int) -> None:
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, data.encode())
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_children(pid: int) -> List[int]:
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []


def _pidns(pid: int) -> Optional[int]:
    try:
        return os.stat("/proc/%d/ns/pid" % pid).st_ino
    except OSError:
        return None


def _uid_map_matches(pid: int, slot: policymod.Slot) -> bool:
    try:
        with open("/proc/%d/uid_map" % pid) as fh:
            first = fh.readline().split()
    except OSError:
        return False
    return first == ["0", str(slot["uid_base"]), str(slot["uid_size"])]


def _netdev_names(pid: int) -> Set[str]:
    try:
        with open("/proc/%d/net/dev" % pid) as fh:
            lines = fh.read().splitlines()[2:]
    except OSError:
        return set()
    return {ln.split(":", 1)[0].strip() for ln in lines if ":" in ln}


def _start(cmd: Sequence[str], data: str) -> subprocess.Popen[bytes]:
    """Popen ``cmd`` with ``data`` written to its stdin (closed after), its
    stdout and stderr together in one pipe."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None  # stdin=PIPE
    try:
        proc.stdin.write(data.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    proc.stdin = None  # written and closed: communicate() only reads
    return proc


def _is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def _ensure_dir(path: str, mode: int, uid: Optional[int] = None) -> None:
    """Create path (and parents, root-only) if missing; never follow a symlink at the leaf."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755)
        os.mkdir(path, mode)
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, uid)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError("%s exists and is not a directory" % path)


def _ensure_slot_dir(path: str, uid: int) -> None:
    """A slot's workspace or agent state directory: created where missing,
    and always left owned by the slot's cell root, uid and gid ``uid`` (no
    group shared between slots or with the agent user), mode 0700.  One that
    exists with another owner, group or mode (the setgid agent group of
    older releases, or a cell's chmod) is corrected through its fd, opened
    O_NOFOLLOW|O_DIRECTORY (its name lies in a root-owned directory)."""
    _ensure_dir(path, SLOT_DIR_MODE, uid=uid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SetupError("cannot open the slot directory %s: %s" % (path, exc.strerror))
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, uid):
            os.fchown(fd, uid, uid)
        if stat.S_IMODE(st.st_mode) != SLOT_DIR_MODE:
            os.fchmod(fd, SLOT_DIR_MODE)
    finally:
        os.close(fd)


def _ensure_dir_beneath(base: str, parts: Iterable[str], mode: int, uid: int) -> None:
    """Create the directory base/parts[0]/parts[1]/... where missing, each new
    one owned by ``uid`` with ``mode``, never following a symlink: ``base``
    and every component are opened with O_NOFOLLOW|O_DIRECTORY relative to
    the previous one.  ``base`` (the slot's agent state dir) is writable by
    the cell, so a component that is a symlink or not a directory raises
    SetupError naming it instead of being used."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    path = base
    try:
        fd = os.open(base, flags)
    except OSError as exc:
        raise SetupError("cannot open %s: %s" % (base, exc.strerror))
    try:
        for part in parts:
            path = os.path.join(path, part)
            try:
                os.mkdir(part, mode, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                raise SetupError("%s (mount point of a workspace alias) is a symlink or not a directory (%s); move it away"
                                 % (path, exc.strerror))
            os.close(fd)
            fd = nfd
            if created:
                os.fchown(fd, uid, uid)
                os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _writable_proc_sys(libc: ctypes.CDLL, path: str = "/proc/sys") -> None:
    """In a forked child only: when ``path`` is a read-only mount, move to a
    private mount namespace and remount it read-write there (the flags
    nosuid/nodev/noexec are kept).  Nothing changes for other processes."""
    st = os.statvfs(path)
    if not st.f_flag & os.ST_RDONLY:
        return
    keep = st.f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)  # same bits as MS_NOSUID|MS_NODEV|MS_NOEXEC
    if libc.unshare(CLONE_NEWNS) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "unshare(CLONE_NEWNS): " + os.strerror(e))
    for target, flags, what in (
        (b"/", _MS_REC | _MS_PRIVATE, "make / private"),
        (path.encode(), _MS_REMOUNT | _MS_BIND | keep, "remount %s read-write" % path),
    ):
        if libc.mount(None, target, None, flags, None) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "%s: %s" % (what, os.strerror(e)))


# ---------------------------------------------------------------- the verdict channel
# `chv-cell run --status-fd N`: one JSON line on fd N, which only the caller
# holds (the launcher makes it close-on-exec and starts nspawn with
# close_fds; a warm cell gets only fds 0-2), so the payload cannot write it.
VERDICTS = ("ran", "runtime", "signal", "setup", "busy", "config", "unknown")


if TYPE_CHECKING:  # a TypedDict compiles its annotations at import (about 1 ms): for the checker only
    class StatusRecord(TypedDict):
        verdict: str  # one of VERDICTS
        exit: int
        slot: Optional[str]
        payload_started: bool
        payload_exit: Optional[int]


def status_record(rc: int, stage: Optional[str], slot: Optional[str] = None, payload_started: bool = False,
                  payload_exit: Optional[int] = None) -> StatusRecord:
    """The verdict of a run that ended with ``rc`` (pure).

    ``stage``: how far the run got: "config" (refused before anything was
    claimed), "setup" (failed before a slot was held), "busy", "signal"
    (stopped while waiting for a slot), "claimed" (a cold cell in ``slot``)
    or "warm" (a warm cell took it and its launcher did not report how the
    payload ended, as an older launcher does not: the verdict is "unknown";
    one that reported it is judged as "claimed").  For "claimed": "ran" when
    the payload ended by itself and ``rc`` is its exit code; "runtime" when
    runtime_max stopped it; "signal" when a signal or a hang-up stopped the
    run; "setup" otherwise (the payload did not start, or the cell's
    teardown failed after it: ``payload_exit`` still says how it ended)."""
    if stage == "claimed":
        if payload_exit is not None and rc == payload_exit:
            verdict = "ran"
        elif payload_started and payload_exit is None and rc == EXIT_RUNTIME:
            verdict = "runtime"
        elif payload_exit is None and rc > 128:
            verdict = "signal"
        else:
            verdict = "setup"
    elif stage == "warm":
        verdict = "unknown"
    elif stage in ("config", "setup", "busy", "signal"):
        verdict = stage
    else:
        raise ValueError("unknown stage %r" % (stage,))
    return {"verdict": verdict, "exit": rc, "slot": slot, "payload_started": bool(payload_started),
            "payload_exit": payload_exit}


def status_fd_problem(fd: object) -> Optional[str]:
    """None when ``fd`` can carry the verdict: a number above 2 (0-2 are the
    payload's streams) open for writing.  Otherwise what is wrong with it."""
    import fcntl  # noqa: PLC0415

    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 3:
        return "--status-fd %r: must be a file descriptor number of 3 or more (0-2 are the payload's streams)" % (fd,)
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return "--status-fd %d: that file descriptor is not open (through sudo it needs the sudoers option " \
               "closefrom_override and sudo -C, which chv-cell does itself)" % fd
    if flags & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
        return "--status-fd %d: that file descriptor is not open for writing" % fd
    return None


def write_status(fd: int, record: StatusRecord) -> None:
    """Write ``record`` as one JSON line to ``fd`` and close it; a reader
    that went away is ignored (the exit code still reaches the caller)."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as exc:
        log("cannot write the verdict to --status-fd %d: %s" % (fd, exc.strerror))
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------- launcher
class Launcher:
    """One ``chv-cell run``.  ``caller`` (text, e.g. ``chv (uid 1000) through
    sudo``) is only logged with ``verbose``.  ``watch_fds`` are the fds whose
    disconnected peer stops the run like SIGHUP (default: stdout and stderr,
    those that are open when the run starts)."""

    _wake_r: Optional[int]
    _wake_w: Optional[int]

    def __init__(self, policy: policymod.Policy, verbose: bool = False, caller: Optional[str] = None,
                 watch_fds: Optional[Iterable[int]] = None) -> None:
        self.policy = policy
        self.verbose = verbose
        self.caller = caller
        self._watch_arg = watch_fds
        self._watch: List[int] = []
        self.stop_signal: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self._wake_r = self._wake_w = None
        self._old_handlers: Dict[int, Union[Callable[[int, Optional[FrameType]], Any], int, None]] = {}
        self._old_wakeup: Optional[int] = None
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.exe = "systemd-nspawn"
        # A warm launcher (warm.WarmCell) sets these: nspawn's stdin, and
        # fds the run waits on besides nspawn (its caller's connection).
        self.spawn_stdin: Optional[int] = None
        self.wait_fds: List[int] = []
        self.record_extra: Dict[str, Any] = {}
        # The verdict channel (write_status): the fd given with
        # --status-fd, and what the run learnt about its payload.
        self.status_fd: Optional[int] = None
        self.stage: Optional[str] = None
        self.claimed_slot: Optional[str] = None
        self.payload_started = False
        self.payload_exit: Optional[int] = None
        # set by warm.handover when a warm cell took the payload and its
        # launcher reported how the payload ended (payload_exit in its reply)
        self.warm_reported = False

    def debug(self, msg: str) -> None:
        if self.verbose:
            log(msg)

    # -- signals --------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def install_signals(self) -> None:
        # Before the wake-up pipe exists: a closed fd 1 or 2 must not be
        # taken for it.
        self._watch = hangup_watch_fds() if self._watch_arg is None else list(self._watch_arg)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[s] = signal.signal(s, self._on_signal)

    def restore_signals(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        if self._wake_r is not None and self._wake_w is not None:  # set together, by install_signals
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    def _drain_wakeup(self) -> None:
        assert self._wake_r is not None  # called from sleep(), after install_signals()
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def sleep(self, seconds: float, extra_fds: Sequence[int] = ()) -> List[int]:
        """Sleep up to ``seconds``; return the fds of ``extra_fds`` that are
        readable (or hung up).  Raise Interrupted on a stop signal, and also
        (as SIGHUP, with a reason) when a watched fd reports POLLHUP or
        POLLERR: without a tty, sshd sends no SIGHUP when the connection
        drops, but the session's pipes or sockets lose their peer."""
        if self.stop_signal is not None:
            raise Interrupted(self.stop_signal, self.stop_reason)
        assert self._wake_r is not None  # install_signals() ran
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in extra_fds:
            poller.register(fd, select.POLLIN)
        watched = [fd for fd in self._watch if fd not in extra_fds and fd != self._wake_r]
        for fd in watched:
            poller.register(fd, HANGUP_EVENTS)
        ready = []
        for fd, ev in poller.poll(max(0, int(seconds * 1000 + 0.999))):
            if fd == self._wake_r:
                self._drain_wakeup()
            elif fd in watched:
                if ev & select.POLLNVAL:
                    self._watch.remove(fd)  # closed meanwhile: nothing to watch
                    continue
                reason = hangup_reason(fd, ev)
                if reason and self.stop_signal is None:
                    self.stop_signal, self.stop_reason = signal.SIGHUP, reason
            else:
                ready.append(fd)
        if self.stop_signal is not None:
            raise Interrupted(self.stop_signal, self.stop_reason)
        return ready

    # -- stale state ----------------------------------------------------
    def reap(self, slot: policymod.Slot, scope: str) -> None:
        """Remove whatever a dead launcher left for this slot (we hold its lock)."""
        paths = argvmod.cell_paths(self.policy, slot)
        try:
            with open(paths["record"]) as fh:
                rec = json.load(fh)
            pid = int(rec["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = None
        if pid and _pidns(pid) not in (None, _pidns(os.getpid())) and _uid_map_matches(pid, slot):
            log("slot %s: killing stale cell (leader pid %d) left by a dead launcher" % (slot["name"], pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _unlink(paths["record"])
        if scope == "standalone":
            for d in cgroup_dirs_for(slot["name"]):
                remove_cgroup_tree(d, kill=True)
        self._wait_ifname_gone(slot)
        self._remove_runtime_files(slot)

    def _wait_ifname_gone(self, slot: policymod.Slot, wait: float = 3.0) -> None:
        """A cell's veth dies with its network namespace, a moment after the
        cell.  One that stays is not ours to delete: fail loudly instead."""
        ifname = slot["host_ifname"]
        deadline = time.monotonic() + wait
        while os.path.exists("/sys/class/net/" + ifname):
            if time.monotonic() > deadline:
                raise SetupError(
                    "interface %s still exists (a cell outside this launcher's control, or a foreign "
                    "interface): not touching it; inspect with 'ip link show %s'" % (ifname, ifname)
                )
            time.sleep(0.01)

    def _remove_runtime_files(self, slot: policymod.Slot) -> None:
        paths = argvmod.cell_paths(self.policy, slot)
        _unlink(paths["gate"])
        if os.path.isdir(paths["net_dir"]) and not os.path.islink(paths["net_dir"]):
            shutil.rmtree(paths["net_dir"], ignore_errors=True)
        prop = os.path.join(PROPAGATE_DIR, slot["machine"])
        if os.path.isdir(prop) and not os.path.islink(prop) and not _is_mountpoint(prop):
            shutil.rmtree(prop, ignore_errors=True)

    # -- setup ----------------------------------------------------------
    def prepare(self, slot: policymod.Slot, shared_network: bool) -> int:
        p = self.policy
        paths = argvmod.cell_paths(p, slot)
        diskmod.check_slot(p, slot, paths, SetupError)  # policy disk_max: the slot's own file system, or refuse
        state = p["state_dir"]
        _ensure_dir(state, 0o700)
        for sub in ("locks", "cells", "net", "gate"):
            _ensure_dir(os.path.join(state, sub), 0o700)
        _ensure_slot_dir(paths["workspace"], slot["uid_base"])
        _ensure_slot_dir(paths["agent_state"], slot["uid_base"])
        for parts in argvmod.alias_mountpoints(p):
            _ensure_dir_beneath(paths["agent_state"], parts, 0o755, slot["uid_base"])
        if not shared_network:
            servers, search = resolver.host_upstream(p["dns_servers"], p["dns_search"])
            _ensure_dir(paths["net_dir"], 0o755)
            _write_atomic(paths["resolv_conf"], resolver.render_resolv_conf(servers, search), 0o644)
            _write_atomic(paths["hosts"], resolver.render_hosts(slot["machine"], slot["address"]), 0o644)
        _unlink(paths["gate"])
        os.mkfifo(paths["gate"], 0o600)
        os.chmod(paths["gate"], 0o644)  # cell may read (unmapped "other"), never write
        # O_RDWR never blocks on a FIFO and keeps a writer present, so the
        # cell's reader blocks in read() until we write "go".
        return os.open(paths["gate"], os.O_RDWR | os.O_CLOEXEC)

    def spawn(self, argv: Sequence[str], cgroup_dirs: Iterable[str]) -> subprocess.Popen[bytes]:
        from . import families as familiesmod  # noqa: PLC0415 (spawn's own concern)

        parent = os.getpid()
        libc = self._libc
        procs_files = [os.path.join(d, "cgroup.procs") for d in cgroup_dirs]
        # The socket family filter (policy socket_families) is built here and
        # loaded in the child, last, just before it execs systemd-run or
        # nspawn: inherited by them and by every process of the cell.  No
        # filter, no cell (unless the policy says "any").
        try:
            family_filter = familiesmod.filter_for(self.policy["socket_families"])
        except familiesmod.FilterUnavailable as exc:
            raise SetupError(familiesmod.refusal(exc))
        if family_filter is not None:
            self.debug("%s allowed in the cell" % familiesmod.describe(self.policy["socket_families"]))

        def child_setup() -> None:
            # nspawn gets SIGTERM if the launcher dies in any way; nspawn
            # then kills the cell and tears it down (veth included).
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(EXIT_SETUP)
            for f in procs_files:
                with open(f, "w") as fh:
                    fh.write("%d\n" % os.getpid())
            if family_filter is not None:
                try:
                    family_filter.load()
                except BaseException as exc:  # noqa: B036 (say why, then never exec unfiltered)
                    os.write(2, ("chv-cell: %s\n" % familiesmod.refusal(exc)).encode(errors="replace"))
                    os._exit(EXIT_SETUP)

        return subprocess.Popen(
            argv,
            env=argvmod.nspawn_environment(self.policy),
            preexec_fn=child_setup,
            close_fds=True,
            stdin=self.spawn_stdin,
        )

    def wait_leader(self, proc: subprocess.Popen[bytes], pidfd: int, deadline: float) -> int:
        own = _pidns(os.getpid())
        while True:
            for c in _read_children(proc.pid):
                ns = _pidns(c)
                if ns is not None and ns != own:
                    return c
            if proc.poll() is not None:
                raise SetupError("%s exited with %d before the cell started" % (self.exe, proc.returncode))
            if time.monotonic() > deadline:
                raise SetupError("the cell did not start within %ss" % self.policy["start_timeout"])
            self.sleep(0.002, [pidfd])

    def configure_network(self, slot: policymod.Slot, leader: int, proc: subprocess.Popen[bytes], pidfd: int,
                          deadline: float) -> None:
        p = self.policy
        host_if, cell_if = slot["host_ifname"], slot["cell_ifname"]
        while not (os.path.exists("/sys/class/net/" + host_if) and cell_if in _netdev_names(leader)):
            if proc.poll() is not None:
                raise SetupError("%s exited with %d before the veth appeared" % (self.exe, proc.returncode))
            if time.monotonic() > deadline:
                raise SetupError("veth %s/%s did not appear within %ss" % (host_if, cell_if, p["start_timeout"]))
            self.sleep(0.002, [pidfd])
        plen = slot["prefixlen"]
        host_cmds = "addr replace %s/%d dev %s\nlink set %s up\n" % (slot["gateway"], plen, host_if, host_if)
        cell_cmds = (
            "link set lo up\n"
            "addr replace %s/%d dev %s\n"
            "link set %s up\n"
            "route replace default via %s dev %s\n" % (slot["address"], plen, cell_if, cell_if, slot["gateway"], cell_if)
        )
        # both sides at once (independent); each must succeed
        started = [
            ("host side " + host_if, _start([p["ip"], "-batch", "-"], host_cmds)),
            ("cell side " + cell_if, _start([p["nsenter"], "-t", str(leader), "-n", p["ip"], "-batch", "-"], cell_cmds)),
        ]
        for what, cmd in started:
            out = cmd.communicate()[0]
            if cmd.returncode != 0:
                raise SetupError("cannot configure the veth (%s): %s" % (what, out.decode(errors="replace").strip()))

    def write_record(self, slot: policymod.Slot, leader: int, **extra: object) -> None:
        paths = argvmod.cell_paths(self.policy, slot)
        rec = {
            "slot": slot["name"],
            "pid": leader,
            "uid_base": slot["uid_base"],
            "uid_size": slot["uid_size"],
            "started": round(time.time(), 3),
        }
        rec.update(self.record_extra, **extra)
        _write_atomic(paths["record"], json.dumps(rec, sort_keys=True) + "\n", 0o600)

    # -- fail-closed checks (before the gate opens) ------------------------
    def _limits_verdict(self, slot: policymod.Slot, problems: List[str]) -> None:
        if not problems:
            return
        if self.policy["require_limits"]:
            raise SetupError(
                "resource limits cannot be enforced: %s; refusing to start the cell (policy require_limits)"
                % "; ".join(problems)
            )
        log("slot %s: WARNING: resource limits NOT enforced: %s (policy require_limits is false)"
            % (slot["name"], "; ".join(problems)))

    def apply_standalone_limits(self, slot: policymod.Slot, cg2: Optional[str]) -> None:
        """Write the policy's properties into the cell's own cgroup2
        directory (before nspawn is in it)."""
        props = self.policy["properties"]
        if not props:
            return
        mem_total, tasks = _host_facts_for_limits()
        limits, problems = limitsmod.plan(props, mem_total, tasks)
        if cg2 is None:
            bad = [(lim, "no cgroup2 hierarchy on this host") for lim in limits]
        else:
            parent = os.path.dirname(cg2)
            try:
                enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
            except OSError:
                enabled = set()
            bad = limitsmod.unavailable(limits, enabled, set(os.listdir(cg2)))
            bad = [(lim, r + " (not in %s/cgroup.subtree_control)" % parent if r.startswith("controller") else r)
                   for lim, r in bad]
        problems += [limitsmod.describe([b]) for b in bad]
        self._limits_verdict(slot, problems)
        skipped = {lim for lim, dummy in bad}
        for lim in limits:
            if lim in skipped:
                continue
            assert cg2 is not None  # without it every limit is skipped
            path = os.path.join(cg2, lim.file)
            try:
                with open(path, "w") as fh:
                    fh.write(lim.value + "\n")
                got = _read(path)
            except OSError as exc:
                raise SetupError("cannot write %s=%s to %s: %s" % (lim.prop, lim.value, path, exc.strerror))
            if not limitsmod.matches(lim, got, os.sysconf("SC_PAGE_SIZE")):
                raise SetupError("%s reads %r after writing %s (%s)" % (path, got.strip(), lim.value, lim.prop))
            self.debug("slot %s: %s = %s" % (slot["name"], path, lim.value))

    def check_scope_limits(self, slot: policymod.Slot, leader: int, unit: str) -> None:
        """systemd scope: the scope's cgroup must carry the limits asked."""
        props = self.policy["properties"]
        if not props:
            return
        mem_total, tasks = _host_facts_for_limits()
        limits, problems = limitsmod.plan(props, mem_total, tasks)
        mount = _cgroup_mounts().get("")
        try:
            cg = _cgroup_dirs_of(leader).get("")
        except OSError:
            cg = None
        scope = None
        if mount is not None and cg is not None:
            scope = limitsmod.scope_dir(cg[len(mount[1]):], unit)
        if scope is None:
            problems += ["%s (%s): the cell's cgroup2 scope %s was not found" % (lim.prop, lim.file, unit)
                         for lim in limits]
        else:
            assert mount is not None  # a scope is found only in it
            problems += scope_limit_problems(limits, mount[1] + scope)
        self._limits_verdict(slot, problems)

    def start_userns_restriction(self, leader: int) -> Tuple[int, int]:
        """Write 0 to user.max_user_namespaces of the cell's own user
        namespace.  The user.* sysctls resolve against the writer's user
        namespace, so a forked child joins the cell's (setns) and writes.
        Where /proc/sys is mounted read-only (a guest that is itself a
        container, such as the lab's nspawn guests), the child first makes it
        writable in a private mount namespace of its own."""
        own, cell = (os.stat("/proc/%s/ns/user" % x).st_ino for x in ("self", leader))
        if own == cell:
            raise SetupError("the cell has no user namespace of its own")
        fd = os.open("/proc/%d/ns/user" % leader, os.O_RDONLY | os.O_CLOEXEC)
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            code, msg = 1, "no answer"
            try:
                os.close(r)
                _writable_proc_sys(self._libc)
                if self._libc.setns(fd, CLONE_NEWUSER) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, "setns(CLONE_NEWUSER): " + os.strerror(e))
                with open(USERNS_SYSCTL, "w") as fh:
                    fh.write("0\n")
                with open(USERNS_SYSCTL) as fh:
                    msg = "value " + fh.read().strip()
                code = 0
            except BaseException as exc:  # noqa: B036 (report everything, then exit)
                msg = "error %s" % exc
            try:
                os.write(w, msg.encode()[:2000])
            finally:
                os._exit(code)
        os.close(w)
        os.close(fd)
        return pid, r

    def userns_verdict(self, started: Tuple[int, int]) -> None:
        """Wait for the child of start_userns_restriction; SetupError unless
        it read 0 back."""
        pid, r = started
        chunks = []
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        answer = b"".join(chunks).decode(errors="replace") or "no answer"
        if answer != "value 0":
            raise SetupError(
                "cannot set user.max_user_namespaces to 0 in the cell (%s); refusing to start the cell "
                "(policy allow_user_namespaces is false)" % answer
            )

    def list_ruleset(self) -> Optional[subprocess.Popen[bytes]]:
        """Start ``nft -j list table`` for check_ruleset (the listing is read
        there; the run starts it before it configures the veth, so that the
        two overlap).  None when nft cannot be started (check_ruleset then
        reports why)."""
        try:
            return subprocess.Popen(rulesetmod.list_command(self.policy["nft"]), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=TOOL_ENV)
        except OSError:
            return None

    def check_ruleset(self, slot: policymod.Slot, listing_proc: Optional[subprocess.Popen[bytes]] = None) -> None:
        """The cell_nat table must be loaded and cover this slot's veth
        (``listing_proc``: a list_ruleset() started earlier, or None)."""
        cmd = rulesetmod.list_command(self.policy["nft"])
        tail = "; refusing to start the cell (policy require_ruleset)"
        try:
            r = listing_proc or subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, env=TOOL_ENV)
            out, err = r.communicate(timeout=20)
        except OSError as exc:
            raise SetupError("cannot run %s: %s%s" % (cmd[0], exc.strerror, tail))
        except subprocess.TimeoutExpired:
            r.kill()
            r.wait()
            raise SetupError("%s did not answer within 20s%s" % (" ".join(cmd), tail))
        listing: Optional[str] = out.decode(errors="replace")
        if r.returncode != 0:
            message = err.decode(errors="replace").strip()
            if "No such file or directory" not in message:
                raise SetupError("%s failed (exit %d): %s%s" % (" ".join(cmd), r.returncode, message, tail))
            listing = None
        try:
            items = rulesetmod.missing(listing, slot["host_ifname"])
        except rulesetmod.RulesetError as exc:
            raise SetupError("%s%s" % (exc, tail))
        if items:
            raise SetupError(rulesetmod.refusal(items))

    # -- stop -----------------------------------------------------------
    def stop(self, proc: subprocess.Popen[bytes], pidfd: Optional[int], leader: Optional[int]) -> None:
        """Orderly stop: SIGTERM the payload, give it stop_grace seconds,
        then SIGTERM nspawn (which SIGKILLs the cell), then SIGKILL."""
        if proc.poll() is not None:
            return
        payload = _read_children(leader) if leader else []
        for pid in payload:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for sig, wait in (
            (None, self.policy["stop_grace"] if payload else 0),
            (signal.SIGTERM, 5.0),
            (signal.SIGKILL, 5.0),
        ):
            if sig is not None:
                try:
                    proc.send_signal(sig)
                    if sig == signal.SIGKILL and leader:
                        os.kill(leader, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait
            while proc.poll() is None and time.monotonic() < end:
                if pidfd is None:  # pidfd_open failed after the spawn: poll
                    time.sleep(0.01)
                else:
                    select.select([pidfd], [], [], max(0.0, end - time.monotonic()))
            if proc.poll() is not None:
                return

    def end_doors(self, slot: policymod.Slot) -> None:
        """The cell has stopped and the slot's lock is still held: have
        chv-browser destroy the slot's browser state before anyone can
        claim the slot again (doors.py; warm cells end here too)."""
        from . import doors  # noqa: PLC0415 (the end of a run only)

        outcome, detail = doors.end_browser_slot(
            self.policy.get("browser_socket", policymod.DEFAULTS["browser_socket"]), slot["name"])
        if outcome == "failed":
            log("slot %s: ERROR: chv-browser did not confirm the end of this run (%s): the slot's browser "
                "context may outlive the run until chv-browser sees the next run's cell" % (slot["name"], detail))
        else:
            self.debug("slot %s: browser state: %s (%s)" % (slot["name"], outcome, detail))

    # -- what a warm launcher (warm.WarmCell) changes ------------------
    def cell_command(self, command: Sequence[str]) -> Sequence[str]:
        """What the cell's pid 2 execs once the gate opens: the payload."""
        return command

    def after_gate(self, slot: policymod.Slot, proc: subprocess.Popen[bytes], pidfd: int,
                   runtime_max: float) -> float:
        """Called once the gate is open; returns the run's runtime_max (the
        payload's clock starts when it returns)."""
        return runtime_max

    def on_ready(self, ready: List[int]) -> None:
        """Called with the ``wait_fds`` that became readable while the payload runs."""

    def report(self, rc: int) -> None:
        """Called with the run's exit code once the cell has stopped."""

    # -- the whole run --------------------------------------------------
    def run(self, command: Sequence[str], slot_name: Optional[str] = None, timeout: Optional[float] = None,
            shared_network: bool = False, runtime_max: Optional[float] = None) -> int:
        """One run; its exit code.  With ``status_fd`` set, the launcher's
        verdict is written there as one JSON line (write_status) once the
        cell is gone and the slot released."""
        self.stage, self.claimed_slot, self.payload_started, self.payload_exit = "config", None, False, None
        if self.status_fd is not None:
            os.set_inheritable(self.status_fd, False)  # never in nspawn, the cell or any helper
        rc = self._run(command, slot_name, timeout, shared_network, runtime_max)
        if self.status_fd is not None:
            write_status(self.status_fd, status_record(rc, self.stage, self.claimed_slot, self.payload_started,
                                                       self.payload_exit))
        return rc

    def _run(self, command: Sequence[str], slot_name: Optional[str], timeout: Optional[float], shared_network: bool,
             runtime_max: Optional[float]) -> int:
        p = self.policy
        if shared_network and not p["allow_shared_network"]:
            log(SHARED_NETWORK_REFUSAL)
            return EXIT_CONFIG
        try:
            runtime_max = policymod.effective_runtime_max(p["runtime_max"], runtime_max)
        except ValueError as exc:
            log(str(exc))
            return EXIT_CONFIG
        if os.geteuid() != 0:
            log("run must be started as root (it starts systemd-nspawn)")
            self.stage = "setup"
            return EXIT_SETUP
        if slot_name is not None:
            slots = [s for s in p["slots"] if s["name"] == slot_name]
            if not slots:
                log("no slot named %r in the policy (have: %s)" % (slot_name, ", ".join(s["name"] for s in p["slots"])))
                return EXIT_CONFIG
        else:
            slots = list(p["slots"])
        scope = resolve_scope(p)
        wait = p["claim_timeout"] if timeout is None else timeout
        t0 = time.monotonic()
        if self.caller:
            self.debug("run requested by %s" % self.caller)
        self.install_signals()
        self.stage = "setup"
        try:
            try:
                locks = [(s["name"], argvmod.cell_paths(p, s)["lock"]) for s in slots]
                _ensure_dir(p["state_dir"], 0o700)
                warm = [] if shared_network else [s["name"] for s in slots if s["name"] in p["warm_slots"]]
                claimed = self._claim(locks, warm, wait, command, runtime_max, t0)
            except claimmod.SlotBusy:
                log("all %d slot(s) busy (%s) for %gs; giving up" % (len(slots), ", ".join(n for n, dummy in locks), wait))
                self.stage = "busy"
                return EXIT_BUSY
            except Interrupted as exc:
                if exc.reason:
                    log("%s; giving up waiting for a slot (exit %d, as on SIGHUP)" % (exc.reason, 128 + exc.signum))
                self.stage = "signal"
                return 128 + exc.signum
            if isinstance(claimed, int):
                # a warm cell ran the payload: its launcher's report is the verdict's
                # ground, as a cold run's own ("claimed"); one that did not report
                # how the payload ended (an older launcher) leaves it unknown
                self.stage = "claimed" if self.warm_reported else "warm"
                return claimed
            name, held = claimed
            slot = next(s for s in slots if s["name"] == name)
            self.stage, self.claimed_slot = "claimed", name
            try:
                return self._run_claimed(slot, scope, command, shared_network, t0, runtime_max)
            finally:
                held.release()
        finally:
            self.restore_signals()

    def _claim(self, locks: List[Tuple[str, str]], warm: List[str], wait: float, command: Sequence[str],
               runtime_max: float, t0: float) -> Union[int, Tuple[str, claimmod.Claim]]:
        """A free slot's lock as (name, Claim), or, when a warm cell of
        ``warm`` took the payload, the run's exit code.  Each round offers
        the payload to the warm cells that are ready (warm.handover), then
        tries the locks of the slots that are not warm once; rounds repeat
        until ``wait`` seconds have passed (SlotBusy).  A warm slot's lock
        is held by its warm launcher except for the moment between one warm
        cell and the next: a cold run waits for the next warm cell instead,
        and takes a warm slot's lock only after start_timeout seconds (its
        warm unit stopped)."""
        start = time.monotonic()
        deadline = start + wait
        cold = [lk for lk in locks if lk[0] not in warm]
        delay = 0.05
        req = None
        if warm:
            from . import warm as warmmod  # noqa: PLC0415 (only with warm slots)

            req = warmmod.request(self, command, runtime_max)
        while True:
            if warm:
                rc = None if req is None else warmmod.handover(self, warm, req, t0)
                if rc is not None:
                    return rc
                if time.monotonic() - start > self.policy["start_timeout"]:
                    cold = locks
            try:
                return claimmod.claim_any(cold, 0, sleep=self.sleep)
            except claimmod.SlotBusy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
            self.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.5)

    def _run_claimed(self, slot: policymod.Slot, scope: str, command: Sequence[str], shared_network: bool, t0: float,
                     runtime_max: float = 0) -> int:
        p = self.policy
        proc = pidfd = gate_fd = leader = None
        cgroups = []
        rc = EXIT_SETUP
        gate_open = False
        try:
            self.reap(slot, scope)
            if shared_network:
                log("slot %s: WARNING: --shared-network: the cell uses the host's network namespace" % slot["name"])
            gate_fd = self.prepare(slot, shared_network)
            if scope == "standalone":
                cgroups = cgroup_dirs_for(slot["name"])
                for d in cgroups:
                    os.mkdir(d, 0o755)
                self.apply_standalone_limits(slot, cgroup2_dir_for(slot["name"]))
            self.paths_probed = probe(argvmod.probe_paths(p, slot))
            run_id = str(os.getpid())
            facts = argvmod.HostFacts(scope=scope, existing=self.paths_probed, shared_network=shared_network, run_id=run_id)
            argv = argvmod.build_argv(p, slot, self.cell_command(command), facts)
            if any(a.startswith("--inaccessible=") for a in argv):
                ensure_inaccessible_nodes()
            self.debug("slot %s claimed after %.3fs (scope %s)" % (slot["name"], time.monotonic() - t0, scope))
            self.exe = os.path.basename(argv[0])
            proc = self.spawn(argv, cgroups)
            pidfd = os.pidfd_open(proc.pid)
            deadline = time.monotonic() + p["start_timeout"]
            leader = self.wait_leader(proc, pidfd, deadline)
            self.leader = leader
            self.write_record(slot, leader)
            # the checks that wait on other processes run at the same time:
            # nft's listing and the user-namespace child start now, the veth
            # is configured meanwhile, their verdicts come before the gate
            listing = self.list_ruleset() if p["require_ruleset"] and not shared_network else None
            userns = None if p["allow_user_namespaces"] else self.start_userns_restriction(leader)
            if not shared_network:
                self.configure_network(slot, leader, proc, pidfd, deadline)
            if scope == "systemd":
                self.check_scope_limits(slot, leader, argvmod.scope_unit(slot, run_id) + ".scope")
            if userns is not None:
                self.userns_verdict(userns)
            if shared_network:
                pass  # no veth of the slot: the cell is in the host's network namespace
            elif p["require_ruleset"]:
                self.check_ruleset(slot, listing)
            else:
                log("slot %s: WARNING: the cell_nat ruleset is not checked (policy require_ruleset is false)"
                    % slot["name"])
            os.write(gate_fd, b"go\n")
            gate_open = True
            self.payload_started = True
            runtime_max = self.after_gate(slot, proc, pidfd, runtime_max)
            released = time.monotonic()
            self.debug("slot %s: payload released %.3fs after start" % (slot["name"], released - t0))
            while proc.poll() is None:
                if runtime_max:
                    left = released + runtime_max - time.monotonic()
                    if left <= 0:
                        raise RuntimeLimit()
                    self.on_ready(self.sleep(min(left, 3600), [pidfd] + self.wait_fds))
                else:
                    self.on_ready(self.sleep(3600, [pidfd] + self.wait_fds))
            rc = proc.returncode
            self.payload_exit = rc
        except Interrupted as exc:
            if exc.reason:
                log("slot %s: %s; stopping the cell (exit %d, as on SIGHUP)"
                    % (slot["name"], exc.reason, 128 + exc.signum))
            else:
                log("slot %s: stopping on signal %d" % (slot["name"], exc.signum))
            rc = 128 + exc.signum
        except RuntimeLimit:
            log("slot %s: runtime_max of %gs reached; stopping the cell (exit %d)"
                % (slot["name"], runtime_max, EXIT_RUNTIME))
            rc = EXIT_RUNTIME
        except (SetupError, resolver.ResolverError, OSError) as exc:
            log("slot %s: %s" % (slot["name"], exc))
            rc = EXIT_SETUP
        finally:
            if proc is not None:
                self.stop(proc, pidfd, leader)
            self.report(rc)
            if pidfd is not None:
                os.close(pidfd)
            if gate_fd is not None:
                os.close(gate_fd)
            _unlink(argvmod.cell_paths(p, slot)["record"])
            for d in cgroups:
                remove_cgroup_tree(d, kill=True)
            try:
                if not shared_network:
                    self._wait_ifname_gone(slot)
            except SetupError as exc:
                log("slot %s: %s" % (slot["name"], exc))
                rc = rc or EXIT_SETUP
            self._remove_runtime_files(slot)
            self.end_doors(slot)
            self.debug("slot %s: done in %.3fs, exit %d" % (slot["name"], time.monotonic() - t0, rc))
        return rc
