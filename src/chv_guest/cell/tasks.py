"""``chv-cell task start|end|list|reap`` and the checks of ``run --task``
(docs/executor.md "Tasks"): what root does with tasks, asked through
``chv-cell`` (cli.py) or sudo and ``chv-cell-agent`` (agent.py).

A task's whole state outside its record is the slot's: the workspace and
the agent state dir (its HOME), the cell's /tmp (a tmpfs of each cell:
gone with every turn), the slot's browser context and screenshots.  Each is
emptied, holding the slot's lock, when the task starts and when it ends or
expires; the record (taskrec.py) reserves the slot in between.  Expiry is
lazy (every ``task start``, ``task list`` and ``run --task`` reaps what has
expired) and periodic (``chv-cell task reap``, the timer
chv-cell-task-reap.timer of cell_runtime)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import argv as argvmod
from . import claim as claimmod
from . import cordon as cordonmod
from . import exits
from . import host
from . import policy as policymod
from . import runner
from . import taskenv
from . import taskrec
from .errors import SetupError
from .fsutil import ensure_slot_dir
from .log import log

Log = Callable[[str], None]


class TaskError(Exception):
    """A task request that cannot be served: ``code`` is the exit code, ``str()`` says why."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _slot(policy: policymod.Policy, name: str) -> policymod.Slot:
    try:
        return policymod.slot_by_name(policy, name)
    except KeyError:
        raise TaskError(exits.EXIT_CONFIG, "slot %r of the task is not in the policy any more" % name)


def _lock(policy: policymod.Policy, slot: policymod.Slot) -> str:
    return argvmod.cell_paths(policy, slot)["lock"]


def empty_slot(policy: policymod.Policy, slot: policymod.Slot) -> None:
    """Empty everything of the slot a task leaves (the caller holds its
    lock): a cell a dead launcher left is killed first (runner's reap), then
    the workspace, the agent state dir and the screenshots are emptied
    without following a link, chv-browser ends the slot's context, and in
    proxy mode the slot's gateway address is taken off the loopback (a
    clone killed with SIGKILL leaves it there: clone.door_gateway)."""
    from . import clone, doors  # noqa: PLC0415 (an end only)

    launcher = runner.Launcher(policy)
    launcher.reap(slot, host.resolve_scope(policy))
    paths = argvmod.cell_paths(policy, slot)
    for path in (paths["workspace"], paths["agent_state"], os.path.join(taskrec.SHOTS_DIR, slot["name"])):
        try:
            taskrec.wipe_contents(path)
        except (taskrec.WipeError, OSError) as exc:
            raise SetupError("slot %s: cannot empty %s: %s" % (slot["name"], path, exc))
    outcome, detail = doors.end_browser_slot(policy.get("browser_socket", policymod.DEFAULTS["browser_socket"]),
                                             slot["name"])
    if outcome == "failed":
        raise SetupError("slot %s: chv-browser did not confirm the end of the slot's browser context (%s)"
                         % (slot["name"], detail))
    clone.release_gateway(policy, slot)  # a leftover of a clone killed with SIGKILL (proxy mode)
    os.makedirs(policy["state_dir"], mode=0o700, exist_ok=True)
    ensure_slot_dir(paths["workspace"], slot["uid_base"])
    ensure_slot_dir(paths["agent_state"], slot["uid_base"])


def teardown(policy: policymod.Policy, rec: Dict[str, Any]) -> None:
    """Tear the task down (the caller holds its slot's lock): marked
    ``ending`` first (an end that fails half-way is finished by the next
    reap), the slot emptied, then the record removed (the slot is free)."""
    rec = dict(rec, ending=True)
    taskrec.write(policy, rec)
    empty_slot(policy, _slot(policy, rec["slot"]))
    taskenv.remove_task_env(taskrec.tasks_dir(policy), rec["task"])
    taskrec.remove(policy, rec["task"])


def reap(policy: policymod.Policy, now: Optional[float] = None, logf: Log = log) -> List[str]:
    """Tear down every expired task whose slot is free (no turn runs); the ids torn down."""
    done = []
    taskrec.prune_tombstones(policy, time.time())
    for rec in taskrec.all_records(policy):
        if not taskrec.expired(rec, time.time() if now is None else now):
            continue
        try:
            slot = _slot(policy, rec["slot"])
            held = claimmod.try_claim(_lock(policy, slot))
        except claimmod.SlotBusy:
            continue  # a turn runs: not expired while it does
        except (TaskError, OSError) as exc:
            logf("task %s: cannot reap: %s" % (rec["task"], exc))
            continue
        try:
            cur = taskrec.read(policy, rec["task"])
            if cur is None or not taskrec.expired(cur, time.time() if now is None else now):
                continue
            teardown(policy, cur)
            taskrec.write_tombstone(policy, cur)
            logf("task %s: expired (last used %.0fs ago, ttl %gs): torn down, slot %s free"
                 % (cur["task"], time.time() - float(cur["last_used"]), float(cur["ttl"]), cur["slot"]))
            done.append(cur["task"])
        except (SetupError, OSError) as exc:
            logf("task %s: the teardown failed, retried at the next reap: %s" % (rec["task"], exc))
        finally:
            held.release()
    return done


def effective_ttl(policy: policymod.Policy, ttl: Optional[float]) -> float:
    """The task's TTL: the policy's task_ttl, or a lower ``ttl`` (> 0)."""
    limit = float(policy["task_ttl"])
    if ttl is None:
        return limit
    if not 0 < ttl <= limit:
        raise TaskError(exits.EXIT_CONFIG, "--ttl %gs must be above 0 and at most the policy's task_ttl of %gs "
                        "(role variable chv_cell_task_ttl)" % (ttl, limit))
    return float(ttl)


def start(policy: policymod.Policy, owner: int, ttl: Optional[float] = None, timeout: Optional[float] = None,
          logf: Log = log, env: Optional[Dict[str, str]] = None,
          repo: Optional[Tuple[str, Optional[str]]] = None) -> Dict[str, Any]:
    """Claim a free slot for a new task of ``owner``, empty it, clone
    ``repo`` (URL, ref) into its workspace (clone.py), record the task (and
    keep its variables ``env``, taskenv.py, beside the record); what ``task
    start`` prints.  A clone that fails leaves the slot emptied and free.
    Warm slots are not given to tasks (their lock is their warm cell's)."""
    life = effective_ttl(policy, ttl)
    cordoned = cordonmod.read(policy["state_dir"])
    if cordoned is not None:  # no new work on a cordoned guest; turns of started tasks go on
        raise TaskError(exits.EXIT_CORDONED, cordonmod.refusal(cordoned, time.time()))
    reap(policy, logf=logf)
    wait = float(policy["claim_timeout"] if timeout is None else timeout)
    deadline = time.monotonic() + wait
    taken = set()
    while True:
        candidates = [(s, _lock(policy, s)) for s in policy["slots"]
                      if s["name"] not in policy["warm_slots"] and s["name"] not in taken
                      and s["name"] != policy.get("health_slot")  # the health gate's, as for runs without --slot
                      and taskrec.reserved_by(policy, s["name"]) is None]
        if not candidates:
            raise TaskError(exits.EXIT_BUSY, "no slot free for a task (%d slot(s), %d warm, the others busy or "
                            "owned by tasks)" % (len(policy["slots"]), len(policy["warm_slots"])))
        try:
            slot, held = claimmod.claim_any(candidates, max(0.0, deadline - time.monotonic()),
                                            label=lambda s: str(s["name"]))
        except claimmod.SlotBusy as exc:
            raise TaskError(exits.EXIT_BUSY, "every slot for a task stayed busy for %gs (%s)" % (wait, exc))
        try:
            if taskrec.reserved_by(policy, slot["name"]) is not None:
                taken.add(slot["name"])  # a task took it between the look and the lock
                continue
            # The record first (``starting``): the slot is the owner's before a byte of the task is in it,
            # so no other user reads the clone as it arrives (actions.read_request). A start that dies
            # leaves a starting record, torn down by the next reap once its lock is free (taskrec.expired).
            rec = dict(taskrec.new_record(taskrec.new_id(), slot["name"], owner, life, time.time()), starting=True)
            try:
                taskenv.save_task_env(taskrec.tasks_dir(policy), rec["task"], env or {})
                taskrec.write(policy, rec)
            except OSError:
                taskenv.remove_task_env(taskrec.tasks_dir(policy), rec["task"])
                raise
            try:
                with stop_signals():
                    try:
                        empty_slot(policy, slot)
                    except (SetupError, OSError) as exc:
                        raise TaskError(exits.EXIT_SETUP, "cannot prepare slot %s for a task: %s"
                                        % (slot["name"], exc))
                    if repo is not None:
                        rec["repo"] = _clone(policy, slot, repo)
                    del rec["starting"]
                    taskrec.write(policy, rec)
            except BaseException:
                _abandon(policy, slot, rec)
                raise
            return taskrec.public(rec, policy)
        finally:
            held.release()


class StartStopped(TaskError):
    """``task start`` was stopped by a signal (its sudo relays SIGTERM, SIGHUP and SIGINT)."""


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGINT as StartStopped while a start fills its
    slot: the clone's worker is killed (server.run_worker) and the slot
    emptied again (_abandon), never left running or filled in a free slot."""
    def stopped(signum: int, _frame: object) -> None:
        raise StartStopped(exits.EXIT_SETUP, "task start: stopped by signal %d; the slot was emptied" % signum)

    old = dict((s, signal.signal(s, stopped)) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _abandon(policy: policymod.Policy, slot: policymod.Slot, rec: Dict[str, Any]) -> None:
    """A start that did not finish (its slot's lock still held): the slot
    emptied again, then the task's variables and record removed (the slot
    is free); a slot that cannot be emptied keeps its starting record, for
    the next reap (taskrec.expired)."""
    try:
        empty_slot(policy, slot)
    except (SetupError, OSError) as exc:
        log("slot %s: cannot empty the slot after a start that did not finish: %s; the next reap retries"
            % (slot["name"], exc))
        return
    taskenv.remove_task_env(taskrec.tasks_dir(policy), rec["task"])
    taskrec.remove(policy, rec["task"])


def _clone(policy: policymod.Policy, slot: policymod.Slot, repo: Tuple[str, Optional[str]]) -> Dict[str, Any]:
    """The task's repository cloned into the slot's emptied workspace
    (clone.py); on failure TaskError says why (start's _abandon empties the slot again)."""
    from . import clone  # noqa: PLC0415 (tasks with a repository only)

    try:
        return clone.clone_into(policy, slot, repo[0], repo[1])
    except clone.CloneError as exc:
        raise TaskError(exc.code, "task start: %s" % exc)


def _task_env(policy: policymod.Policy, env_fd: Optional[int]) -> Dict[str, str]:
    """``task start --env-fd N``'s variables; TaskError 78 when refused."""
    if env_fd is None:
        return {}
    try:
        return taskenv.parse_env(taskenv.read_env(env_fd), policy["env_allow"])
    except taskenv.EnvRefused as exc:
        raise TaskError(exits.EXIT_CONFIG, "task start: %s" % exc)


def _no_task(policy: policymod.Policy, task_id: str, uid: int) -> TaskError:
    """The answer for a task ``uid`` has no live record of: expired (its
    owner, within a day of the expiry) or no such task of yours."""
    owner = taskrec.expired_owner(policy, task_id) if taskrec.valid_id(task_id) else None
    if owner is not None and uid in (0, owner):
        return TaskError(exits.EXIT_TASK_EXPIRED, "task %s: expired (unused for longer than its ttl) and torn down"
                         % task_id)
    return TaskError(exits.EXIT_NO_TASK, "task %s: no such task of yours (uid %d)" % (task_id, uid))


def owned(policy: policymod.Policy, task_id: str, uid: int, now: Optional[float] = None) -> Dict[str, Any]:
    """The record of a live task ``uid`` may use; TaskError otherwise (no
    such task, not the caller's: the same answer; expired: torn down when
    its slot is free)."""
    rec = taskrec.read(policy, task_id) if taskrec.valid_id(task_id) else None
    if rec is None or not taskrec.may_use(rec, uid):
        raise _no_task(policy, task_id, uid)
    if taskrec.expired(rec, time.time() if now is None else now):
        reap(policy, now=now)
        if taskrec.read(policy, task_id) is None or rec.get("ending"):
            raise TaskError(exits.EXIT_TASK_EXPIRED, "task %s: expired (unused for longer than its ttl of %gs); "
                            "torn down" % (task_id, float(rec["ttl"])))
        # not reaped: a turn of it runs (its slot's lock is held), so it is in use, not expired
    return rec


def _wait_for_turn(policy: policymod.Policy, slot: policymod.Slot, task_id: str, timeout: Optional[float],
                   outcome: str) -> claimmod.Claim:
    """The task's slot's lock, once its running turn (if any) has ended, up
    to ``timeout`` (claim_timeout); TaskError 75 after, saying ``outcome``."""
    wait = float(policy["claim_timeout"] if timeout is None else timeout)
    try:
        return claimmod.claim_any([(slot, _lock(policy, slot))], wait)[1]
    except claimmod.SlotBusy:
        raise TaskError(exits.EXIT_BUSY, "task %s: a turn still runs in slot %s after %gs; %s"
                        % (task_id, slot["name"], wait, outcome))


def end(policy: policymod.Policy, task_id: str, uid: int, timeout: Optional[float] = None) -> Dict[str, Any]:
    """``task end``: wait for the task's running turn (up to claim_timeout),
    tear it all down; what it prints."""
    rec = taskrec.read(policy, task_id) if taskrec.valid_id(task_id) else None
    if rec is None or not taskrec.may_use(rec, uid):
        raise _no_task(policy, task_id, uid)
    slot = _slot(policy, rec["slot"])
    held = _wait_for_turn(policy, slot, task_id, timeout, "not ended")
    try:
        cur = taskrec.read(policy, task_id)
        if cur is None:
            raise TaskError(exits.EXIT_NO_TASK, "task %s: ended meanwhile (expired or ended by another call)"
                            % task_id)
        try:
            teardown(policy, cur)
        except (SetupError, OSError) as exc:
            raise TaskError(exits.EXIT_SETUP, "task %s: the teardown failed (the next reap retries it): %s"
                            % (task_id, exc))
    finally:
        held.release()
    return {"task": task_id, "slot": slot["name"], "ended": True}


def export(policy: policymod.Policy, task_id: str, uid: int, paths: List[str], max_bytes: Optional[int],
           out: Optional[IO[bytes]] = None, timeout: Optional[float] = None) -> int:
    """``task export ID PATH...``: a tar of the task's files on ``out``
    (stdout), export.py; held under the slot's lock (a running turn is
    waited for up to claim_timeout, 75 after); its exit code."""
    from . import export as exportmod  # noqa: PLC0415 (exports only)

    out = out or sys.stdout.buffer
    try:
        limit = exportmod.effective_max(policy, max_bytes)
        rec = owned(policy, task_id, uid)
        slot = _slot(policy, rec["slot"])
        held = _wait_for_turn(policy, slot, task_id, timeout, "nothing exported")
    except ValueError as exc:
        log("task export: %s" % exc)
        return exits.EXIT_CONFIG
    except TaskError as exc:
        log(str(exc))
        return exc.code
    try:
        if taskrec.read(policy, task_id) is None:
            log("task %s: ended meanwhile; nothing exported" % task_id)
            return exits.EXIT_NO_TASK
        return exportmod.export(policy, slot, paths, limit, out, log)
    finally:
        held.release()


def listing(policy: policymod.Policy, uid: int) -> List[Dict[str, Any]]:
    """``task list``: the caller's live tasks (root: everyone's), after a reap."""
    reap(policy)
    return [taskrec.public(r, policy) for r in taskrec.all_records(policy) if taskrec.may_use(r, uid)]


def command(policy: policymod.Policy, verb: str, uid: int, task_id: Optional[str] = None,
            ttl: Optional[float] = None, out: Optional[Callable[[str], object]] = None,
            env_fd: Optional[int] = None, repo: Optional[Tuple[str, Optional[str]]] = None) -> int:
    """One ``chv-cell task VERB``: its JSON on stdout; its exit code (the
    reason on stderr, naming the task).  ``env_fd`` (start): the task's
    variables (taskenv.py), read before a slot is claimed; ``repo`` (start):
    the repository (URL, ref) cloned into its workspace."""
    write = out or sys.stdout.write
    result: Any
    try:
        if verb == "start":
            result = start(policy, uid, ttl, env=_task_env(policy, env_fd), repo=repo)
        elif verb == "end":
            result = end(policy, str(task_id), uid)
        elif verb == "list":
            result = listing(policy, uid)
        elif verb == "reap":
            result = {"reaped": reap(policy)}
        else:
            raise TaskError(exits.EXIT_CONFIG, "no task verb %r (start, end, list, reap)" % verb)
    except TaskError as exc:
        log(str(exc))
        return exc.code
    write(json.dumps(result, sort_keys=True) + "\n")
    if out is None:
        sys.stdout.flush()
    return 0


def check_run(policy: policymod.Policy, task_id: str, uid: int) -> Tuple[int, Optional[str]]:
    """Before ``run --task``: (0, the task's slot) or (exit code, None) after logging why."""
    try:
        rec = owned(policy, task_id, uid)
    except TaskError as exc:
        log(str(exc))
        return exc.code, None
    reap(policy)
    return 0, str(rec["slot"])


def caller_uid() -> int:
    """The uid of root's own call (root: 0)."""
    return os.getuid()
