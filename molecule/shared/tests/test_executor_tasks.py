"""Issue 31's tasks as an executor drives them: over SSH as the agent user,
with the lab host's own ssh (docs/executor.md "Tasks"), against a real git
server with authentication (tests/helpers/gitserver.py: lighttpd and
`git http-backend`, bound to the guest's gateway on the lab host, port
18446, allowed to sync by molecule/shared/converge.yml) and a stand-in
model endpoint beside it that the agent calls over the cell's egress.
The agent is tests/probes/agent_host.py as /app/host.py, run with the
design contract's arguments.

The guest's credential for the server is a line the test adds to the
guest's credential file (the broker's sync.credentials_file) for its run,
over root's SSH on stdin: a secret never travels on a command line here
(Ansible's module arguments land in the guest's journal, which the test
searches). Runs once, on the fleet's canary."""

import hashlib
import io
import json
import os
import secrets
import shlex
import subprocess
import tarfile
import tempfile
import time

import pytest

import gitserver
from conftest import guest_ssh, lab_guest, only_in, over_ssh
from tasks_at_once import assert_each_on_its_own_branch, two_turns_each
from testpaths import PROBES

pytestmark = only_in("fleet")

AGENT = "chv"
GIT_PORT, MODEL_PORT = 18446, 18447
CLIENT = "/usr/lib/chv-fleet/chv_guest/broker/client.py"
HOST_PY = ("python3 /app/host.py --state /home/chv/.codex/host-state.json --codex-home /home/chv/.codex "
           "--sandbox danger-full-access")
# what a cell of a fresh task sees of earlier ones: HOME (but the workspace's link), the workspace, /tmp, the
# screenshots, and its browser context
LOOK = ("find /home/chv /workspace /tmp /run/chv/shots -mindepth 1 -not -path /home/chv/workspace "
        "-not -path '/home/chv/workspace/*' | sort; echo end; python3 %s '{\"op\": \"browser\", \"action\": "
        "\"snapshot\"}'" % CLIENT)
# the needles come on stdin, one "label value" a line (never on a command line). One pass over every regular file
# the cell can read (all of its file system; no device, FIFO or socket) and every process environment of the
# cell finds the files holding any of them; a second pass over those files says which holds which (the first
# pass's list, then "== label" and its files for each)
SCAN = ("pairs=$(cat); values=$(printf '%s\\n' \"$pairs\" | cut -d' ' -f2); "
        "hits=$(printf '%s\\n' \"$values\" | grep -rlF --devices=skip --exclude-dir=proc --exclude-dir=sys -f - / "
        "2>/dev/null; printf '%s\\n' \"$values\" | grep -lF -f - /proc/[0-9]*/environ 2>/dev/null); echo \"$hits\"; "
        "printf '%s\\n' \"$pairs\" | while read -r label value; do echo \"== $label\"; "
        "test -z \"$hits\" || printf '%s\\n' \"$value\" | grep -lF -f - $hits 2>/dev/null; done; echo '== end'")


def sha(value):
    return hashlib.sha256(value.encode()).hexdigest()


def env_lines(variables):
    return "".join("%s=%s\n" % kv for kv in variables.items()) + "\n"


@pytest.fixture(scope="module")
def lab(host):
    why = gitserver.available()
    if why:
        pytest.skip(why)
    guest = lab_guest(host)
    root = guest_ssh(host, "root")
    # the guest's configuration, over the same SSH as the rest (an Ansible round trip costs seconds)
    policy, broker = (json.loads(over_ssh(root, "cat /etc/chv-fleet/%s.json" % name).stdout)
                      for name in ("cell-policy", "broker"))
    credentials = broker["sync"]["credentials_file"]
    server = gitserver.GitServer(address=guest["host_address"], port=GIT_PORT, model_port=MODEL_PORT)
    token = "mt-" + secrets.token_hex(20)
    saved = credentials + ".executor-tasks"
    try:
        server.start()
        endpoint = server.start_model(token)
        page = os.path.join(server.root, "docroot", "page.html")  # served without authentication (not under /git)
        with open(page, "w") as fh:
            fh.write("<!doctype html><title>Task page</title><h1>a page of the task</h1>")
        os.chmod(page, 0o644)
        with open(os.path.join(PROBES, "agent_host.py")) as fh:
            agent_host = fh.read()
        for command, stdin in (("install -d -m 0755 /app && cat > /app/host.py && chmod 0644 /app/host.py", agent_host),
                               # the guest's credential file gains the server's line (kept as it was beside it)
                               ("cp -p {0} {1} && {{ cat {1}; [ -z \"$(tail -c1 {1})\" ] || echo; cat; }} > {0}"
                                .format(credentials, saved), server.credential_line())):
            r = over_ssh(root, command, stdin=stdin)
            assert r.returncode == 0, r.stderr
        yield {"server": server, "token": token, "endpoint": endpoint, "agent": guest_ssh(host, AGENT), "root": root,
               "policy": policy, "page": "http://%s:%d/page.html" % (guest["host_address"], GIT_PORT)}
    finally:
        over_ssh(root, "test ! -e {1} || mv -f {1} {0}; rm -rf /app".format(credentials, saved))
        server.stop()


def task(lab, args, stdin="", expect=0):
    r = over_ssh(lab["agent"], "chv-cell task " + args, stdin=stdin)
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout) if expect == 0 else r


def run(lab, task_id, command, stdin="", env=None, expect=0):
    r = over_ssh(lab["agent"], "chv-cell run --task %s%s -- %s" % (task_id, " --env-fd 0" if env else "", command),
                 stdin=(env_lines(env) if env else "") + stdin, timeout=180)
    assert r.returncode == expect, (command, r.returncode, r.stdout, r.stderr[-3000:])
    return r


def agent_turn(lab, task_id, env=None, extra=""):
    """One turn of the stand-in agent: its JSON line."""
    return json.loads(run(lab, task_id, HOST_PY + extra, env=env).stdout.splitlines()[-1])


def export(lab, task_id, *paths):
    r = over_ssh(lab["agent"], "chv-cell task export %s -- %s" % (task_id, " ".join(paths)), stdin=b"", text=False)
    assert r.returncode == 0, r.stderr
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        return {m.name: tar.extractfile(m).read().decode("latin-1") for m in tar.getmembers() if m.isfile()}


def slot_left(lab, slot):
    """What the guest holds of a slot (root, outside every cell): its workspace, agent state and screenshots (a
    directory made at the slot's first screenshot), then chv-cell status."""
    r = over_ssh(lab["root"], "find /var/lib/chv-fleet/workspaces/{0} /var/lib/chv-fleet/agent-state/{0} -mindepth 1 "
                              "2>&1; test ! -e /run/chv-shots/{0} || find /run/chv-shots/{0} -mindepth 1 2>&1; "
                              "chv-cell status".format(slot))
    return r.stdout


@pytest.fixture(scope="module")
def first_task(lab):
    """Issue 31's first Must show, run once: the task from its start to its end, then the next task in the same
    slot. What it saw is returned for the tests (the second test reads the same run's process list, files and
    journal)."""
    server, out = lab["server"], {}
    first = server.commits[0]
    since = over_ssh(lab["root"], "date +%s").stdout.strip()
    # the guest's process list, sampled from the task's start to the end of its first turn (into a file: a pipe
    # nobody reads would stall the sampling)
    samples = tempfile.TemporaryFile(mode="w+")
    sampler = subprocess.Popen(lab["root"] + ["while :; do ps -ww -eo args; echo ====; sleep 0.05; done"],
                               stdin=subprocess.DEVNULL, stdout=samples, stderr=subprocess.DEVNULL, text=True)
    try:
        t = out["task"] = task(lab, "start --env-fd 0 --repo %s --ref %s" % (server.url, first),
                               stdin=env_lines({"TASK_MODE": "fix", "MODEL_ENDPOINT": lab["endpoint"]}))
    except BaseException:
        sampler.kill()
        sampler.wait()
        samples.close()
        raise
    try:
        try:
            out["one"] = agent_turn(lab, t["task"], env={"MODEL_TOKEN": lab["token"]}, extra=" --hold 2")
        finally:
            sampler.kill()
            sampler.wait()
            samples.seek(0)
            out["ps"] = samples.read()
            samples.close()
        out["two"] = agent_turn(lab, t["task"])
        # a third turn: the browser (a page and a screenshot of it) and what the cell can read of the secrets
        browse = "; ".join("python3 %s '%s'; echo" % (CLIENT, json.dumps(req)) for req in (
            {"op": "browser", "action": "open", "url": lab["page"]}, {"op": "browser", "action": "screenshot",
                                                                      "name": "task"}))
        needles = {"url": server.url, "endpoint": lab["endpoint"], "password": server.password, "token": lab["token"]}
        scan = run(lab, t["task"], "sh -c " + shlex.quote(browse + "; echo '== shots'; ls /run/chv/shots; "
                                                          "echo '== hits'; " + SCAN),
                   stdin="".join("%s %s\n" % kv for kv in needles.items())).stdout
        sections, label = {"browser": []}, "browser"
        for line in filter(None, scan.splitlines()):
            if line.startswith("== "):
                label = line[3:]
                sections[label] = []
            else:
                sections[label].append(line)
        out["browser"] = [json.loads(line) for line in sections["browser"]]
        out["shots"], out["hits"] = sections["shots"], sections["hits"]
        out["found"] = {name: sections[name] for name in needles}
        out["export"] = export(lab, t["task"], "/workspace/RESULT.md", "/home/chv/.codex/host-state.json")
    finally:
        out["end"] = task(lab, "end %s" % t["task"])
    out["journal"] = over_ssh(lab["root"], "journalctl --no-pager -o cat --since @%s" % since).stdout
    # the next task in the same slot
    t2 = out["next"] = task(lab, "start")
    try:
        out["look"] = run(lab, t2["task"], "sh -c " + shlex.quote(LOOK + "; env")).stdout
    finally:
        task(lab, "end %s" % t2["task"])
    return out


def test_a_task_from_a_clone_to_a_pushed_branch_and_an_export_then_nothing_left(lab, first_task):
    server, t, one, two = lab["server"], first_task["task"], first_task["one"], first_task["two"]
    first, second = server.commits
    assert t["repo"] == {"url": server.url, "head": first, "branch": None}, t   # the commit asked for, not main's
    assert one["turn"] == 1 and one["previous"] == [] and one["task_mode"] == "fix" and one["model_status"] == 200
    # the second turn read the first's state
    assert two["turn"] == 2 and two["previous"] == [{"turn": 1, "commit": one["commit"]}], two
    assert two["push"]["ok"] is True and two["push"]["result"]["returncode"] == 0, two["push"]
    # the branch, read back from the server: the agent's two commits on the commit the task started at
    branch = "refs/heads/" + two["branch"]
    assert server.ref(branch) == two["commit"] and server.ref(branch + "^") == one["commit"]
    assert server.ref(branch + "^^") == first and server.ref("refs/heads/main") == second
    assert server.show(branch + ":NOTES.md") == ("turn 1 of the stand-in agent: model edit for turn 1\n"
                                                "turn 2 of the stand-in agent: no answer from the model\n")
    assert first_task["export"]["workspace/RESULT.md"] == "result after turn 2 in %s\n" % t["slot"]
    state = json.loads(first_task["export"]["home/.codex/host-state.json"])
    assert [x["turn"] for x in state["turns"]] == [1, 2]
    # the browser ran in the task (the control of the empty context below), its screenshot in the slot
    opened, shot = first_task["browser"]
    assert opened["ok"] and opened["result"]["title"] == "Task page" and shot["ok"], first_task["browser"]
    assert first_task["shots"] != [], first_task
    assert first_task["end"] == {"ended": True, "slot": t["slot"], "task": t["task"]}
    # the next task in the same slot: home, workspace, /tmp and screenshots empty, no page in its browser
    # context, none of the first task's variables
    t2, look = first_task["next"], first_task["look"]
    assert t2["slot"] == t["slot"] and t2["task"] != t["task"]
    listing, rest = look.split("end\n", 1)
    assert listing == "", look
    assert json.loads(rest.splitlines()[0])["error"] == "browser: no page open for this slot; use open first", look
    assert "TASK_MODE" not in rest and "MODEL_" not in rest and "CHV_SLOT=%s" % t["slot"] in rest, rest
    left = slot_left(lab, t["slot"]).splitlines()
    assert [line for line in left if line.startswith("/")] == [], left   # the screenshot's directory is empty
    assert [line.split()[-1] for line in left if line.startswith(t["slot"] + " ")] == ["idle"], left


def test_the_credentials_reach_nothing_the_cell_or_the_guest_shows(lab, first_task):
    server, token, one, two = lab["server"], lab["token"], first_task["one"], first_task["two"]
    found = first_task["found"]
    # the controls: the search finds what is there (the clone's remote URL in its .git/config, the task's
    # setting in the cell's process environments)
    assert "/workspace/.git/config" in found["url"], found
    assert [p for p in found["endpoint"] if p.startswith("/proc/")], found
    # the guest's git credential and the first turn's model credential: in no file the cell can read, in no
    # environment of the third turn's cell
    assert found["password"] == [] and found["token"] == [], found
    # the model credential was the first turn's environment only (the model answered it, not the second turn)
    assert one["token_sha256"] == sha(token) and "MODEL_TOKEN" in one["env_names"]
    assert two["token_sha256"] is None and "MODEL_TOKEN" not in two["env_names"] and two["model_status"] == 401
    assert server.model_requests() == [{"path": "/v1/edit", "authorized": True},
                                       {"path": "/v1/edit", "authorized": False}]
    assert server.password not in json.dumps(one["environ"]) + json.dumps(two["environ"])
    # the guest's process list, sampled from the task's start through its first turn (the turn's agent seen)
    samples = first_task["ps"].split("====\n")
    seen = [i for i, sample in enumerate(samples) if "/app/host.py" in sample]
    assert len(samples) >= 3 and seen, (len(samples), seen)
    assert server.password not in first_task["ps"] and token not in first_task["ps"]
    # the guest's journal over the task (chv-broker's audit of the push: the control that it is the right one)
    journal = first_task["journal"]
    assert '"push"' in journal, journal[-3000:]
    assert server.password not in journal and token not in journal


def test_as_many_tasks_at_once_as_slots_each_with_its_own_branch_and_export(lab):
    server = lab["server"]
    count = len(lab["policy"]["slots"]) - len(lab["policy"].get("warm_slots", []))
    branches = ["agent/parallel-%d-%s" % (i, secrets.token_hex(3)) for i in range(count)]
    started = [task(lab, "start --env-fd 0 --repo %s --ref main" % server.url, stdin=env_lines({"AGENT_BRANCH": b}))
               for b in branches]
    try:
        assert len({t["slot"] for t in started}) == count
        results = two_turns_each(started, lambda task_id: agent_turn(lab, task_id))
        assert_each_on_its_own_branch(server, started, branches, results,
                                      lambda task_id, path: export(lab, task_id, path))
    finally:
        for t in started:
            task(lab, "end %s" % t["task"])


def test_a_task_whose_executor_vanished_is_reclaimed_after_its_ttl(lab):
    ttl = 5  # counted from the start and then from the end of the last turn: the turn below starts within it
    t = task(lab, "start --ttl %d --repo %s" % (ttl, lab["server"].url))
    proc = subprocess.Popen(lab["agent"] + ["chv-cell run --task %s -- sh -c 'echo left > /workspace/left; "
                                            "echo started; sleep 120'" % t["task"]],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "started\n", (line, proc.wait(), proc.stderr.read())
        # control: the task holds its slot, its clone and the turn's file
        held = slot_left(lab, t["slot"])
        assert "/var/lib/chv-fleet/workspaces/%s/.git\n" % t["slot"] in held and "/left\n" in held, held
        proc.kill()                  # the executor's ssh dies mid-turn: the turn's cell stops, the task stays
        proc.wait()
        # the task outlives its executor's connection (its turn's end restarts its TTL)...
        assert [x["task"] for x in task(lab, "list")] == [t["task"]]
        listed = []
        deadline = time.monotonic() + lab["policy"]["stop_grace"] + ttl + 30
        while time.monotonic() < deadline:
            time.sleep(1)
            listed = task(lab, "list")          # ...until a list after its TTL reaps it
            if not listed:
                break
        assert listed == [], listed
    finally:
        proc.kill()
    # nothing of it left: the slot idle and empty, the task gone (its owner is told it expired)
    left = slot_left(lab, t["slot"]).splitlines()
    assert [line for line in left if line.startswith("/var/lib/chv-fleet/")] == [], left
    assert [line.split()[-1] for line in left if line.startswith(t["slot"] + " ")] == ["idle"], left
    records = over_ssh(lab["root"], "ls /run/chv-fleet/tasks/ /run/chv-fleet/cells/")
    assert records.returncode == 0 and t["task"] not in records.stdout, records
    gone = run(lab, t["task"], "true", expect=68)
    assert "expired" in gone.stderr, gone.stderr
