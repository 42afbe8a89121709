"""The agent's way in (chv_guest/cell/agent.py): the argument filter of the
root-only chv-cell-agent, the caller check, the non-root chv-cell's
delegation to sudo, and the launcher's disconnect detection (launcher.py, signals.py)."""

import json
import os
import select
import signal
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chv_guest.cell import agent
from chv_guest.cell import cli
from chv_guest.cell import errors
from chv_guest.cell import policy as policymod
from chv_guest.cell import fsutil, runner, signals
from testpaths import SRC

SUDO_ENV = {"SUDO_UID": "1000", "SUDO_USER": "chv"}
TASK_ID = "0123456789abcdef0123456789abcdef"


# ---------------------------------------------------------------- the filter
@pytest.mark.parametrize(
    "args, expected",
    [
        (["status"], agent.AgentRequest("status", None, None, None, False, False, [])),
        (["run", "--", "true"], agent.AgentRequest("run", None, None, None, False, False, ["true"])),
        (["run", "--slot", "slot1", "--timeout", "2.5", "--runtime-max", "60", "-v", "--", "sh", "-c", "x"],
         agent.AgentRequest("run", "slot1", 2.5, 60.0, False, True, ["sh", "-c", "x"])),
        (["run", "--slot=slot0", "--timeout=0", "--runtime-max=0.5", "--verbose", "--shared-network", "--", "a"],
         agent.AgentRequest("run", "slot0", 0.0, 0.5, True, True, ["a"])),
        (["run", "--task", TASK_ID, "--status-fd", "3", "--", "true"],
         agent.AgentRequest("run", None, None, None, False, False, ["true"], 3, task=TASK_ID)),
        (["task", "start"], agent.AgentRequest("task", None, None, None, False, False, [], verb="start")),
        (["task", "start", "--ttl", "60"],
         agent.AgentRequest("task", None, None, None, False, False, [], verb="start", ttl=60.0)),
        (["task", "start", "--ttl=0.5"],
         agent.AgentRequest("task", None, None, None, False, False, [], verb="start", ttl=0.5)),
        (["task", "end", TASK_ID],
         agent.AgentRequest("task", None, None, None, False, False, [], verb="end", task=TASK_ID)),
        (["task", "list"], agent.AgentRequest("task", None, None, None, False, False, [], verb="list")),
        (["task", "start", "--env-fd", "0", "--ttl", "9"],
         agent.AgentRequest("task", None, None, None, False, False, [], verb="start", ttl=9.0, env_fd=0)),
        (["run", "--task", TASK_ID, "--env-fd=5", "--status-fd", "3", "--", "true"],
         agent.AgentRequest("run", None, None, None, False, False, ["true"], 3, task=TASK_ID, env_fd=5)),
        # everything after the first -- is the payload's, verbatim
        (["run", "--", "--policy", "/x", "--", "status"],
         agent.AgentRequest("run", None, None, None, False, False, ["--policy", "/x", "--", "status"])),
    ],
)
def test_allowed_shapes(args, expected):
    assert agent.parse_agent_args(args) == expected
    # the canonical form the wrapper passes on parses back to the same request
    assert agent.parse_agent_args(agent.render_agent_args(expected)) == expected


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "no subcommand"),
        (["argv", "--", "true"], "only run, status, read and task"),
        (["validate-policy", "/x"], "only run, status, read and task"),
        (["--policy", "/x", "run", "--", "true"], "only run, status, read and task"),
        (["run", "--policy=/x", "--", "true"], "'--policy=/x' is not allowed"),
        (["run", "--policy", "/x", "--", "true"], "'--policy' is not allowed"),
        (["run", "--pol", "/x", "--", "true"], "'--pol' is not allowed"),
        (["run", "--"], "needs a command"),
        (["run", "--", ""], "needs a command"),
        (["run", "true"], "needs '--'"),
        (["run"], "needs '--'"),
        (["status", "--policy", "x"], "status takes no arguments"),
        (["status", "-v"], "status takes no arguments"),
        (["run", "--slot", "--", "true"], "--slot needs a value"),
        (["run", "--slot", "../x", "--", "true"], "not a slot name"),
        (["run", "--slot", "a", "--slot", "b", "--", "true"], "given twice"),
        (["run", "-v", "--verbose", "--", "true"], "given twice"),
        (["run", "--timeout", "-1", "--", "true"], "plain number"),
        (["run", "--timeout", "nan", "--", "true"], "plain number"),
        (["run", "--timeout", "1e3", "--", "true"], "plain number"),
        (["run", "--timeout", "86401", "--", "true"], "above the limit"),
        (["run", "--runtime-max", "0", "--", "true"], "must be > 0"),
        (["run", "--timeout", "--", "true"], "--timeout needs a value"),
        (["run", "--timeout"], "needs '--'"),
        (["run", "-h", "--", "true"], "'-h' is not allowed"),
        (["run", "-vv", "--", "true"], "'-vv' is not allowed"),
        (["run", "slot0", "--", "true"], "unexpected argument 'slot0'"),
        (["run", "--verbose=1", "--", "true"], "'--verbose=1' is not allowed"),
        # tasks: exactly start [--ttl S], end ID, list; never reap (root's), never --policy
        (["task"], "task needs one of start, end, list, export"),
        (["task", "reap"], "task needs one of start, end, list, export, not 'reap'"),
        (["task", "--policy", "/x", "start"], "not '--policy'"),
        (["task", "start", "--policy", "/x"], "'--policy' is not allowed for task start"),
        (["task", "start", "--ttl"], "--ttl needs a value"),
        (["task", "start", "--ttl", "0"], "must be > 0"),
        (["task", "start", "--ttl", "604801"], "above the limit"),
        (["task", "start", "--ttl", "1e3"], "plain number"),
        (["task", "start", "--ttl", "5", "--ttl", "6"], "--ttl given twice"),
        (["task", "start", "--ttl=5", "x"], "option 'x' is not allowed for task start"),
        (["task", "start", "--env-fd", "0", "--env-fd=0"], "--env-fd given twice"),
        (["task", "start", "--env-fd", "2"], "must be 0 (stdin) or a file descriptor number from 3"),
        (["task", "start", "--env-fd"], "--env-fd needs a value"),
        (["run", "--env-fd", "1", "--", "true"], "must be 0 (stdin)"),
        (["run", "--env-fd", "1024", "--", "true"], "must be 0 (stdin)"),
        (["run", "--env-fd", "-0", "--", "true"], "must be 0 (stdin)"),
        (["run", "--env-fd", "3", "--status-fd", "3", "--", "true"], "two file descriptors"),
        (["task", "list", "--all"], "task list takes no arguments"),
        (["task", "end"], "exactly one task ID"),
        (["task", "end", TASK_ID, TASK_ID], "exactly one task ID"),
        (["task", "end", "../" + TASK_ID[3:]], "not a task id"),
        (["task", "end", TASK_ID.upper()], "not a task id"),
        (["task", "end", TASK_ID + "0"], "not a task id"),
        (["run", "--task", "x", "--", "true"], "not a task id"),
        (["run", "--task", TASK_ID, "--slot", "slot0", "--", "true"], "--task and --slot do not go together"),
        (["run", "--task", TASK_ID, "--task", TASK_ID, "--", "true"], "given twice"),
    ],
)
def test_refused_shapes(args, says):
    with pytest.raises(agent.Refused) as exc:
        agent.parse_agent_args(args)
    assert says in str(exc.value)


def oracle(args):
    """An independent statement of the allowed shape (regex per token)."""
    import re

    if args == ["status"]:
        return True
    num = r"[0-9]{1,9}(\.[0-9]{1,9})?"
    if args[:1] == ["task"]:
        rest = args[1:]
        if rest in (["list"], ["start"]):
            return True
        if len(rest) == 2 and rest[0] == "end":
            return bool(re.fullmatch(r"[0-9a-f]{32}", rest[1]))
        if rest[:1] == ["export"]:
            if len(rest) < 2 or not re.fullmatch(r"[0-9a-f]{32}", rest[1]):
                return False
            tail = rest[2:]
            if tail[:1] and tail[0].startswith("--max-bytes"):
                if tail[0] == "--max-bytes" and len(tail) > 1:
                    value, tail = tail[1], tail[2:]
                elif tail[0].startswith("--max-bytes="):
                    value, tail = tail[0][len("--max-bytes="):], tail[1:]
                else:
                    return False
                if not re.fullmatch(r"[1-9][0-9]{0,15}", value):
                    return False
            if tail[:1] == ["--"]:
                tail = tail[1:]
            elif tail[:1] and tail[0].startswith("-"):
                return False
            return 0 < len(tail) <= 64 and all(0 < len(p) <= 4096 and "\0" not in p for p in tail)
        if rest[:1] != ["start"]:
            return False
        start_ok = {"--ttl": lambda v: re.fullmatch(num, v) and 0 < float(v) <= policymod.TASK_TTL_LIMIT,
                    "--env-fd": ENV_FD_OK}
        return _oracle_options(rest[1:], start_ok, ()) is not None
    if args and args[0] == "read":
        rest = args[1:]
        if len(rest) >= 2 and rest[0] == "--slot":
            slot, rest = rest[1], rest[2:]
        elif rest and rest[0].startswith("--slot="):
            slot, rest = rest[0][len("--slot="):], rest[1:]
        else:
            return False
        if rest[:1] == ["--"]:
            rest = rest[1:]
        elif rest[:1] and rest[0].startswith("-"):
            return False
        return (bool(re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", slot)) and len(rest) == 1
                and 0 < len(rest[0]) <= 4096 and "\0" not in rest[0])
    if not args or args[0] != "run" or "--" not in args[1:]:
        return False
    sep = args.index("--", 1)
    opts, cmd = args[1:sep], args[sep + 1:]
    if not cmd or not cmd[0]:
        return False
    value_ok = {
        "--slot": lambda v: re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", v),
        "--task": lambda v: re.fullmatch(r"[0-9a-f]{32}", v),
        "--timeout": lambda v: re.fullmatch(num, v) and float(v) <= 86400,
        "--runtime-max": lambda v: re.fullmatch(num, v) and 0 < float(v) <= policymod.RUNTIME_MAX_LIMIT,
        "--status-fd": lambda v: re.fullmatch(r"[0-9]{1,4}", v) and 3 <= int(v) <= 1023,
        "--env-fd": ENV_FD_OK,
    }
    seen = _oracle_options(opts, value_ok, ("-v", "--verbose", "--shared-network"))
    if seen is None or ("--status-fd" in seen and "--env-fd" in seen
                        and int(seen["--status-fd"]) == int(seen["--env-fd"])):
        return False
    return not {"--slot", "--task"} <= set(seen)


def ENV_FD_OK(v):  # noqa: N802 (a value check of the oracle's tables)
    import re

    return re.fullmatch(r"[0-9]{1,4}", v) and (int(v) == 0 or 3 <= int(v) <= 1023)


def _oracle_options(opts, value_ok, flags):
    """Each option at most once, as ``--opt VALUE`` or ``--opt=VALUE`` (a
    value ``value_ok`` accepts) or a flag of ``flags``: {option: value}, or
    None when any token is off."""
    seen = {}
    i = 0
    while i < len(opts):
        t = opts[i]
        if t in flags:
            key, value, i = ("-v" if t == "--verbose" else t), True, i + 1
        elif t in value_ok and i + 1 < len(opts) and value_ok[t](opts[i + 1]):
            key, value, i = t, opts[i + 1], i + 2
        elif "=" in t and t.split("=", 1)[0] in value_ok and value_ok[t.split("=", 1)[0]](t.split("=", 1)[1]):
            key, value, i = t.split("=", 1)[0], t.split("=", 1)[1], i + 1
        else:
            return None
        if key in seen:
            return None
        seen[key] = value
    return seen


TOKENS = ["run", "status", "argv", "validate-policy", "--", "-v", "--verbose", "--policy", "--policy=/x", "/x",
          "--shared-network", "--slot", "--slot=slot0", "slot0", "--timeout", "--timeout=1", "1", "0", "-1", "1e9",
          "--runtime-max", "0.5", "-h", "--help", "--pol", "", "true", "sh", "-c", "--json", "x=y", "--slot=", "nan",
          "read", "--status-fd", "--status-fd=3", "2", "3", "/workspace/r.txt", "-x",
          "task", "start", "end", "list", "reap", "--ttl", "--ttl=60", "604801", "--task", TASK_ID, "--task=" + TASK_ID,
          TASK_ID.upper(), TASK_ID[:-1], "--env-fd", "--env-fd=0", "--env-fd=3",
          "export", "--max-bytes", "--max-bytes=5"]


def _accepted(args):
    try:
        agent.parse_agent_args(args)
    except agent.Refused:
        return False
    return True


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=9))
def test_filter_matches_the_oracle_on_dangerous_tokens(args):
    assert _accepted(args) == oracle(args), args


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=8))
def test_random_argv_never_passes_unless_of_the_allowed_shape(args):
    ok = _accepted(args)
    assert ok == oracle(args), args
    if ok:
        req = agent.parse_agent_args(args)
        before = args[:args.index("--")] if "--" in args else args
        assert not any(a.startswith("--policy") for a in before)
        assert agent.parse_agent_args(agent.render_agent_args(req)) == req


@settings(max_examples=500, deadline=None)
@given(
    slot=st.none() | st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,31}\Z"),
    timeout=st.none() | st.floats(min_value=0, max_value=86400),
    runtime=st.none() | st.floats(min_value=1e-6, max_value=policymod.RUNTIME_MAX_LIMIT),
    shared=st.booleans(),
    verbose=st.booleans(),
    command=st.lists(st.text(), min_size=1).filter(lambda c: c[0] != ""),
)
def test_every_valid_request_round_trips(slot, timeout, runtime, shared, verbose, command):
    req = agent.AgentRequest("run", slot, timeout, runtime, shared, verbose, command)
    got = agent.parse_agent_args(agent.render_agent_args(req))
    assert got.slot == slot and got.command == command and got.shared_network == shared and got.verbose == verbose
    for a, b in ((got.timeout, timeout), (got.runtime_max, runtime)):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-9 * max(1.0, b)), (a, b)


# ---------------------------------------------------------------- the caller
def test_caller_comes_from_sudo():
    assert agent.caller_from_env(SUDO_ENV, 0) == agent.Caller("chv", 1000)
    with pytest.raises(agent.Refused, match="runs only as root, through sudo"):
        agent.caller_from_env(SUDO_ENV, 1000)
    with pytest.raises(agent.Refused, match="started only by sudo"):
        agent.caller_from_env({}, 0)  # root running the agent directly
    with pytest.raises(agent.Refused, match="started only by sudo"):
        agent.caller_from_env({"SUDO_UID": "1000"}, 0)
    with pytest.raises(agent.Refused, match="do not name a user"):
        agent.caller_from_env({"SUDO_UID": "x", "SUDO_USER": "chv"}, 0)


def _policy_file(tmp_path, raw_policy, **kw):
    raw_policy.update(kw)
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(raw_policy))
    return str(p)


@pytest.mark.parametrize(
    "args, env, euid, says",
    [
        (["run", "--policy=/x", "--", "true"], SUDO_ENV, 0, "'--policy=/x' is not allowed"),
        (["argv", "--", "true"], SUDO_ENV, 0, "only run, status, read and task"),
        (["run", "--", "true"], {}, 0, "started only by sudo"),
        (["run", "--", "true"], SUDO_ENV, 1000, "runs only as root"),
    ],
)
def test_agent_main_refuses_before_reading_anything(monkeypatch, capsys, args, env, euid, says):
    # the policy path points nowhere: a refusal must come before it is read
    monkeypatch.setattr(policymod, "DEFAULT_POLICY_PATH", "/nonexistent/chv-policy.json")
    assert agent.main(args, env, euid) == 78
    err = capsys.readouterr().err
    assert says in err and "usage: chv-cell run" in err and "cannot read" not in err


def test_agent_main_reads_only_the_installed_policy(monkeypatch, capsys, tmp_path, raw_policy):
    monkeypatch.setattr(policymod, "DEFAULT_POLICY_PATH", "/nonexistent/chv-policy.json")
    assert agent.main(["status"], SUDO_ENV, 0) == 78
    assert "cannot read /nonexistent/chv-policy.json" in capsys.readouterr().err
    # control: the installed policy is read and status answers
    monkeypatch.setattr(policymod, "DEFAULT_POLICY_PATH", _policy_file(tmp_path, raw_policy))
    assert agent.main(["status"], SUDO_ENV, 0) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[0].split()[0] == "slot0" and out.count("idle") == 2


def test_agent_main_shared_network_only_when_the_policy_allows(monkeypatch, capsys, tmp_path, raw_policy):
    started = []
    monkeypatch.setattr(runner.Launcher, "run", lambda self, *a, **kw: started.append((self.caller, kw)) or 0)
    monkeypatch.setattr(policymod, "DEFAULT_POLICY_PATH", _policy_file(tmp_path, raw_policy))
    assert agent.main(["run", "--shared-network", "--", "true"], SUDO_ENV, 0) == 78
    assert "chv_cell_allow_shared_network" in capsys.readouterr().err and not started
    # control: the same request under a policy that allows it reaches the launcher, naming the caller
    monkeypatch.setattr(policymod, "DEFAULT_POLICY_PATH",
                        _policy_file(tmp_path, raw_policy, allow_shared_network=True))
    assert agent.main(["run", "--shared-network", "--slot", "slot1", "--", "true"], SUDO_ENV, 0) == 0
    assert started == [("chv (uid 1000) through sudo",
                        {"slot_name": "slot1", "timeout": None, "shared_network": True, "runtime_max": None})]


# ---------------------------------------------------------------- the wrapper
@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "--", "x"], (False, False, "run", ["--", "x"])),
        (["-v", "--policy", "/p", "run", "--", "x"], (True, True, "run", ["--", "x"])),
        (["--policy=/p", "status"], (False, True, "status", [])),
        (["-h"], None),
        (["--pol", "/p", "run"], None),
        (["-v"], None),
    ],
)
def test_split_top(args, expected):
    assert agent.split_top(args) == expected


class FakeExec(Exception):
    pass


def _fake_exec(calls):
    def execv(path, argv):
        calls.append((path, argv))
        raise FakeExec()
    return execv


def _fake_sudo(tmp_path, allowed):
    """An executable standing in for sudo: `-n -l AGENT` answers as a sudo
    that allows (or refuses) this user."""
    p = tmp_path / "sudo"
    p.write_text("#!/bin/sh\n%s\n" % ("echo \"$3\"; exit 0" if allowed else
                                      "echo 'sudo: a password is required' >&2; exit 1"))
    p.chmod(0o755)
    return str(p)


def test_delegate_execs_sudo_with_the_canonical_arguments(tmp_path, raw_policy):
    calls = []
    sudo = _fake_sudo(tmp_path, True)
    with pytest.raises(FakeExec):
        agent.delegate(True, False, "run", ["--slot=slot1", "--", "sh", "-c", "exit 7"], sudo=sudo,
                       agent="/usr/lib/chv-fleet/chv-cell-agent", execv=_fake_exec(calls))
    assert calls == [(sudo, [sudo, "-n", "/usr/lib/chv-fleet/chv-cell-agent", "run", "--slot", "slot1", "-v", "--",
                             "sh", "-c", "exit 7"])]
    calls.clear()
    with pytest.raises(FakeExec):
        agent.delegate(True, False, "status", [], sudo=sudo, agent="/a", execv=_fake_exec(calls))
    assert calls == [(sudo, [sudo, "-n", "/a", "status"])]


@pytest.mark.parametrize(
    "top, says",
    [
        ((False, True, "run", ["--", "true"]), "--policy is not allowed for a non-root user"),
        ((False, True, "status", []), "--policy is not allowed for a non-root user"),
        ((False, False, "run", ["--policy=/x", "--", "true"]), "'--policy=/x' is not allowed"),
        ((False, False, "run", ["--"]), "needs a command"),
        ((False, False, "status", ["--policy", "x"]), "status takes no arguments"),
        ((False, False, "run", ["--shared-network", "--", "true"]), "chv_cell_allow_shared_network"),
    ],
)
def test_delegate_refuses_up_front(tmp_path, raw_policy, capsys, top, says):
    calls = []
    pol = _policy_file(tmp_path, raw_policy)
    assert agent.delegate(*top, sudo=_fake_sudo(tmp_path, True), agent="/a", policy_path=pol,
                          execv=_fake_exec(calls)) == 78
    assert says in capsys.readouterr().err and calls == []


def test_delegate_shared_network_when_the_policy_allows(tmp_path, raw_policy):
    calls = []
    pol = _policy_file(tmp_path, raw_policy, allow_shared_network=True)
    with pytest.raises(FakeExec):
        agent.delegate(False, False, "run", ["--shared-network", "--", "true"], sudo=_fake_sudo(tmp_path, True),
                       agent="/a", policy_path=pol, execv=_fake_exec(calls))
    assert calls[0][1][3:] == ["run", "--shared-network", "--", "true"]


def test_delegate_not_allowed_names_the_group_variable(tmp_path, capsys):
    calls = []
    assert agent.delegate(False, False, "run", ["--", "true"], sudo=_fake_sudo(tmp_path, False), agent="/a",
                          execv=_fake_exec(calls)) == 78
    err = capsys.readouterr().err
    assert "is not allowed to run cells" in err and "chv_cell_agent_group" in err
    assert "a password is required" in err and calls == []
    assert agent.delegate(False, False, "run", ["--", "true"], sudo=str(tmp_path / "nosudo"), agent="/a",
                          execv=_fake_exec(calls)) == 78
    err = capsys.readouterr().err
    assert "is not installed" in err and "chv_cell_agent_group" in err and calls == []


def test_cli_non_root_run_goes_to_sudo_other_subcommands_do_not(monkeypatch, tmp_path, raw_policy, capsys):
    seen = []
    monkeypatch.setattr(agent, "delegate", lambda *a: seen.append(a) or 42)
    pol = _policy_file(tmp_path, raw_policy)
    assert cli.main(["-v", "run", "--", "true"], euid=1000) == 42
    assert cli.main(["status"], euid=1000) == 42
    assert seen == [(True, False, "run", ["--", "true"]), (False, False, "status", [])]
    # argv and validate-policy only read: no sudo, --policy allowed
    assert cli.main(["--policy", pol, "argv", "--", "true"], euid=1000) == 0
    assert cli.main(["validate-policy", pol], euid=1000) == 0
    assert len(seen) == 2
    # a form the pre-scan does not know (argparse reads -vv as -v) never reaches the launcher as non-root
    monkeypatch.setattr(runner.Launcher, "run", lambda *a, **kw: pytest.fail("launcher reached"))
    assert cli.main(["-vv", "--policy", pol, "run", "--", "true"], euid=1000) == 78
    assert "as a non-root user, run and status take exactly this form" in capsys.readouterr().err
    assert len(seen) == 2


def test_cli_root_is_unchanged(monkeypatch, tmp_path, raw_policy):
    got = []
    monkeypatch.setattr(runner.Launcher, "run", lambda self, cmd, **kw: got.append((self.verbose, cmd, kw)) or 5)
    monkeypatch.setattr(agent, "delegate", lambda *a: pytest.fail("root must not go through sudo"))
    pol = _policy_file(tmp_path, raw_policy)
    assert cli.main(["--policy", pol, "run", "-v", "--slot", "slot0", "--", "true"], euid=0) == 5
    assert got == [(True, ["true"], {"slot_name": "slot0", "timeout": None, "shared_network": False,
                                     "runtime_max": None})]


def test_agent_path_is_next_to_chv_cell():
    assert agent.agent_path() == os.path.join(SRC, "chv-cell-agent")
    assert os.access(agent.agent_path(), os.X_OK)
    with open(agent.agent_path()) as fh:
        assert fh.readline() == "#!/usr/bin/python3 -IS\n"  # isolated, no site: the standard library only


def test_agent_entry_point_refuses_root_without_sudo():
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-I", agent.agent_path(), "run", "--policy", "/x", "--", "true"],
                       capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 78 and "'--policy' is not allowed" in r.stderr
    r = subprocess.run([sys.executable, "-I", agent.agent_path(), "status"], capture_output=True, text=True, env=env,
                       check=False)
    assert r.returncode == 78
    assert ("runs only as root" if os.geteuid() else "started only by sudo") in r.stderr


# ---------------------------------------------------------------- disconnects
def test_hangup_reason():
    assert signals.hangup_reason(1, select.POLLOUT) is None
    assert signals.hangup_reason(1, select.POLLNVAL) is None
    assert "stdout has no reader" in signals.hangup_reason(1, select.POLLERR | select.POLLOUT)
    assert "stderr closed" in signals.hangup_reason(2, select.POLLHUP)


def _launcher(policy, fd):
    la = runner.Launcher(policy, watch_fds=[fd])
    la.install_signals()
    return la


def test_sleep_stops_when_the_pipe_reader_goes_away(policy):
    r, w = os.pipe()
    la = _launcher(policy, w)
    try:
        assert la.sleep(0.05) == []  # control: reader still there
        os.close(r)
        with pytest.raises(errors.Interrupted) as exc:
            la.sleep(5)
        assert exc.value.signum == signal.SIGHUP and "has no reader" in exc.value.reason
    finally:
        la.restore_signals()
        os.close(w)


def test_sleep_stops_when_the_socket_peer_closes(policy):
    a, b = socket.socketpair()
    la = _launcher(policy, b.fileno())
    try:
        a.shutdown(socket.SHUT_WR)  # the peer's EOF alone (stdin ended) is not a hangup
        assert la.sleep(0.05) == []
        a.close()
        with pytest.raises(errors.Interrupted) as exc:
            la.sleep(5)
        assert exc.value.signum == signal.SIGHUP and "closed (POLLHUP)" in exc.value.reason
    finally:
        la.restore_signals()
        b.close()


@pytest.mark.parametrize("target", ["devnull", "file"])
def test_sleep_never_stops_for_a_file_or_dev_null(policy, tmp_path, target):
    path = os.devnull if target == "devnull" else str(tmp_path / "out")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    la = _launcher(policy, fd)
    try:
        assert la.sleep(0.1) == []
    finally:
        la.restore_signals()
        os.close(fd)


def test_sleep_still_returns_ready_fds(policy):
    r, w = os.pipe()
    r2, w2 = os.pipe()
    la = _launcher(policy, w2)
    try:
        os.write(w, b"x")
        assert la.sleep(5, [r]) == [r]
    finally:
        la.restore_signals()
        for fd in (r, w, r2, w2):
            os.close(fd)


def test_hangup_watch_fds_skips_closed_fds():
    r, w = os.pipe()
    os.close(w)
    assert signals.hangup_watch_fds((r, w)) == [r]
    os.close(r)


# ---------------------------------------------------------------- alias mount points
def test_alias_mount_point_created_beneath_without_following_symlinks(tmp_path):
    base = tmp_path / "state"
    base.mkdir()
    fsutil.ensure_dir_beneath(str(base), ["a", "b"], 0o755, os.getuid())
    assert (base / "a" / "b").is_dir() and (base / "a").stat().st_mode & 0o777 == 0o755
    fsutil.ensure_dir_beneath(str(base), ["a", "b"], 0o755, os.getuid())  # existing: fine
    # a symlink planted where the mount point goes is refused, and nothing is created at its target
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "ws").symlink_to(outside)
    with pytest.raises(errors.SetupError, match="is a symlink or not a directory"):
        fsutil.ensure_dir_beneath(str(base), ["ws", "x"], 0o755, os.getuid())
    assert list(outside.iterdir()) == []
    (base / "f").write_text("")
    with pytest.raises(errors.SetupError, match="f .mount point of a workspace alias. is a symlink"):
        fsutil.ensure_dir_beneath(str(base), ["f"], 0o755, os.getuid())
