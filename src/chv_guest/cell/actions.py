"""What root does for ``run``, ``status`` and ``read``, whether asked
through ``chv-cell`` (cli.py) or through sudo and ``chv-cell-agent``
(agent.py): both call these, neither imports the other for them."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, cast

from . import exits
from . import launcher as launchermod
from . import log as logmod
from . import policy as policymod
from . import records
from . import runner
from .status import status_fd_problem, status_record, write_status

if TYPE_CHECKING:
    from .agent import AgentRequest


def load_policy(path: str) -> Optional[policymod.Policy]:
    """The policy at ``path``, or None after logging each of its errors."""
    try:
        return policymod.load(path)
    except policymod.PolicyError as exc:
        for e in exc.errors:
            logmod.log(e)
        return None


def refuse_with_status(status_fd: Optional[int]) -> int:
    """A run refused before its launcher exists (policy unusable, a request
    the policy forbids): the config verdict on ``status_fd`` (when given and
    usable); EXIT_CONFIG."""
    if status_fd is not None and status_fd_problem(status_fd) is None:
        write_status(status_fd, status_record(exits.EXIT_CONFIG, "config"))
    return exits.EXIT_CONFIG


def slot_states(pol: policymod.Policy) -> List[Dict[str, Any]]:
    """Each slot's state as ``chv-cell status`` shows it: {slot, state
    (idle, warm, running, stale, unknown), pid, started, text}."""
    out: List[Dict[str, Any]] = []
    for s in pol["slots"]:
        entry: Dict[str, Any] = {"slot": s["name"], "state": "idle", "pid": None, "started": None}
        try:
            rec = records.read_record(pol, s)
            alive = rec is not None and os.path.exists("/proc/%d" % int(rec["pid"]))
            if rec is None:
                text = "idle"
            elif records.warm_idle(rec) and alive:
                # no payload runs: idle, never "running pid=N" (the drain's pattern)
                text = "idle (warm cell %s, pid %s)" % ("ready" if records.warm_waiting(pol, s, rec) else "starting",
                                                        rec["pid"])
                entry.update(state="warm", pid=int(rec["pid"]))
            else:
                text = "running pid=%s%s" % (rec["pid"], "" if alive else " (stale)")
                started = rec.get("started")
                entry.update(state="running" if alive else "stale", pid=int(rec["pid"]),
                             started=started if isinstance(started, (int, float)) else None)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            text = "unknown (%s)" % exc
            entry["state"] = "unknown"
        entry["text"] = text
        out.append(entry)
    return out


def print_status(pol: policymod.Policy, as_json: bool = False) -> int:
    """``chv-cell status``: the cordon when the host is cordoned (its own
    first line), then one line per slot (identity and live record); or
    all of it as one JSON object with ``as_json``; 0."""
    import time  # noqa: PLC0415

    from . import cordon as cordonmod  # noqa: PLC0415

    cordoned = cordonmod.read(pol["state_dir"])
    states = slot_states(pol)
    if as_json:
        print(json.dumps({"cordoned": cordoned is not None, "cordon": cordoned, "slots": states}, sort_keys=True))
        sys.stdout.flush()
        return 0
    if cordoned is not None:
        print("%s: %s" % (cordonmod.MARKER, cordonmod.describe(cordoned, time.time())))
    for s, st in zip(pol["slots"], states):
        print(
            "%-10s %-12s %-15s %-18s uid %d+%d  %s"
            % (s["name"], s["machine"], s["host_ifname"], s["address"], s["uid_base"], s["uid_size"], st["text"])
        )
    sys.stdout.flush()
    return 0


def launcher_for(pol: policymod.Policy, verbose: bool = False,
                 caller: Optional[str] = None) -> launchermod.Launcher:
    """The launcher of the policy's platform: nspawn cells (runner) or, for
    a darwin policy, a slot user under sandbox-exec (darwin)."""
    if pol["platform"] == "darwin":
        from . import darwin  # noqa: PLC0415 (macOS only)

        return darwin.Launcher(pol, verbose=verbose, caller=caller)
    return runner.Launcher(pol, verbose=verbose, caller=caller)


def read_env(pol: policymod.Policy, env_fd: Optional[int], kept: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The variables of a run (taskenv.py): a task's ``kept`` ones (still
    allowed), then the NAME=VALUE lines on ``env_fd`` (None: none read)
    over them; taskenv.EnvRefused when a name is not in the policy's
    env_allow, the lines are unusable, or the platform passes none."""
    from . import taskenv  # noqa: PLC0415 (runs that pass variables only)

    env = dict(kept or {})
    if env_fd is None and not env:
        return env
    if pol["platform"] != "linux":
        raise taskenv.EnvRefused("--env-fd is not supported for %s cells yet" % pol["platform"])
    taskenv.check_allowed(env, pol["env_allow"])
    if env_fd is not None:
        env.update(taskenv.parse_env(taskenv.read_env(env_fd), pol["env_allow"]))
    taskenv.gate_message(env)  # the size of all of it together
    return env


def start_run(pol: policymod.Policy, command: Sequence[str], slot: Optional[str], timeout: Optional[float],
              shared_network: bool, runtime_max: Optional[float], status_fd: Optional[int], verbose: bool = False,
              caller: Optional[str] = None, ignore_cordon: bool = False, task: Optional[str] = None,
              caller_uid: int = 0, env_fd: Optional[int] = None) -> int:
    """A run with the launcher of the policy's platform; its exit code.
    ``status_fd`` (None: none) must be open for writing; the launcher writes
    its verdict there.  macOS cells do not report one yet: refused there
    (78).  ``task``: a turn of that task of ``caller_uid`` (tasks.py), in
    its slot only (Linux only).  ``env_fd``: the run's variables
    (taskenv.py), read before anything starts (78 when refused)."""
    from .taskenv import EnvRefused  # noqa: PLC0415

    if task is not None:
        return _start_turn(pol, command, task, caller_uid, timeout, shared_network, runtime_max, status_fd,
                           verbose, caller, env_fd)
    rc = _status_fd_refusal(status_fd)
    if rc is not None:
        return rc
    if status_fd is not None and pol["platform"] != "linux":
        logmod.log("--status-fd is not supported for %s cells yet" % pol["platform"])
        return refuse_with_status(status_fd)
    try:
        env = read_env(pol, env_fd)
    except EnvRefused as exc:
        logmod.log(str(exc))
        return refuse_with_status(status_fd)
    return _launch(pol, command, slot, timeout, shared_network, runtime_max, status_fd, verbose, caller, env,
                   ignore_cordon)


def _status_fd_refusal(status_fd: Optional[int]) -> Optional[int]:
    """EXIT_CONFIG (logged) when ``status_fd`` cannot carry the verdict, else None."""
    problem = status_fd_problem(status_fd) if status_fd is not None else None
    if problem:
        logmod.log(problem)
        return exits.EXIT_CONFIG
    return None


def _launch(pol: policymod.Policy, command: Sequence[str], slot: Optional[str], timeout: Optional[float],
            shared_network: bool, runtime_max: Optional[float], status_fd: Optional[int], verbose: bool,
            caller: Optional[str], env: Dict[str, str], ignore_cordon: bool, task: Optional[str] = None) -> int:
    """The run itself, once its checks passed: the platform's launcher with its settings."""
    launcher = launcher_for(pol, verbose=verbose, caller=caller)
    launcher.env = env
    launcher.status_fd = status_fd
    launcher.ignore_cordon = ignore_cordon
    launcher.task_id = task
    return launcher.run(command, slot_name=slot, timeout=timeout, shared_network=shared_network,
                        runtime_max=runtime_max)


def _start_turn(pol: policymod.Policy, command: Sequence[str], task: str, caller_uid: int,
                timeout: Optional[float], shared_network: bool, runtime_max: Optional[float],
                status_fd: Optional[int], verbose: bool, caller: Optional[str], env_fd: Optional[int]) -> int:
    """``run --task``: the task's checks (tasks.check_run), its variables
    and the turn's own (``env_fd``), then a run in its slot."""
    from . import taskenv  # noqa: PLC0415 (turns of tasks only)
    from . import taskrec  # noqa: PLC0415
    from . import tasks  # noqa: PLC0415

    rc = _status_fd_refusal(status_fd)
    if rc is not None:
        return rc
    if pol["platform"] != "linux":
        logmod.log("tasks are not supported for %s cells yet" % pol["platform"])
        return refuse_with_status(status_fd)
    rc, slot = tasks.check_run(pol, task, caller_uid)
    if slot is None:
        if status_fd is not None:
            write_status(status_fd, status_record(rc, "config"))
        return rc
    try:
        env = read_env(pol, env_fd, taskenv.load_task_env(taskrec.tasks_dir(pol), task))
    except taskenv.EnvRefused as exc:
        logmod.log("task %s: %s" % (task, exc))
        return refuse_with_status(status_fd)
    # a cordon stops new tasks (tasks.start), not the turns of a started one: ignore_cordon
    return _launch(pol, command, slot, timeout, shared_network, runtime_max, status_fd, verbose, caller, env,
                   True, task)


def run_request(pol: policymod.Policy, req: AgentRequest, caller: Optional[str] = None, caller_uid: int = 0) -> int:
    """Run an agent.AgentRequest of action run; its exit code."""
    return start_run(pol, req.command, req.slot, req.timeout, req.shared_network, req.runtime_max, req.status_fd,
                     verbose=req.verbose, caller=caller, task=req.task, caller_uid=caller_uid, env_fd=req.env_fd)


def task_request(pol: policymod.Policy, req: AgentRequest, caller_uid: int) -> int:
    """``chv-cell task VERB`` (an agent.AgentRequest of action task) for ``caller_uid``; its exit code."""
    from . import tasks  # noqa: PLC0415

    if pol["platform"] != "linux":
        logmod.log("tasks are not supported for %s cells yet" % pol["platform"])
        return exits.EXIT_CONFIG
    if req.verb == "export":
        return tasks.export(pol, cast(str, req.task), caller_uid, list(req.paths), req.max_bytes)
    repo = None if req.repo is None else (req.repo, req.ref)
    return tasks.command(pol, cast(str, req.verb), caller_uid, req.task, req.ttl, env_fd=req.env_fd, repo=repo)


def read_request(pol: policymod.Policy, req: AgentRequest, caller_uid: int = 0) -> int:
    """``chv-cell read`` (an agent.AgentRequest of action read): the slot's
    file on stdout (slotfiles.py); its exit code.  A slot a task owns is
    read only for the task's owner (``caller_uid``) and root (67)."""
    from . import slotfiles  # noqa: PLC0415
    from . import taskrec  # noqa: PLC0415

    def allowed() -> Optional[int]:
        owner_task = taskrec.reserved_by(pol, cast(str, req.slot))
        rec = taskrec.read(pol, owner_task) if owner_task else None
        if rec is not None and not taskrec.may_use(rec, caller_uid):
            logmod.log("read: slot %s belongs to a task of another user (uid %d may not read it)"
                       % (req.slot, caller_uid))
            return exits.EXIT_NO_TASK
        return None

    refused = allowed()
    if refused is not None:
        return refused
    sys.stdout.flush()
    # a read request names both (agent._parse_read, main); the owner is looked at again once the file is
    # open: a task started meanwhile (its record is written before its slot is filled, tasks.start) is its own
    return slotfiles.read_file(pol, cast(str, req.slot), cast(str, req.path), out_fd=1, log=logmod.log,
                               allowed=allowed)
