"""Tasks in real cells (docs/executor.md "Tasks"), as the executor runs
them: a plain user of the agent group, through sudo.  A task's turns share
its home and workspace; its end leaves nothing for the next task in the
slot; only its owner may use it; an abandoned task expires.  Every refusal
runs beside a control whose cell really started (an exit of 125 is no
pass).  Uses test_cells_real's throwaway policy, slots and accounts."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from cellrt import ENTRY, NEEDS_REAL_CELLS
from test_cells_real import AGENT_KEYS, _sh, as_user, end_session, env, sudo_env, user_run  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cells] + NEEDS_REAL_CELLS

ALIASES = AGENT_KEYS["workspace_aliases"]


@pytest.fixture(scope="module")
def second(sudo_env):  # noqa: F811
    """The other account, a member of the agent group for this module: a
    second executor user."""
    s = sudo_env
    _sh("usermod", "-a", "-G", s["group"], s["other"])
    yield s["other"]
    subprocess.run(["gpasswd", "-d", s["other"], s["group"]], capture_output=True, check=False)


def task(user, s, *args, expect=0):
    r = user_run(user, [s["chv_cell"], "task", *args])
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout) if expect == 0 else r


def turn(user, s, task_id, script, expect=0):
    r = user_run(user, [s["chv_cell"], "run", "--task", task_id, "--", "sh", "-c", script])
    assert r.returncode == expect, (script, r.returncode, r.stdout, r.stderr)
    return r


def records(s):
    d = os.path.join(s["pol"]["state_dir"], "tasks")
    return sorted(n for n in os.listdir(d) if n.endswith(".json")) if os.path.isdir(d) else []


def slot_dirs(s, name):
    return (os.path.join(s["pol"]["workspace_root"], name), os.path.join(s["pol"]["agent_state_root"], name))


# lists what the agent can see of its home and workspace, the workspace
# alias's mount point excepted
LOOK = ("find /home/chv /workspace /tmp -mindepth 1 %s | sort; echo end"
        % " ".join("-not -path '%s' -not -path '%s/*'" % (a, a) for a in ALIASES))


def test_turns_share_state_and_the_end_leaves_nothing(env, sudo_env):  # noqa: F811
    s = sudo_env
    m = s["member"]
    outside = "/run/chv-tasktest-%d" % os.getpid()
    os.mkdir(outside, 0o755)
    with open(os.path.join(outside, "keep"), "w") as fh:
        fh.write("host\n")
    try:
        t = task(m, s, "start")
        assert set(t) >= {"task", "slot", "home", "workspace", "expires"}
        assert t["home"] == "/home/chv" and t["workspace"] == "/workspace"
        assert len(records(s)) == 1 and stat_mode(os.path.join(s["pol"]["state_dir"], "tasks")) == 0o700
        turn(m, s, t["task"], "mkdir -p /home/chv/.codex && echo s1 > /home/chv/.codex/state && echo w > /workspace/w "
             "&& echo t > /tmp/t && ln -s %s /home/chv/out && ln -s %s/keep /workspace/k && mkfifo /workspace/fifo"
             % (outside, outside))
        r = turn(m, s, t["task"], "cat /home/chv/.codex/state /workspace/w; cat /tmp/t 2>/dev/null || echo no-tmp")
        assert r.stdout == "s1\nw\nno-tmp\n"  # home and workspace carry over; /tmp is each cell's own
        # the task's slot is given to no plain run (claim_timeout 0: busy at once) ...
        r = user_run(m, [s["chv_cell"], "run", "--slot", t["slot"], "--", "true"])
        assert r.returncode == 75, r.stderr
        # ... control: the other slot runs one (the refusal is not a broken launcher)
        other = next(x["name"] for x in s["pol"]["slots"] if x["name"] != t["slot"])
        assert user_run(m, [s["chv_cell"], "run", "--slot", other, "--", "true"]).returncode == 0
        ended = task(m, s, "end", t["task"])
        assert ended == {"task": t["task"], "slot": t["slot"], "ended": True}
        assert records(s) == []
        for d in slot_dirs(s, t["slot"]):
            assert os.listdir(d) == [], d
        # what the links pointed to is untouched
        assert os.listdir(outside) == ["keep"]
        with open(os.path.join(outside, "keep")) as fh:
            assert fh.read() == "host\n"
        # the next task gets the same slot, and sees nothing of the first
        t2 = task(m, s, "start")
        assert t2["slot"] == t["slot"] and t2["task"] != t["task"]
        r = turn(m, s, t2["task"], LOOK + "; echo $HOME")
        assert r.stdout == "end\n/home/chv\n"
        task(m, s, "end", t2["task"])
        # the ended task is no task any more
        r = turn(m, s, t["task"], "true", expect=67)
        assert "task %s" % t["task"] in r.stderr
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def stat_mode(path):
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def test_only_the_owner_uses_or_ends_a_task(env, sudo_env, second):  # noqa: F811
    s = sudo_env
    m = s["member"]
    t = task(m, s, "start")
    try:
        turn(m, s, t["task"], "echo mine > /home/chv/m")
        # the other executor user: refused, as for a task that does not exist (67), its cell never started
        r = turn(second, s, t["task"], "cat /home/chv/m", expect=67)
        assert "task %s: no such task of yours" % t["task"] in r.stderr and r.stdout == ""
        r = task(second, s, "end", t["task"], expect=67)
        r = user_run(second, [s["chv_cell"], "read", "--slot", t["slot"], "/home/chv/m"])
        assert r.returncode == 67 and r.stdout == "", r.stderr
        r = user_run(m, [s["chv_cell"], "read", "--slot", t["slot"], "/home/chv/m"])  # control
        assert r.returncode == 0 and r.stdout == "mine\n", r.stderr
        assert [x["task"] for x in task(second, s, "list")] == []
        assert [x["task"] for x in task(m, s, "list")] == [t["task"]]
        # control: the other user's own task runs a real cell, in the other slot, without the owner's file
        o = task(second, s, "start")
        assert o["slot"] != t["slot"]
        assert turn(second, s, o["task"], "cat /home/chv/m 2>/dev/null || echo absent").stdout == "absent\n"
        task(second, s, "end", o["task"])
        # and the owner's task is intact
        assert turn(m, s, t["task"], "cat /home/chv/m").stdout == "mine\n"
    finally:
        task(m, s, "end", t["task"])
    assert records(s) == []


def test_an_abandoned_task_expires(env, sudo_env):  # noqa: F811
    s = sudo_env
    m = s["member"]
    gone = task(m, s, "start", "--ttl", "2")
    kept = task(m, s, "start", "--ttl", "120")
    turn(m, s, gone["task"], "echo x > /workspace/x")
    turn(m, s, kept["task"], "echo y > /workspace/y")
    time.sleep(3)
    # control: the task used within its TTL runs its turn in a real cell
    assert turn(m, s, kept["task"], "cat /workspace/y").stdout == "y\n"
    r = turn(m, s, gone["task"], "cat /workspace/x", expect=68)
    assert "task %s: expired" % gone["task"] in r.stderr and r.stdout == ""
    assert os.listdir(slot_dirs(s, gone["slot"])[0]) == []
    assert [x["task"] for x in task(m, s, "list")] == [kept["task"]]
    # the timer's reap (root): an expired task whose executor never came back
    third = task(m, s, "start", "--ttl", "1")
    assert third["slot"] == gone["slot"]  # the expired task's slot is free again
    turn(m, s, third["task"], "echo z > /home/chv/z")
    time.sleep(2)
    r = subprocess.run([sys.executable, "-I", ENTRY, "--policy", s["policy"], "task", "reap"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and json.loads(r.stdout) == {"reaped": [third["task"]]}, r.stderr
    assert os.listdir(slot_dirs(s, third["slot"])[1]) == []
    task(m, s, "end", kept["task"])
    assert records(s) == []


def test_the_agent_refuses_every_other_task_form(env, sudo_env):  # noqa: F811
    s = sudo_env
    m = s["member"]
    bad = [["task", "reap"], ["task", "start", "--policy", env["policy"]], ["--policy", env["policy"], "task", "list"],
           ["task", "end", "../../etc/passwd"], ["task", "start", "--ttl", "0"], ["task", "list", "--all"],
           ["run", "--task", "0" * 32, "--slot", "slot0", "--", "true"], ["task"]]
    for args in bad:
        for argv in ([s["chv_cell"], *args], ["sudo", "-n", s["agent"], *args]):
            r = user_run(m, argv)
            assert r.returncode == 78 and r.stdout == "", (argv, r.returncode, r.stderr)
            assert r.stderr.startswith("chv-cell: "), (argv, r.stderr)
    assert records(s) == []
    # control: the allowed forms, straight at the agent too, start and end a task whose turn runs a real cell
    r = user_run(m, ["sudo", "-n", s["agent"], "task", "start", "--ttl", "60"])
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    assert turn(m, s, t["task"], "echo ran").stdout == "ran\n"
    assert user_run(m, ["sudo", "-n", s["agent"], "task", "end", t["task"]]).returncode == 0
    assert records(s) == []


def test_a_task_whose_executor_hung_up_mid_turn_is_reclaimed_after_its_ttl(env, sudo_env):  # noqa: F811
    """The executor's SSH connection drops during a turn (sshd closes the
    session's pipes): the turn's cell stops (129), the task stays until its
    TTL passes, then any task command reclaims it: record, slot, files."""
    s = sudo_env
    m = s["member"]
    t = task(m, s, "start", "--ttl", "3")
    turn(m, s, t["task"], "echo kept > /workspace/partial")
    keep, give = os.pipe()  # the session's stdout: the test holds its only reader
    p = as_user(m, [s["chv_cell"], "run", "--task", t["task"], "--", "sh", "-c", "echo started; sleep 60"],
                stdin=subprocess.DEVNULL, stdout=give, stderr=subprocess.PIPE)
    os.close(give)
    try:
        with os.fdopen(os.dup(keep)) as fh:
            assert fh.readline() == "started\n"  # the turn's payload really ran
        os.close(keep)
        keep = None  # the connection is gone
        p.wait(timeout=s["pol"]["stop_grace"] + 15)
    finally:
        end_session(keep, p)
    assert p.returncode == 129, p.stderr.read()
    # within its TTL the task is still there (the executor may come back) ...
    assert [x["task"] for x in task(m, s, "list")] == [t["task"]]
    assert os.listdir(slot_dirs(s, t["slot"])[0]) == ["partial"]
    time.sleep(4)
    # ... after it, the next task command of anyone reclaims it
    assert task(m, s, "list") == [] and records(s) == []
    for d in slot_dirs(s, t["slot"]):
        assert os.listdir(d) == [], d
    r = turn(m, s, t["task"], "true", expect=68)
    assert "expired" in r.stderr
    r = user_run(m, [s["chv_cell"], "run", "--slot", t["slot"], "--", "echo", "free"])  # the slot is free again
    assert r.returncode == 0 and r.stdout == "free\n", r.stderr
