"""The base of every ``chv-cell run`` launcher (Linux cold and warm cells:
runner.py, warm.py; macOS: darwin.py): the run's skeleton from the request
to the released slot, stop signals and hang-ups, and the verdict."""

from __future__ import annotations

import os
import select
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import claim as claimmod
from . import cordon as cordonmod
from . import policy as policymod
from .errors import Interrupted
from .exits import EXIT_CONFIG, EXIT_CORDONED
from .log import log
from .signals import HANGUP_EVENTS, hangup_reason, hangup_watch_fds
from .status import status_record, write_status
from .. import journal

if TYPE_CHECKING:
    from types import FrameType

    from .status import StatusRecord

SHARED_NETWORK_REFUSAL = (
    "--shared-network is not allowed by the policy (allow_shared_network is false; role variable "
    "chv_cell_allow_shared_network)"
)

# what claim() returns: the slot and its held lock, or the run's exit code
# when no cell of this launcher's runs (refused, busy, or a warm cell ran it)
Claimed = Union[int, Tuple[policymod.Slot, claimmod.Claim]]


def slot_name(slot: policymod.Slot) -> str:
    """A slot's name (claim.claim_any's label of a slot)."""
    return str(slot["name"])


RUN_EVENT = "chv-cell.run"


def run_event(record: "StatusRecord", started_after: Optional[float], task: Optional[str]) -> Dict[str, str]:
    """The journal entry of one run (pure): its verdict record as CHV_*
    fields, the payload's start latency (CHV_START_MS, from the run's start
    to the payload's release; none when it did not start) and the task of
    a turn (docs/observability.md "Logs"; chv_guest/metrics/events.py
    counts them)."""
    fields: Dict[str, Any] = dict(record)
    fields["start_ms"] = None if started_after is None else round(started_after * 1000, 1)
    fields["task"] = task
    latency = "" if started_after is None else ", payload started after %.3fs" % started_after
    message = "%s: %s, exit %d%s" % (record["slot"] or "no slot", record["verdict"], record["exit"], latency)
    return journal.entry(message, "chv-cell", RUN_EVENT, fields)


class Launcher:
    """One ``chv-cell run``.  ``caller`` (e.g. ``chv (uid 1000) through
    sudo``) is only logged with ``verbose``.  ``watch_fds``: the fds whose
    peer going away stops the run like SIGHUP (default: stdout and stderr,
    those open when the run starts)."""

    _wake_r: Optional[int]
    _wake_w: Optional[int]

    def __init__(self, policy: policymod.Policy, verbose: bool = False, caller: Optional[str] = None,
                 watch_fds: Optional[Iterable[int]] = None) -> None:
        self.policy = policy
        self.verbose = verbose
        self.caller = caller
        self.run_started = time.monotonic()
        self.payload_started_after: Optional[float] = None  # seconds from the run's start to the payload's release
        self._watch_arg = watch_fds
        self._watch: List[int] = []
        self.stop_signal: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self._wake_r = self._wake_w = None
        self._old_handlers: Dict[int, Union[Callable[[int, Optional[FrameType]], Any], int, None]] = {}
        self._old_wakeup: Optional[int] = None
        # the verdict channel: --status-fd, and what the run learnt of its payload
        self.status_fd: Optional[int] = None
        self.stage: Optional[str] = None
        self.claimed_slot: Optional[str] = None
        self.payload_started = False
        self.payload_exit: Optional[int] = None
        self.warm_reported = False  # a warm cell ran the payload and said how it ended (handover.py)
        # the health gate's own run on a host its rollout cordoned (chv-cell run --ignore-cordon, root's)
        self.ignore_cordon = False
        self.task_id: Optional[str] = None  # a turn of this task (tasks.py): only its slot, no other
        # the variables passed to this run (taskenv.py): into the cell through its start gate only
        self.env: Dict[str, str] = {}

    def debug(self, msg: str) -> None:
        if self.verbose:
            log(msg)

    # -- signals --------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def install_signals(self) -> None:
        # before the wake-up pipe exists: a closed fd 1 or 2 must not be taken for it
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
        readable (or hung up).  Raise Interrupted on a stop signal, and (as
        SIGHUP, with a reason) when a watched fd's peer goes away
        (signals.py)."""
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

    # -- the whole run --------------------------------------------------
    def run(self, command: Sequence[str], slot_name: Optional[str] = None, timeout: Optional[float] = None,
            shared_network: bool = False, runtime_max: Optional[float] = None) -> int:
        """One run; its exit code.  With ``status_fd`` set, the verdict is
        written there once the cell is gone and the slot released."""
        self.stage, self.claimed_slot, self.payload_started, self.payload_exit = "config", None, False, None
        self.run_started, self.payload_started_after = time.monotonic(), None
        if self.status_fd is not None:
            os.set_inheritable(self.status_fd, False)  # never in nspawn, the cell or any helper
        rc = self._run(command, slot_name, timeout, shared_network, runtime_max)
        record = status_record(rc, self.stage, self.claimed_slot, self.payload_started, self.payload_exit)
        if self.status_fd is not None:
            write_status(self.status_fd, record)
        journal.send(run_event(record, self.payload_started_after, self.task_id))
        return rc

    def mark_payload_started(self) -> None:
        """The payload was released: the run's start latency is known (the run event's)."""
        self.payload_started = True
        self.payload_started_after = time.monotonic() - self.run_started

    def _run(self, command: Sequence[str], slot_name: Optional[str], timeout: Optional[float], shared_network: bool,
             runtime_max: Optional[float]) -> int:
        p = self.policy
        refusal = self.refusal(shared_network)
        if refusal:
            log(refusal)
            return EXIT_CONFIG
        try:
            limit = policymod.effective_runtime_max(p["runtime_max"], runtime_max)
        except ValueError as exc:
            log(str(exc))
            return EXIT_CONFIG
        if not self.ignore_cordon:
            cordoned = cordonmod.read(p["state_dir"])
            if cordoned is not None:
                log(cordonmod.refusal(cordoned, time.time()))
                self.stage = "cordoned"
                return EXIT_CORDONED
        rc = self.preflight()
        if rc is not None:
            return rc
        # a run without --slot never takes the health gate's reserved slot
        slots = [s for s in p["slots"] if s["name"] == slot_name
                 or (slot_name is None and s["name"] != p.get("health_slot"))]
        if not slots:
            log(self.no_slot(slot_name))
            return EXIT_CONFIG
        wait = p["claim_timeout"] if timeout is None else timeout
        return self.claim_and_run(slots, wait, command, shared_network, limit)

    def claim_and_run(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
                      runtime_max: float) -> int:
        claimed = self.claim(slots, wait, command, shared_network, runtime_max)
        if isinstance(claimed, int):
            return claimed
        slot, held = claimed
        self.stage, self.claimed_slot = "claimed", slot["name"]
        try:
            return self.run_claimed(slot, command, shared_network, runtime_max)
        finally:
            try:
                self.before_release(slot)
            finally:
                held.release()

    # -- what each launcher decides ---------------------------------------
    def refusal(self, shared_network: bool) -> Optional[str]:
        """Why this launcher refuses the run outright (EXIT_CONFIG), or None."""
        if shared_network and not self.policy["allow_shared_network"]:
            return SHARED_NETWORK_REFUSAL
        return None

    def preflight(self) -> Optional[int]:
        """The exit code of a run that cannot start here, or None."""
        return None

    def no_slot(self, slot_name: Optional[str]) -> str:
        return "no slot named %r in the policy (have: %s)" % (
            slot_name, ", ".join(s["name"] for s in self.policy["slots"]))

    def claim(self, slots: List[policymod.Slot], wait: float, command: Sequence[str], shared_network: bool,
              runtime_max: float) -> Claimed:
        raise NotImplementedError

    def run_claimed(self, slot: policymod.Slot, command: Sequence[str], shared_network: bool,
                    runtime_max: float) -> int:
        raise NotImplementedError

    def before_release(self, slot: policymod.Slot) -> None:
        """Called once the run in ``slot`` is over, its lock still held."""

    def report(self, rc: int) -> None:
        """Called with the run's exit code once the cell has stopped."""
