"""Per-task and per-turn variables (chv_guest/cell/taskenv.py): the lines
the launcher reads, the policy's env_allow, the start gate that hands them
to the payload (the real in-cell shell script, on a real FIFO), a task's
kept variables beside its record, and the sudo wrapper's fd."""

import os
import subprocess
import time

import pytest

from chv_guest.cell import actions, agent, exits, taskenv, taskrec, tasks
from chv_guest.cell import argv as argvmod
from chv_guest.cell import policy as policymod

SECRET = "sk-test-9f8e7d $(id) `id` 'q' \"z\" \\n ;|&"


def pipe_with(data):
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return r


# ---------------------------------------------------------------- reading and parsing
def test_read_stops_at_the_empty_line_and_leaves_the_rest():
    r = pipe_with(b"A=1\nB=x y\n\npayload input\n")
    try:
        assert taskenv.read_env(r) == b"A=1\nB=x y\n\n"
        assert os.read(r, 100) == b"payload input\n"  # stdin's rest stays the payload's
    finally:
        os.close(r)
    for data, got in ((b"\nrest", b"\n"), (b"A=1", b"A=1"), (b"", b"")):
        r = pipe_with(data)
        assert taskenv.read_env(r) == got
        os.close(r)


def test_read_is_bounded():
    r = pipe_with(b"A=" + b"x" * 200 + b"\n\n")
    with pytest.raises(taskenv.EnvRefused, match="more than 100 bytes"):
        taskenv.read_env(r, limit=100)
    os.close(r)
    with pytest.raises(taskenv.EnvRefused, match="cannot be read"):
        taskenv.read_env(987)


def test_parse_keeps_allowed_names_and_refuses_any_other_without_its_value():
    assert taskenv.parse_env(("API_KEY=%s\nTASK_MODE=fast\n\nIGNORED=1\n" % SECRET).encode(),
                             ["API_KEY", "TASK_MODE"]) == {"API_KEY": SECRET, "TASK_MODE": "fast"}
    assert taskenv.parse_env(b"", ["A"]) == {}
    for data, says in ((("OTHER=%s\n" % SECRET).encode(), "OTHER may not be passed"),
                       (b"API_KEY=1\nAPI_KEY=2\n", "given twice"),
                       (("just-a-secret %s\n" % SECRET).encode(), "line 1 of the variables is not NAME=VALUE"),
                       (b"1A=x\n", "not NAME=VALUE"),
                       (b"API_KEY=a\0b\n", "NUL"),
                       (b"API_KEY=\xff\n", "not UTF-8")):
        with pytest.raises(taskenv.EnvRefused) as exc:
            taskenv.parse_env(data, ["API_KEY"])
        assert says in str(exc.value) and SECRET not in str(exc.value)


def test_policy_env_allow_is_validated(raw_policy):
    assert policymod.validate(dict(raw_policy, env_allow=["OPENAI_API_KEY", "TASK_MODE"])) == []  # control
    for allow, says in ((["HOME"], "HOME is set by the launcher"), (["CHV_SLOT"], "set by the launcher"),
                        (["chv_v"], "the launcher's"), (["Chv_X"], "the launcher's"), (["A-B"], "not an environment"),
                        (["A", "A"], "listed twice"), ("A", "must be a list")):
        errors = policymod.validate(dict(raw_policy, env_allow=allow))
        assert any(says in e for e in errors), (allow, errors)
    errors = policymod.validate(dict(raw_policy, env_allow=["MODE"], setenv={"MODE": "x"}))
    assert any("also set by setenv" in e for e in errors)
    assert policymod.merged(dict(raw_policy))["env_allow"] == []


# ---------------------------------------------------------------- the start gate (the real shell script)
def run_gate(tmp_path, message, close_early=False):
    """The cell's pid 2 script on a FIFO of its own, its payload printing its
    environment and its fds; the launcher's side writes ``message`` (and,
    with ``close_early``, dies once the script has the FIFO open)."""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate, 0o600)
    fd = os.open(gate, os.O_RDWR)
    os.write(fd, message)
    p = subprocess.Popen(["/bin/sh", "-c", argvmod.gate_script(gate), "chv-gate", "/bin/sh", "-c",
                          "/usr/bin/env -0; ls /proc/self/fd >&2"],
                         env={"KEEP": "k"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if close_early:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:  # the script holds the FIFO as fd 3
            try:
                if os.readlink("/proc/%d/fd/3" % p.pid) == gate:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        os.close(fd)
    try:
        out, err = p.communicate(timeout=10)
    finally:
        if not close_early:
            os.close(fd)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def environ_of(out):
    return dict(x.split("=", 1) for x in out.decode().split("\0") if x)


def test_the_gate_exports_exactly_the_passed_variables(tmp_path):
    r = run_gate(tmp_path, taskenv.gate_message({"API_KEY": SECRET, "TASK_MODE": "a=b"}))
    assert r.returncode == 0, r.stderr
    env = environ_of(r.stdout)
    assert env["API_KEY"] == SECRET and env["TASK_MODE"] == "a=b" and env["KEEP"] == "k"
    assert not any(k.startswith("chv_") for k in env)  # the script's own variables stay its own
    assert sorted(r.stderr.decode().split()) == ["0", "1", "2", "3"]  # the FIFO is no fd of the payload (3: ls's own dir)
    # control: without variables the payload starts the same, with none of them
    sub = tmp_path / "none"
    sub.mkdir()
    r = run_gate(sub, taskenv.gate_message({}))
    assert r.returncode == 0 and "API_KEY" not in environ_of(r.stdout) and environ_of(r.stdout)["KEEP"] == "k"


def test_the_gate_never_starts_the_payload_without_the_closing_line(tmp_path):
    # the launcher died after "go" and a variable, before the empty line: EOF, no payload
    r = run_gate(tmp_path, b"go\nAPI_KEY=x\n", close_early=True)
    assert r.returncode == 125 and r.stdout == b"" and b"start gate closed" in r.stderr
    sub = tmp_path / "nogo"
    sub.mkdir()
    r = run_gate(sub, b"stop\n\n", close_early=True)
    assert r.returncode == 125 and r.stdout == b""


def test_the_nspawn_argv_never_holds_a_value(policy):
    facts = argvmod.HostFacts(scope="standalone", existing=frozenset(), shared_network=False)
    a = argvmod.build_argv(policy, policy["slots"][0], ["true"], facts)
    assert a[a.index("--") + 1:a.index("--") + 4] == ["/bin/sh", "-c", argvmod.GATE_SCRIPT]
    assert not any("API_KEY" in x for x in a)  # nothing of taskenv reaches the command line


# ---------------------------------------------------------------- runs and tasks
@pytest.fixture
def pol(task_policy):
    p = task_policy
    p["env_allow"] = ["API_KEY", "TASK_MODE"]
    return p


def test_a_run_refuses_a_name_not_allowed_beside_an_allowed_control(pol, monkeypatch, capsys):
    started = []

    class FakeLauncher:
        status_fd = None
        env = None

        def run(self, command, **kw):
            started.append(dict(self.env))
            return 0

    monkeypatch.setattr(actions, "launcher_for", lambda *a, **k: FakeLauncher())
    r = pipe_with(("API_KEY=%s\n\n" % SECRET).encode())
    assert actions.start_run(pol, ["true"], None, None, False, None, None, env_fd=r) == 0
    assert started == [{"API_KEY": SECRET}]
    r = pipe_with(("API_KEY=%s\nOTHER=1\n\n" % SECRET).encode())
    assert actions.start_run(pol, ["true"], None, None, False, None, None, env_fd=r) == exits.EXIT_CONFIG
    assert len(started) == 1  # nothing started
    err = capsys.readouterr().err
    assert "OTHER may not be passed" in err and SECRET not in err


def test_a_task_keeps_its_variables_outside_the_slot_until_its_end(pol, monkeypatch):
    monkeypatch.setattr(tasks, "empty_slot", lambda p, s: None)
    r = pipe_with(b"API_KEY=task-wide\nTASK_MODE=slow\n\n")
    out = []
    assert tasks.command(pol, "start", 1000, env_fd=r, out=out.append) == 0
    tid = __import__("json").loads(out[0])["task"]
    kept = taskenv.task_env_path(taskrec.tasks_dir(pol), tid)
    assert oct(os.stat(kept).st_mode & 0o777) == "0o600" and not kept.startswith(pol["workspace_root"])
    assert "task-wide" not in out[0]  # never printed
    # a turn: the task's variables, the turn's own over them
    got = actions.read_env(pol, pipe_with(b"TASK_MODE=fast\n\n"), taskenv.load_task_env(taskrec.tasks_dir(pol), tid))
    assert got == {"API_KEY": "task-wide", "TASK_MODE": "fast"}
    # a name the policy dropped since the start: refused at the turn
    with pytest.raises(taskenv.EnvRefused, match="no longer in the policy"):
        actions.read_env(dict(pol, env_allow=["TASK_MODE"]), None, {"API_KEY": "task-wide"})
    assert tasks.command(pol, "end", 1000, task_id=tid, out=out.append) == 0
    assert not os.path.exists(kept) and taskenv.load_task_env(taskrec.tasks_dir(pol), tid) == {}


def test_task_start_refuses_a_name_not_allowed(pol, monkeypatch, capsys):
    monkeypatch.setattr(tasks, "empty_slot", lambda p, s: None)
    out = []
    assert tasks.command(pol, "start", 1000, env_fd=pipe_with(b"OTHER=1\n\n"), out=out.append) == exits.EXIT_CONFIG
    assert out == [] and taskrec.all_records(pol) == []
    assert tasks.command(pol, "start", 1000, env_fd=pipe_with(b"API_KEY=1\n\n"), out=out.append) == 0  # control
    assert len(taskrec.all_records(pol)) == 1


def test_sudo_keeps_the_env_fd_open():
    assert agent.sudo_argv("/a", ["run"], "/s", None, 0) == ["/s", "-n", "/a", "run"]  # stdin: nothing to keep
    assert agent.sudo_argv("/a", ["run"], "/s", 3, 7) == ["/s", "-n", "-C", "8", "/a", "run"]
    assert agent.sudo_argv("/a", ["run"], "/s", 9, 4) == ["/s", "-n", "-C", "10", "/a", "run"]
