"""Per-task and per-turn environment (docs/executor.md "Passing variables
to the agent"): named variables, such as a model credential, that the
executor hands to the payload without them ever being on a command line,
in a file of the slot or in a log line.

The executor writes ``NAME=VALUE`` lines, ended by an empty line (or the
end of the stream), on the fd of ``--env-fd N`` (0: stdin, the rest of
which stays the payload's).  The launcher reads them as root (``read_env``),
keeps only names the policy's ``env_allow`` lists (``parse_env``; any other
name refuses the whole request, 78) and hands them into the cell through
its start gate: the FIFO the cell's pid 2 reads before it execs the payload
(``gate_message``; argv.GATE_SCRIPT exports each line).  A task's variables
(``task start --env-fd``) are kept in its root-only directory outside the
slot (``<state_dir>/tasks/<id>.env``, 0600) until its end; a turn's own
ones only in the launcher's memory."""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Mapping, Optional

from .fsutil import write_atomic

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
# set by the launcher in every cell (argv.cell_environment): never passed
RESERVED = frozenset(["CHV_CELL", "CHV_SLOT", "HOME", "USER", "LOGNAME"])
# names of the launcher's and the gate script's own (argv.GATE_SCRIPT's shell variables)
RESERVED_PREFIX = "chv_"
ENV_MAX_BYTES = 32768  # everything passed for one run: well below a pipe's buffer (the gate's write never blocks)


class EnvRefused(Exception):
    """The variables cannot be passed; ``str()`` says why, never with a value."""


def name_problem(name: object) -> Optional[str]:
    """Why ``name`` can never be passed (None: it can, if the policy lists it)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        return "%r is not an environment variable name" % (name,)
    if name in RESERVED:
        return "%s is set by the launcher in every cell" % name
    if name.lower().startswith(RESERVED_PREFIX):
        return "%s: names beginning with CHV_ (any case) are the launcher's" % name
    return None


def validate_allow(allow: object, setenv: object) -> List[str]:
    """The policy's ``env_allow``: a list of distinct names that may be
    passed (none reserved, none also in ``setenv``); its errors."""
    if not isinstance(allow, list):
        return ["env_allow: must be a list of environment variable names (role variable chv_cell_env_allow)"]
    errors: List[str] = []
    for n in allow:
        problem = name_problem(n)
        if problem:
            errors.append("env_allow (role variable chv_cell_env_allow): %s" % problem)
    if len(set(map(str, allow))) != len(allow):
        errors.append("env_allow (role variable chv_cell_env_allow): a name is listed twice")
    if isinstance(setenv, dict):
        both = sorted(set(setenv) & {n for n in allow if isinstance(n, str)})
        if both:
            errors.append("env_allow (role variable chv_cell_env_allow): %s also set by setenv (chv_cell_setenv): "
                          "one or the other" % ", ".join(both))
    return errors


def read_env(fd: int, limit: int = ENV_MAX_BYTES) -> bytes:
    """The lines on ``fd`` up to and including the first empty line, or to
    its end: one byte at a time, so that nothing after the empty line is
    consumed (on stdin, that is the payload's).  EnvRefused past ``limit``
    bytes or when ``fd`` cannot be read."""
    buf = bytearray()
    while True:
        try:
            b = os.read(fd, 1)
        except OSError as exc:
            raise EnvRefused("--env-fd %d cannot be read: %s" % (fd, exc.strerror))
        if not b:
            return bytes(buf)
        buf += b
        if b == b"\n" and (len(buf) == 1 or buf.endswith(b"\n\n")):
            return bytes(buf)
        if len(buf) > limit:
            raise EnvRefused("--env-fd %d: more than %d bytes before the empty line that ends the variables"
                             % (fd, limit))


def parse_env(data: bytes, allow: Iterable[str]) -> Dict[str, str]:
    """``NAME=VALUE`` lines (an empty line or the end closes them) as a
    mapping.  Refused (EnvRefused, naming the line or the name, never a
    value): text that is not UTF-8, a line without ``=``, a NUL, a name
    given twice, a name the policy's ``env_allow`` does not list."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise EnvRefused("the variables are not UTF-8 text")
    allowed = frozenset(allow)
    out: Dict[str, str] = {}
    for i, line in enumerate(text.split("\n"), 1):
        if line == "":
            break
        name, eq, value = line.partition("=")
        if not eq or not NAME_RE.match(name):
            raise EnvRefused("line %d of the variables is not NAME=VALUE" % i)
        if "\0" in value:
            raise EnvRefused("the value of %s holds a NUL byte" % name)
        if name in out:
            raise EnvRefused("%s is given twice" % name)
        if name not in allowed:
            raise EnvRefused("%s may not be passed to a cell (the policy's env_allow, role variable "
                             "chv_cell_env_allow, lists: %s)" % (name, ", ".join(sorted(allowed)) or "none"))
        out[name] = value
    return out


def check_allowed(env: Mapping[str, str], allow: Iterable[str]) -> None:
    """A task's kept variables at a turn: every name still allowed (the policy may have changed)."""
    allowed = frozenset(allow)
    for name in sorted(env):
        if name not in allowed:
            raise EnvRefused("%s, passed at the task's start, is no longer in the policy's env_allow" % name)


def gate_message(env: Mapping[str, str]) -> bytes:
    """What the launcher writes into the start gate: ``go``, one
    ``NAME=VALUE`` line per variable, and the empty line that releases the
    payload (argv.GATE_SCRIPT)."""
    lines = ["go"] + ["%s=%s" % (k, env[k]) for k in sorted(env)]
    data = ("\n".join(lines) + "\n\n").encode("utf-8")
    if len(data) > ENV_MAX_BYTES + 64:
        raise EnvRefused("the variables of this run are more than %d bytes" % ENV_MAX_BYTES)
    return data


# ---------------------------------------------------------------- a task's own
def task_env_path(tasks_dir: str, task_id: str) -> str:
    return os.path.join(tasks_dir, task_id + ".env")


def save_task_env(tasks_dir: str, task_id: str, env: Mapping[str, str]) -> None:
    """Keep a task's variables beside its record (root's, 0600; none: no file)."""
    if env:
        os.makedirs(tasks_dir, mode=0o700, exist_ok=True)
        write_atomic(task_env_path(tasks_dir, task_id), json.dumps(dict(env), sort_keys=True) + "\n", 0o600)


def load_task_env(tasks_dir: str, task_id: str) -> Dict[str, str]:
    """A task's kept variables ({} when it has none); EnvRefused when the file is unusable."""
    try:
        fd = os.open(task_env_path(tasks_dir, task_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise EnvRefused("the task's variables cannot be read: %s" % exc.strerror)
    try:
        with os.fdopen(fd) as fh:
            env = json.load(fh)
    except (OSError, ValueError):
        raise EnvRefused("the task's variables cannot be read")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise EnvRefused("the task's variables are not a mapping of names to strings")
    return env


def remove_task_env(tasks_dir: str, task_id: str) -> None:
    try:
        os.unlink(task_env_path(tasks_dir, task_id))
    except FileNotFoundError:
        pass
