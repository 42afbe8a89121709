"""The agent's way in: non-root ``chv-cell run|status|read`` through sudo
(docs/executor.md).  sudo lets the agent group run ``chv-cell-agent`` with
any arguments, so this module decides what a caller may ask for:
``parse_agent_args`` is the one filter (pure); ``main`` is the agent (root,
started by sudo only); ``delegate`` is the non-root wrapper, which refuses
what the agent would and then execs sudo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union, cast

from . import actions
from . import exits
from . import log as logmod
from . import policy as policymod
from .launcher import SHARED_NETWORK_REFUSAL
from .status import status_fd_problem

EXIT_REFUSED = exits.EXIT_CONFIG  # refused, nothing was started
AGENT_NAME = "chv-cell-agent"
SUDO = "/usr/bin/sudo"
GROUP_VARIABLE = "chv_cell_agent_group"

USAGE = ("usage: chv-cell run [--slot NAME | --task ID] [--timeout SECONDS] [--runtime-max SECONDS] [--status-fd N] "
         "[--env-fd N] [-v] -- CMD... | chv-cell status | chv-cell read --slot NAME [--] PATH | chv-cell task start "
         "[--ttl SECONDS] [--env-fd N] [--repo URL [--ref REF]] | chv-cell task end ID | chv-cell task list "
         "| chv-cell task export ID [--max-bytes N] [--] PATH...")

_SLOT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}\Z")  # as policy._SLOT_RE
_SECONDS_RE = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9})?$")
TIMEOUT_MAX = 86400.0  # --timeout: at most a day of waiting for a slot
_FD_RE = re.compile(r"^[0-9]{1,4}$")
STATUS_FD_MAX = 1023  # --status-fd: 3 .. 1023
READ_PATH_MAX = 4096  # read PATH: at most PATH_MAX characters
_TASK_RE = re.compile(r"^[0-9a-f]{32}\Z")  # as taskrec.TASK_ID_RE
_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}\Z")  # as broker/syncrun.py's _REF_RE
REPO_URL_MAX = 2048
TASK_VERBS = ("start", "end", "list", "export")  # `task reap` is root's (the timer's), never the agent's
EXPORT_PATHS_MAX = 64  # task export: PATHs at most
_BYTES_RE = re.compile(r"^[1-9][0-9]{0,15}\Z")


# status_fd: run's --status-fd (None without); path: read's PATH; task: run's
# --task or task end's ID; ttl: task start's --ttl; verb: task's verb;
# env_fd: run's or task start's --env-fd (the variables' fd, taskenv.py);
# repo, ref: task start's --repo and --ref (clone.py); paths, max_bytes:
# task export's PATHs and --max-bytes (export.py).
class AgentRequest(NamedTuple):
    action: str
    slot: Optional[str]
    timeout: Optional[float]
    runtime_max: Optional[float]
    shared_network: bool
    verbose: bool
    command: List[str]
    status_fd: Optional[int] = None
    path: Optional[str] = None
    task: Optional[str] = None
    ttl: Optional[float] = None
    verb: Optional[str] = None
    env_fd: Optional[int] = None
    repo: Optional[str] = None
    ref: Optional[str] = None
    paths: Tuple[str, ...] = ()
    max_bytes: Optional[int] = None


class Refused(Exception):
    """The request is not one the agent entry point serves; ``str()`` says why."""


def _seconds(option: str, value: str, lowest_exclusive: bool) -> float:
    """A plain decimal number of seconds for ``option`` (no sign, exponent,
    inf or nan); at least 0, or above 0 when ``lowest_exclusive``."""
    if not _SECONDS_RE.match(value):
        raise Refused("%s needs a plain number of seconds, not %r" % (option, value))
    v = float(value)
    if lowest_exclusive and v <= 0:
        raise Refused("%s must be > 0 seconds" % option)
    limits = {"--timeout": TIMEOUT_MAX, "--ttl": float(policymod.TASK_TTL_LIMIT)}
    limit = limits.get(option, policymod.RUNTIME_MAX_LIMIT)
    if v > limit:
        raise Refused("%s %s is above the limit of %gs" % (option, value, limit))
    return v


_VALUE_OPTIONS = ("--slot", "--task", "--timeout", "--runtime-max", "--status-fd", "--env-fd")
_FLAG_OPTIONS = {"-v": "verbose", "--verbose": "verbose", "--shared-network": "shared_network"}


def _parse_read(rest: Sequence[str]) -> AgentRequest:
    """``read`` OPTIONS: exactly ``--slot NAME`` (or ``--slot=NAME``), then
    an optional ``--``, then one PATH (1 to 4096 characters; one that starts
    with '-' only after ``--``)."""
    slot = None
    i = 0
    while i < len(rest) and rest[i] != "--" and rest[i].startswith("-"):
        name, eq, value = rest[i].partition("=")
        if name != "--slot":
            raise Refused("option %r is not allowed for read (allowed: --slot)" % rest[i])
        if slot is not None:
            raise Refused("--slot given twice")
        if not eq:
            if i + 1 >= len(rest):
                raise Refused("--slot needs a value")
            value = rest[i + 1]
            i += 1
        if not _SLOT_RE.match(value):
            raise Refused("--slot %r is not a slot name" % value)
        slot = value
        i += 1
    if slot is None:
        raise Refused("read needs --slot NAME")
    paths = rest[i:]
    if paths[:1] == ["--"]:
        paths = paths[1:]
    if len(paths) != 1:
        raise Refused("read needs exactly one PATH (got %d)" % len(paths))
    path = paths[0]
    if not path or len(path) > READ_PATH_MAX or "\0" in path:
        raise Refused("read: PATH must be 1 to %d characters" % READ_PATH_MAX)
    return AgentRequest("read", slot, None, None, False, False, [], None, path)


def _task_id(value: str) -> str:
    if not _TASK_RE.match(value):
        raise Refused("%r is not a task id (32 hex digits, as task start printed it)" % value)
    return value


def _parse_task(rest: Sequence[str]) -> AgentRequest:
    """``task start [--ttl S]``, ``task end ID`` or ``task list``: nothing else."""
    if not rest or rest[0] not in TASK_VERBS:
        raise Refused("task needs one of %s, not %r" % (", ".join(TASK_VERBS), rest[0] if rest else ""))
    verb, args = rest[0], list(rest[1:])
    none = AgentRequest("task", None, None, None, False, False, [], verb=verb)
    if verb == "list":
        if args:
            raise Refused("task list takes no arguments (got %r)" % args[0])
        return none
    if verb == "end":
        if len(args) != 1:
            raise Refused("task end needs exactly one task ID (got %d arguments)" % len(args))
        return none._replace(task=_task_id(args[0]))
    if verb == "export":
        return _parse_export(none, args)
    got: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name not in _START_OPTIONS:
            raise Refused("option %r is not allowed for task start (allowed: %s)"
                          % (args[i], ", ".join(_START_OPTIONS)))
        if not eq:
            if i + 1 >= len(args):
                raise Refused("%s needs a value" % name)
            value = args[i + 1]
            i += 1
        i += 1
        if name in got:
            raise Refused("%s given twice" % name)
        got[name] = _START_OPTIONS[name](value)
    if "--ref" in got and "--repo" not in got:
        raise Refused("--ref goes with --repo (the repository the task starts with)")
    return none._replace(ttl=got.get("--ttl"), env_fd=got.get("--env-fd"), repo=got.get("--repo"),
                         ref=got.get("--ref"))


def _parse_export(none: AgentRequest, args: List[str]) -> AgentRequest:
    """``task export ID [--max-bytes N] [--] PATH...``: 1 to EXPORT_PATHS_MAX
    PATHs (as read's PATH; one that starts with '-' only after ``--``)."""
    if not args:
        raise Refused("task export needs a task ID and at least one PATH")
    task, rest, max_bytes = _task_id(args[0]), args[1:], None
    while rest and rest[0] != "--" and rest[0].startswith("-"):
        name, eq, value = rest[0].partition("=")
        if name != "--max-bytes":
            raise Refused("option %r is not allowed for task export (allowed: --max-bytes)" % rest[0])
        if max_bytes is not None:
            raise Refused("--max-bytes given twice")
        if not eq:
            if len(rest) < 2:
                raise Refused("--max-bytes needs a value")
            value, rest = rest[1], rest[1:]
        if not _BYTES_RE.match(value):
            raise Refused("--max-bytes %r must be a whole number of bytes above 0" % value)
        max_bytes, rest = int(value), rest[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not 0 < len(rest) <= EXPORT_PATHS_MAX:
        raise Refused("task export needs 1 to %d PATHs (got %d)" % (EXPORT_PATHS_MAX, len(rest)))
    for path in rest:
        if not path or len(path) > READ_PATH_MAX or "\0" in path:
            raise Refused("task export: each PATH must be 1 to %d characters" % READ_PATH_MAX)
    return none._replace(task=task, paths=tuple(rest), max_bytes=max_bytes)


def _repo_url(value: str) -> str:
    """--repo: a URL (1 to 2048 printable characters, no blank, not an option); clone.py checks the rest."""
    if not 0 < len(value) <= REPO_URL_MAX or value.startswith("-") or any(not 32 < ord(c) < 127 for c in value):
        raise Refused("--repo must be a URL of 1 to %d printable characters without blanks" % REPO_URL_MAX)
    return value


def _ref(value: str) -> str:
    """--ref: a plain branch, tag or commit name (as broker/syncrun.py's check_clone)."""
    if not _REF_RE.match(value) or ".." in value or value.endswith((".", "/", ".lock")):
        raise Refused("--ref %r is not a plain branch, tag or commit name" % value)
    return value


def _ttl(value: str) -> float:
    return _seconds("--ttl", value, lowest_exclusive=True)


def _env_fd(value: str) -> int:
    """--env-fd: 0 (stdin: the variables, then the payload's input) or 3 to STATUS_FD_MAX."""
    if not _FD_RE.match(value) or not (int(value) == 0 or 3 <= int(value) <= STATUS_FD_MAX):
        raise Refused("--env-fd %r must be 0 (stdin) or a file descriptor number from 3 to %d"
                      % (value, STATUS_FD_MAX))
    return int(value)


_START_OPTIONS: Dict[str, Callable[[str], Any]] = {"--ttl": _ttl, "--env-fd": _env_fd, "--repo": _repo_url,
                                                   "--ref": _ref}


def parse_agent_args(args: Iterable[str]) -> AgentRequest:
    """Accept exactly ``status``, ``read --slot NAME [--] PATH`` or ``run
    OPTIONS... -- CMD...`` (USAGE; docs/executor.md): each option at most
    once, as ``--opt VALUE`` or ``--opt=VALUE``, no abbreviation, no
    ``--policy``; CMD verbatim, its first word non-empty.  Raises Refused
    naming the first offending argument."""
    args = list(args)
    if not args:
        raise Refused("no subcommand given")
    action, rest = args[0], args[1:]
    if action == "status":
        if rest:
            raise Refused("status takes no arguments (got %r)" % rest[0])
        return AgentRequest("status", None, None, None, False, False, [])
    if action == "read":
        return _parse_read(rest)
    if action == "task":
        return _parse_task(rest)
    if action != "run":
        raise Refused("only run, status, read and task are allowed here, not %r" % action)
    if "--" not in rest:
        raise Refused("run needs '--' before the command")
    sep = rest.index("--")
    opts, command = rest[:sep], rest[sep + 1:]
    if not command or command[0] == "":
        raise Refused("run needs a command after '--'")
    got: Dict[str, Any] = {}  # by option: str (--slot), int (--status-fd), float (seconds) or bool (flags)
    value: Union[str, float]  # the text given, then the option's value
    i = 0
    while i < len(opts):
        tok = opts[i]
        if tok in _FLAG_OPTIONS:
            key, value = _FLAG_OPTIONS[tok], True
            i += 1
        else:
            name, eq, value = tok.partition("=")
            if name not in _VALUE_OPTIONS:
                if tok.startswith("-"):
                    raise Refused("option %r is not allowed (allowed: --slot, --task, --timeout, --runtime-max, "
                                  "--status-fd, -v, --shared-network)" % tok)
                raise Refused("unexpected argument %r before '--'" % tok)
            if not eq:
                if i + 1 >= len(opts):
                    raise Refused("%s needs a value" % name)
                value = opts[i + 1]
                i += 2
            else:
                i += 1
            key = name[2:].replace("-", "_")
            if name == "--slot":
                if not _SLOT_RE.match(value):
                    raise Refused("--slot %r is not a slot name" % value)
            elif name == "--task":
                value = _task_id(value)
            elif name == "--status-fd":
                if not _FD_RE.match(value) or not 3 <= int(value) <= STATUS_FD_MAX:
                    raise Refused("--status-fd %r must be a file descriptor number from 3 to %d (0-2 are the "
                                  "payload's streams)" % (value, STATUS_FD_MAX))
                value = int(value)
            elif name == "--env-fd":
                value = _env_fd(value)
            else:
                value = _seconds(name, value, lowest_exclusive=(name == "--runtime-max"))
        if key in got:
            raise Refused("%s given twice" % tok.partition("=")[0])
        got[key] = value
    if "task" in got and "slot" in got:
        raise Refused("--task and --slot do not go together (a task's turns run in its slot)")
    if "env_fd" in got and got["env_fd"] == got.get("status_fd"):
        raise Refused("--env-fd and --status-fd must be two file descriptors")
    return AgentRequest("run", got.get("slot"), got.get("timeout"), got.get("runtime_max"),
                        bool(got.get("shared_network")), bool(got.get("verbose")), command, got.get("status_fd"),
                        task=got.get("task"), env_fd=got.get("env_fd"))


def render_agent_args(req: AgentRequest) -> List[str]:
    """The canonical argument list of ``req`` (what the wrapper passes to the
    agent); ``parse_agent_args(render_agent_args(r)) == r`` for every request
    that parse_agent_args returned (seconds to 1e-9 otherwise)."""
    if req.action == "status":
        return ["status"]
    if req.action == "read":
        return ["read", "--slot", cast(str, req.slot), "--", cast(str, req.path)]  # _parse_read sets both
    if req.action == "task":
        out = ["task", cast(str, req.verb)]
        if req.verb in ("end", "export"):
            out.append(cast(str, req.task))
        if req.max_bytes is not None:
            out += ["--max-bytes", str(req.max_bytes)]
        if req.paths:
            out += ["--"] + list(req.paths)
        if req.ttl is not None:
            out += ["--ttl", _fmt(req.ttl)]
        if req.env_fd is not None:
            out += ["--env-fd", str(req.env_fd)]
        if req.repo is not None:
            out += ["--repo", req.repo]
        if req.ref is not None:
            out += ["--ref", req.ref]
        return out
    out = ["run"]
    if req.slot is not None:
        out += ["--slot", req.slot]
    if req.task is not None:
        out += ["--task", req.task]
    if req.timeout is not None:
        out += ["--timeout", _fmt(req.timeout)]
    if req.runtime_max is not None:
        out += ["--runtime-max", _fmt(req.runtime_max)]
    if req.status_fd is not None:
        out += ["--status-fd", str(req.status_fd)]
    if req.env_fd is not None:
        out += ["--env-fd", str(req.env_fd)]
    if req.shared_network:
        out.append("--shared-network")
    if req.verbose:
        out.append("-v")
    return out + ["--"] + list(req.command)


def _fmt(seconds: float) -> str:
    """Seconds as a plain decimal with at most 9 fraction digits (what
    _seconds accepts); a value parsed from such a string reads back equal."""
    return ("%.9f" % seconds).rstrip("0").rstrip(".")


class Caller(NamedTuple):
    user: str
    uid: int


def caller_from_env(environ: Mapping[str, str], euid: int) -> Caller:
    """The user sudo ran the agent for.  Requires euid 0 and SUDO_UID (digits)
    and SUDO_USER (non-empty), which sudo sets itself (the sudoers drop-in
    resets the environment).  Raises Refused otherwise, including when root
    runs the agent directly (no SUDO_UID)."""
    if euid != 0:
        raise Refused("%s runs only as root, through sudo (members of the agent group, role variable %s); "
                      "use chv-cell run" % (AGENT_NAME, GROUP_VARIABLE))
    uid, user = environ.get("SUDO_UID", ""), environ.get("SUDO_USER", "")
    if not uid or not user:
        raise Refused("%s is started only by sudo (SUDO_UID/SUDO_USER are not set); as root run chv-cell "
                      "directly" % AGENT_NAME)
    if not uid.isdigit() or "\n" in user:
        raise Refused("SUDO_UID %r / SUDO_USER %r do not name a user" % (uid, user))
    return Caller(user, int(uid))


def main(args: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None,
         euid: Optional[int] = None) -> int:
    """The ``chv-cell-agent`` entry point (root, through sudo): the filter,
    the caller, the installed policy (no override) and --shared-network are
    checked before a slot is claimed or a file written; each refusal is one
    line and 78 (and, once --status-fd is known usable, its verdict)."""
    args = sys.argv[1:] if args is None else args
    environ = os.environ if environ is None else environ
    euid = os.geteuid() if euid is None else euid
    try:
        req = parse_agent_args(args)
        caller = caller_from_env(environ, euid)
    except Refused as exc:
        logmod.log("%s: %s; %s" % (AGENT_NAME, exc, USAGE))
        return EXIT_REFUSED
    problem = _status_fd_problem(req)
    if problem:
        logmod.log("%s: %s" % (AGENT_NAME, problem))
        return EXIT_REFUSED
    pol = actions.load_policy(policymod.DEFAULT_POLICY_PATH)
    if pol is None:
        return actions.refuse_with_status(req.status_fd)
    if req.shared_network and not pol["allow_shared_network"]:
        logmod.log(SHARED_NETWORK_REFUSAL)
        return actions.refuse_with_status(req.status_fd)
    if req.action == "status":
        return actions.print_status(pol)
    if req.action == "read":
        return actions.read_request(pol, req, caller.uid)
    if req.action == "task":
        return actions.task_request(pol, req, caller.uid)
    return actions.run_request(pol, req, caller="%s (uid %d) through sudo" % (caller.user, caller.uid),
                               caller_uid=caller.uid)


def _status_fd_problem(req: AgentRequest) -> Optional[str]:
    """What is wrong with the request's --status-fd or --env-fd (None: fine, or none)."""
    if req.status_fd is not None:
        problem = status_fd_problem(req.status_fd)
        if problem:
            return problem
    if req.env_fd is not None:
        try:
            os.fstat(req.env_fd)
        except OSError:
            return "--env-fd %d is not an open file descriptor" % req.env_fd
    return None


# ---------------------------------------------------------------- the wrapper side
def split_top(args: Sequence[str]) -> Optional[Tuple[bool, bool, str, Sequence[str]]]:
    """Split ``chv-cell`` arguments at the subcommand.

    Returns (verbose, policy_given, action, rest) when everything before the
    first non-option word is ``-v``/``--verbose`` or ``--policy FILE`` /
    ``--policy=FILE``; None for any other leading option (``-h`` included),
    so that argparse handles (and reports) it."""
    verbose = policy_given = False
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-v", "--verbose"):
            verbose = True
        elif a == "--policy":
            policy_given = True
            i += 1
        elif a.startswith("--policy="):
            policy_given = True
        elif a.startswith("-"):
            return None
        else:
            return verbose, policy_given, a, args[i + 1:]
        i += 1
    return None


def agent_path() -> str:
    """``chv-cell-agent`` in the directory that holds this package, which is
    the directory of the running ``chv-cell`` (/usr/lib/chv-fleet)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), AGENT_NAME)


def sudo_argv(agent: str, agent_args: Iterable[str], sudo: str = SUDO, status_fd: Optional[int] = None,
              env_fd: Optional[int] = None) -> List[str]:
    """The command a non-root ``chv-cell`` execs: ``sudo -n AGENT ARGS``;
    with ``status_fd`` (or an ``env_fd`` of 3 or more), ``sudo -n -C N+1
    AGENT ARGS`` for the higher of the two: sudo then closes only the fds
    above it (the sudoers option closefrom_override allows -C for the
    agent)."""
    fds = [fd for fd in (status_fd, env_fd) if fd is not None and fd >= 3]
    keep = ["-C", str(max(fds) + 1)] if fds else []
    return [sudo, "-n"] + keep + [agent] + list(agent_args)


def delegate(verbose: bool, policy_given: bool, action: str, rest: Sequence[str], sudo: str = SUDO,
             agent: Optional[str] = None, policy_path: Optional[str] = None,
             execv: Callable[[str, List[str]], object] = os.execv) -> int:
    """Non-root ``chv-cell [-v] run|status|read ...``: refuse (78, one line,
    nothing started) what the agent would refuse, --policy, and a
    --shared-network the world-readable policy forbids; check with ``sudo
    -n -l`` that the user may run the agent (else say so, naming the group
    variable); then exec sudo.  Returns an exit code only when refusing."""
    agent = agent or agent_path()
    policy_path = policy_path or policymod.DEFAULT_POLICY_PATH
    if policy_given:
        logmod.log("--policy is not allowed for a non-root user: cells run through sudo with the installed "
                   "policy %s only" % policymod.DEFAULT_POLICY_PATH)
        return EXIT_REFUSED
    if action == "run" and verbose:
        rest = ["-v"] + list(rest)
    try:
        req = parse_agent_args([action] + list(rest))
        problem = _status_fd_problem(req)
    except Refused as exc:
        problem = str(exc)
    if problem:
        logmod.log("%s; %s" % (problem, USAGE))
        return EXIT_REFUSED
    if req.shared_network:
        try:
            allowed = policymod.load(policy_path)["allow_shared_network"]
        except policymod.PolicyError as exc:
            for e in exc.errors:
                logmod.log(e)
            return EXIT_REFUSED
        if not allowed:
            logmod.log(SHARED_NETWORK_REFUSAL)
            return EXIT_REFUSED
    user = _user_name()
    problem = sudo_problem(sudo, agent)
    if problem:
        logmod.log("user %s (uid %d) is not allowed to run cells: %s. Cells run through sudo for members of "
                   "the agent group (role variable %s)" % (user, os.getuid(), problem, GROUP_VARIABLE))
        return EXIT_REFUSED
    execv(sudo, sudo_argv(agent, render_agent_args(req), sudo, req.status_fd, req.env_fd))
    return EXIT_REFUSED  # only reached with a test's execv


def sudo_problem(sudo: str, agent: str) -> Optional[str]:
    """None when ``sudo -n -l AGENT`` says this user may run AGENT without a
    password; otherwise what went wrong (sudo missing, or its answer)."""
    if not os.access(sudo, os.X_OK):
        return "%s is not installed" % sudo
    try:
        r = subprocess.run([sudo, "-n", "-l", agent], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "cannot run %s: %s" % (sudo, exc)
    if r.returncode != 0:
        said = " ".join(r.stdout.decode(errors="replace").split()) or "exit %d" % r.returncode
        return "sudo -n refuses %s (%s)" % (agent, said)
    return None


def _user_name() -> str:
    """This process's user name (the uid as text when it has none)."""
    import pwd  # noqa: PLC0415

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())
