"""Warm cells, the warm side (docs/cells.md "Warm cells"):
``chv-cell warm --slot NAME`` (unit chv-cell-warm@NAME.service) starts the
slot's cell as ``chv-cell run`` would, but with warm_receive.py as its pid 2
and a socketpair as nspawn's stdin; once the gate is open it waits on
``<state_dir>/warm/NAME.sock`` for ONE caller (handover.py, which also
holds the messages), checks again what may have changed since the cell
started, hands the payload over and serves the run.  A cell is used once;
systemd starts the next."""

from __future__ import annotations

import array
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, NoReturn, Optional, Sequence, Tuple

from . import argv as argvmod
from . import checks
from . import claim as claimmod
from . import errors
from . import exits
from . import host
from . import launcher as launchermod
from . import log as logmod
from . import policy as policymod
from . import runner
from . import warm_receive
from .fsutil import ensure_dir, unlink
from .handover import encode, policy_digest, recv, send, socket_path

if TYPE_CHECKING:
    import subprocess

STAMP_POLL = 1.0  # seconds between checks of the policy and launcher files while idle
RETRY_BACKOFF = 5.0  # seconds a warm launcher waits after a cell failed to start
EXIT_NOT_WARM = 3  # the slot is not in warm_slots (the unit's RestartPreventExitStatus)
STALE = "the policy or the launcher changed since the warm cell started"


def files_stamp(paths: Iterable[str]) -> Tuple[Tuple[object, ...], ...]:
    """What identifies each file's current version (inode, mtime, size);
    a replaced or edited file changes it."""
    out: List[Tuple[object, ...]] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((path, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((path, None, None, None))
    return tuple(out)


def watched_files(policy_path: str) -> List[str]:
    """The policy and the launcher's own files: a warm cell started before
    either changed is not handed a payload."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [policy_path] + sorted(os.path.join(here, n) for n in os.listdir(here) if n.endswith(".py"))


def check_request(req: Optional[Dict[str, Any]], policy_runtime_max: float) -> Tuple[List[str], float]:
    """(argv, runtime_max) of a caller's request, or ValueError."""
    if req is None:
        raise ValueError("the request is not a JSON object")
    argv = req.get("argv")
    if not warm_receive.valid_argv(argv):
        raise ValueError("the request has no argv")
    # the caller sends its effective runtime_max (0: none), checked again here
    return argv, policymod.effective_runtime_max(policy_runtime_max, req.get("runtime_max") or None)


class WarmCell(runner.Launcher):
    """One warm cell of ``slot``, used once (see the module doc)."""

    spawn_stdin: int  # the cell's end of the socketpair (closed once spawn() gave it to nspawn)

    def __init__(self, policy: policymod.Policy, policy_path: str, slot: policymod.Slot, verbose: bool = False) -> None:
        super().__init__(policy, verbose=verbose, watch_fds=[])
        self.policy_path = policy_path
        self.slot = slot
        self.stamp = files_stamp(watched_files(policy_path))
        self.digest = policy_digest(policy)
        self.record_extra = {"warm": True}
        self.conn: Optional[socket.socket] = None
        self.retired = False
        self.handed_over = False
        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.spawn_stdin = theirs.detach()

    def cell_command(self, command: Sequence[str]) -> List[str]:
        return [self.policy["python"], "-I", "-S", "-c", warm_receive.BOOTSTRAP]

    def spawn(self, argv: Sequence[str], cgroup_dirs: Iterable[str]) -> subprocess.Popen[bytes]:
        try:
            proc = super().spawn(argv, cgroup_dirs)
        finally:
            os.close(self.spawn_stdin)  # the cell holds the other end now
        # the receiver's program, its first message (BOOTSTRAP runs it)
        with open(warm_receive.__file__, "rb") as fh:
            self._ours.send(fh.read())
        return proc

    def stale(self) -> bool:
        return files_stamp(watched_files(self.policy_path)) != self.stamp

    def after_gate(self, slot: policymod.Slot, proc: subprocess.Popen[bytes], pidfd: int,
                   runtime_max: float) -> float:
        """Listen for one caller; check; hand the payload to the cell."""
        path = socket_path(self.policy, slot)
        ensure_dir(os.path.dirname(path), 0o700)
        unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)
            try:
                listener.bind(path)
            finally:
                os.umask(old)
            listener.listen(8)
            self.debug("slot %s: warm cell ready (%s)" % (slot["name"], path))
            while True:
                ready = self.sleep(STAMP_POLL, [pidfd, listener.fileno()])
                if proc.poll() is not None or pidfd in ready:
                    raise errors.SetupError("the warm cell ended before a payload arrived")
                if self.stale():
                    self._retire(STALE + "; replacing it")
                if listener.fileno() not in ready:
                    continue
                self.conn, dummy = listener.accept()
                self.conn.setblocking(True)
                taken = self._hand_over(slot)
                if taken is not None:
                    return taken
        finally:
            unlink(path)
            listener.close()

    def _retire(self, why: str) -> NoReturn:
        self.retired = True
        raise errors.SetupError(why)

    def _refuse(self, rc: int, error: str) -> None:
        """Answer the caller with the run's end (nothing ran) and hang up."""
        assert self.conn is not None  # only while a caller is connected
        send(self.conn, {"exit": rc, "error": error})
        self.conn.close()
        self.conn = None

    def _hand_over(self, slot: policymod.Slot) -> Optional[float]:
        """Check the request and what may have changed since the cell
        started, then give the cell the payload; its runtime_max."""
        assert self.conn is not None  # after_gate accepted it
        req, fds = recv(self.conn)
        try:
            if len(fds) != warm_receive.STDIO_FDS:
                self._refuse(exits.EXIT_SETUP, "the warm cell got %d file descriptors, not %d"
                             % (len(fds), warm_receive.STDIO_FDS))
                self._retire("a caller sent %d file descriptors" % len(fds))
            try:
                argv, runtime_max = check_request(req, self.policy["runtime_max"])
            except ValueError as exc:
                self._refuse(exits.EXIT_CONFIG, str(exc))
                self._retire("refused a request: %s" % exc)
            assert req is not None  # check_request refuses None
            if self.stale():
                send(self.conn, {"retry": STALE})
                self._retire(STALE + "; replacing it")
            if host.probe(argvmod.probe_paths(self.policy, slot)) != self.paths_probed:
                # e.g. a file to hide (policy inaccessible) created since: its
                # --inaccessible= is not in this cell's argv
                send(self.conn, {"retry": "paths the cell's argv depends on appeared or went away since it started"})
                self._retire("paths the cell's argv depends on appeared or went away since it started; replacing it")
            if req.get("policy") != self.digest:
                send(self.conn, {"retry": "the caller's policy is not the one the warm cell started with"})
                self.conn.close()
                self.conn = None
                for fd in fds:
                    os.close(fd)
                return None
            if self.policy["require_ruleset"]:
                try:
                    checks.check_ruleset(self.policy, slot)
                except errors.SetupError as exc:
                    self._refuse(exits.EXIT_SETUP, str(exc))
                    raise
            self._ours.sendmsg([encode({"argv": argv})],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        os.close(fds[0])
        self._ours.close()
        self.write_record(slot, self.leader, payload=round(time.time(), 3))
        # The caller's stdout and stderr: their peer going away stops the
        # run, as for chv-cell run (closed in report()).
        self._watch = fds[1:]
        self.handed_over = True
        self.wait_fds = [self.conn.fileno()]
        logmod.log("slot %s: warm cell took a payload%s" % (slot["name"], " of " + req["caller"] if req.get("caller") else ""))
        send(self.conn, {"started": True})
        return runtime_max

    def on_ready(self, ready: List[int]) -> None:
        if self.conn is None or self.conn.fileno() not in ready:
            return
        msg, fds = recv(self.conn)
        for fd in fds:
            os.close(fd)
        if msg is None:
            self.wait_fds = []
            raise errors.Interrupted(1, "the caller of the warm cell went away")
        signum = msg.get("signal")
        if isinstance(signum, int) and not isinstance(signum, bool) and 0 < signum < 65:
            raise errors.Interrupted(signum)

    def report(self, rc: int) -> None:
        if self.conn is not None:
            # payload_exit: the payload's own exit code when it ended by itself
            # (None when the launcher stopped it or failed); the caller's verdict
            send(self.conn, {"exit": rc, "payload_exit": self.payload_exit})
            self.conn.close()
            self.conn = None
        for fd in self._watch:
            os.close(fd)
        self._watch = []

    def claim(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
              runtime_max: float) -> launchermod.Claimed:
        """The slot's lock, however long a cold run holds it (the warm cell
        follows it); a stop signal meanwhile raises Interrupted."""
        slot = slots[0]
        lock = argvmod.cell_paths(self.policy, slot)["lock"]
        ensure_dir(self.policy["state_dir"], 0o700)
        while True:
            try:
                held = claimmod.try_claim(lock)
            except claimmod.SlotBusy:
                self.sleep(0.5)
                continue
            if self._slot_open(slot):
                break
            held.release()  # a task owns the slot (warm_slots changed under it): no warm cell until it ends
            self.sleep(0.5)
        self.t0 = time.monotonic()  # the cell's start, for -v's timings
        return slot, held

    def serve(self) -> int:
        """The whole life of one warm cell; the process's exit code: 0 after
        a payload ran, the cell was retired or a stop signal came;
        EXIT_NOT_WARM when the slot is not warm in the policy; 125 after a
        failed start (after a pause, so that systemd's restarts do not spin)."""
        p = self.policy
        slot = self.slot
        if slot["name"] not in p["warm_slots"]:
            logmod.log("slot %s is not in the policy's warm_slots (%s); no warm cell"
                       % (slot["name"], ", ".join(p["warm_slots"]) or "none"))
            return EXIT_NOT_WARM
        if p["require_ruleset"]:
            # no cell while the ruleset does not cover the slot (e.g. cell_nat
            # not converged yet): a start would be refused at its end anyway
            try:
                checks.check_ruleset(self.policy, slot)
            except errors.SetupError as exc:
                logmod.log("slot %s: %s; no warm cell for %gs" % (slot["name"], exc, RETRY_BACKOFF))
                time.sleep(RETRY_BACKOFF)
                return exits.EXIT_SETUP
        try:
            rc = self.claim_and_run([slot], 0, ["warm"], False, 0)  # launcher.py's run, from the claim on
        except errors.Interrupted:
            return 0
        if self.handed_over or self.retired or self.stop_signal is not None:
            return 0
        time.sleep(RETRY_BACKOFF)
        return rc
