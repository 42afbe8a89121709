"""The executor's path: over SSH as the agent user (not root), on a guest where
that user existed with a login shell before the first converge (the lab
creates it), `chv-cell run -- python3 /app/host.py ...` works unmodified.

The SSH client is the lab host's own `ssh`, as an executor's would be.
`/app/host.py` is a stand-in agent host this module installs on the guest
(and removes afterwards).
"""

import json
import shlex
import subprocess
import time

import pytest

from conftest import OutsideHTTP, guest_ssh, html, lab_guest, over_ssh

AGENT = "chv"
HOME = "/home/chv"
OUT_PORT = 18710
HOST_PY = r"""
import argparse, json, os, subprocess, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--state"); ap.add_argument("--codex-home"); ap.add_argument("--exit", type=int, default=0)
ap.add_argument("--hold", type=float, default=0); ap.add_argument("--url"); ap.add_argument("--mark")
a = ap.parse_args()
os.makedirs(a.codex_home, exist_ok=True)
if a.mark:
    open(os.path.join(a.codex_home, a.mark), "w").write(a.mark)
time.sleep(a.hold)
client = "/usr/lib/chv-fleet/chv_guest/broker/client.py"
def broker(req):
    r = subprocess.run([sys.executable, client, json.dumps(req)], capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"rc": r.returncode, "err": r.stderr}
state = {"slot": os.environ.get("CHV_SLOT"), "home": os.environ.get("HOME"), "user": os.environ.get("USER"),
         "cwd": os.getcwd(), "codex": sorted(os.listdir(a.codex_home)), "stdin": sys.stdin.readline().strip(),
         "ping": broker({"op": "ping"})}
if a.url:
    opened = broker({"op": "browser", "action": "open", "url": a.url})
    state["title"] = (opened.get("result") or {}).get("title")
json.dump(state, open(a.state, "w"))
os.makedirs(os.path.expanduser("~/workspace"), exist_ok=True)
open(os.path.expanduser("~/workspace/result.txt"), "w").write("done by %s\n" % state["slot"])
print(json.dumps(state)); print("to stderr", file=sys.stderr)
sys.exit(a.exit)
"""


@pytest.fixture(scope="module")
def executor(host):
    guest = lab_guest(host)
    outside = OutsideHTTP(guest["host_address"], OUT_PORT, {"/": (200, {}, html("Executor page", "<h1>hi</h1>"), 0)})
    with host.sudo():
        host.run_expect([0], "install -d -m 0755 /app && cat > /app/host.py <<'EOF'\n%s\nEOF\nchmod 0644 /app/host.py" % HOST_PY)
    yield {"ssh": guest_ssh(host, AGENT), "url": outside.url + "/"}
    outside.close()
    with host.sudo():
        host.run("rm -rf /app")


def host_py(*extra):
    return ("chv-cell run -- python3 /app/host.py --state %s/.codex/host-state.json --codex-home %s/.codex %s"
            % (HOME, HOME, " ".join(shlex.quote(e) for e in extra)))


def test_the_agent_user_is_left_as_it_was(host):
    # the lab created it before the first converge: login shell, its own group only
    entry = host.check_output("getent passwd %s", AGENT).split(":")
    assert entry[5:] == [HOME, "/bin/bash"], entry
    assert host.check_output("id -Gn %s", AGENT) == AGENT


def test_host_py_runs_unmodified_over_ssh(host, executor):
    r = over_ssh(executor["ssh"], host_py("--exit", "7", "--url", executor["url"]), stdin="hello from the executor\n")
    assert r.returncode == 7, (r.returncode, r.stdout, r.stderr)   # the payload's own code came back
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert "to stderr" in r.stderr                                  # streams stay apart without a tty
    assert state["home"] == HOME and state["user"] == AGENT and state["stdin"] == "hello from the executor"
    assert state["ping"] == {"ok": True, "result": {"pong": True, "slot": state["slot"]}}, state
    assert state["title"] == "Executor page"
    # results reach the agent user outside the cell through chv-cell read, as docs/executor.md says; the
    # slot directories themselves are the slot's own (a plain cat is denied)
    slot = state["slot"]
    ssh = executor["ssh"]
    saved = json.loads(over_ssh(ssh, "chv-cell read --slot %s %s/.codex/host-state.json" % (slot, HOME)).stdout)
    assert saved["slot"] == slot
    assert over_ssh(ssh, "chv-cell read --slot %s /workspace/result.txt" % slot).stdout == "done by %s\n" % slot
    denied = over_ssh(executor["ssh"], "cat /var/lib/chv-fleet/workspaces/%s/result.txt" % slot)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def test_with_a_tty_the_exit_code_still_comes_back(host, executor):
    r = over_ssh(executor["ssh"], host_py("--exit", "5"), tty=True, stdin="typed\n")
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert '"user": "chv"' in r.stdout


def test_two_runs_at_once_get_two_slots_and_only_their_own_state(host, executor):
    runs = [subprocess.Popen(executor["ssh"] + [host_py("--hold", "3", "--mark", mark)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mark in ("first", "second")]
    states = []
    for proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (out, err)
        states.append(json.loads(out.strip().splitlines()[-1]))
    assert states[0]["slot"] != states[1]["slot"]
    for state, mine, theirs in ((states[0], "first", "second"), (states[1], "second", "first")):
        assert mine in state["codex"] and theirs not in state["codex"], state


@pytest.mark.parametrize("command, says", [
    ("chv-cell --policy /tmp/x.json run -- true", "--policy"),
    ("chv-cell run --shared-network -- true", "chv_cell_allow_shared_network"),
    ("sudo -n /usr/lib/chv-fleet/chv-cell-agent argv -- true", "run"),
    ("sudo -n /usr/lib/chv-fleet/chv-cell-agent run --policy=/tmp/x.json -- true", "--policy"),
])
def test_the_way_in_refuses_anything_but_run_and_status(host, executor, command, says):
    r = over_ssh(executor["ssh"], command)
    assert r.returncode == 78 and says in r.stderr, (r.returncode, r.stdout, r.stderr)


def test_sudo_allows_the_launcher_and_nothing_broader(host, executor):
    control = over_ssh(executor["ssh"], "chv-cell status")
    assert control.returncode == 0 and "slot0" in control.stdout, control
    assert over_ssh(executor["ssh"], "sudo -n /bin/true").returncode != 0
    assert over_ssh(executor["ssh"], "sudo -n /usr/lib/chv-fleet/chv-cell run -- true").returncode != 0
    listed = over_ssh(executor["ssh"], "sudo -n -l").stdout
    commands = [line.strip() for line in listed.splitlines() if line.strip().startswith("(root)")]
    assert commands == ["(root) NOPASSWD: /usr/lib/chv-fleet/chv-cell-agent"], listed


def test_a_dropped_ssh_connection_frees_the_slot(host, executor):
    with host.sudo():
        policy = json.loads(host.file("/etc/chv-fleet/cell-policy.json").content_string)
    slot = policy["slots"][0]
    proc = subprocess.Popen(executor["ssh"] + ["chv-cell run --slot %s -- sleep 120" % slot["name"]],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        record = "/run/chv-fleet/cells/%s.json" % slot["name"]
        with host.sudo():
            host.run_expect([0], "for i in $(seq 150); do test -s %s && exit 0; sleep 0.1; done; exit 1", record)
        proc.kill()                      # the executor's ssh dies: no tty, so no SIGHUP reaches the guest
        proc.wait()
        deadline = time.monotonic() + policy["stop_grace"] + 10
        with host.sudo():
            while time.monotonic() < deadline and host.file(record).exists:
                time.sleep(0.2)
            assert not host.file(record).exists
            assert "idle" in host.check_output("chv-cell status | grep '^%s '", slot["name"])
            assert host.run("ip link show %s", slot["host_ifname"]).rc != 0
            assert not host.file("/run/chv-fleet/locks/%s.lock" % slot["name"]).exists
    finally:
        proc.kill()
