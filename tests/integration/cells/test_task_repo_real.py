"""A task's repository in and results out, in real cells through sudo as
the executor runs them, against a real git server (smart HTTP behind
lighttpd with basic authentication, in a network namespace of its own:
tests/helpers/gitserver.py), a stand-in model endpoint the agent calls
over the cell's own network (tests/probes/model_standin.py, in the same
namespace) and a real chv-broker on the cells' /run/chv/broker.sock:

task start clones at a commit (outside the cell, with the guest's
credential), two turns of a stand-in agent (tests/probes/agent_host.py,
the contract's arguments; the second turn reads the first's state) edit,
commit and push through the sync door to a branch the test reads back
from the server, a bounded export of the result, the end; the next task
in the slot finds nothing of it.  The guest's credential is in no file the
cell can read, in no payload's environment and in no command line."""

import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile

import pytest

import gitserver
from broker_helpers import BrokerProc, make_listener
from cellrt import NEEDS_REAL_CELLS, make_slot
from tasks_at_once import assert_each_on_its_own_branch, two_turns_each
from test_cells_real import AGENT_KEYS, agent_install, as_user, user_run
from test_task_env_real import files_holding, sample_ps, sha
from testpaths import PROBES, SRC

pytestmark = [pytest.mark.cells] + NEEDS_REAL_CELLS

TAG = "tt%d" % os.getpid()
HOST_PY = ["python3", "/app/host.py", "--state", "/home/chv/.codex/host-state.json", "--codex-home",
           "/home/chv/.codex", "--sandbox", "danger-full-access"]
LOOK = ("find /home/chv /workspace /tmp -mindepth 1 -not -path /home/chv/workspace -not -path '/home/chv/workspace/*'"
        " | sort; echo end")


def slot(i):
    return dict(make_slot(i, base=70, uid_base=3600000 + i * 65536, host_prefix="tts"), machine="tt-slot%d" % i)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = gitserver.available()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("taskrepo")
    os.chmod(root, 0o755)
    run_dir, app_dir = root / "run-chv", root / "app"
    for d in (run_dir, app_dir):
        d.mkdir()
        os.chmod(d, 0o755)
    shutil.copy(os.path.join(PROBES, "agent_host.py"), app_dir / "host.py")
    shutil.copy(os.path.join(SRC, "chv_guest", "broker", "client.py"), app_dir / "client.py")  # the sync door's client
    for name in ("host.py", "client.py"):
        os.chmod(app_dir / name, 0o644)
    server = gitserver.GitServer().start()
    cred = root / "git-credentials"  # the guest's credential file: root's, outside every cell
    cred.write_text(server.credential_line())
    os.chmod(cred, 0o600)
    pol = {"version": 1, "state_dir": "/run/chv-fleet-%s" % TAG, "workspace_root": str(root / "ws"),
           "agent_state_root": str(root / "state"), "inaccessible": ["/etc/chv"],
           "readonly_binds": [{"source": str(app_dir), "target": "/app"}],
           "writable_binds": [{"source": str(run_dir), "target": "/run/chv"}],
           "claim_timeout": 0, "stop_grace": 1, "require_ruleset": False, "slots": [slot(0), slot(1)],
           "env_allow": ["MODEL_TOKEN", "TASK_MODE", "AGENT_BRANCH", "MODEL_ENDPOINT"], "broker_config": str(root / "broker.json")}
    pol.update(AGENT_KEYS)
    listener = broker = None
    try:
        with agent_install(pol, packages=("chv_guest", "chv_guest/cell", "chv_guest/broker", "chv_guest/wire")) as s:
            cfg = {"cells_dir": os.path.join(pol["state_dir"], "cells"), "workspaces_dir": pol["workspace_root"],
                   "cell_policy": s["policy"], "read_timeout": 5.0,
                   "sync": {"credentials_file": str(cred), "python": "/usr/bin/python3", "timeout": 60.0,
                            "isolation": "child", "protocols": ["http"],
                            "hosts": ["%s:%d" % (gitserver.SERVER_ADDR, gitserver.PORT)]},
                   "browser": {"enabled": False}}
            with open(pol["broker_config"], "w") as fh:
                json.dump(cfg, fh)
            listener = make_listener(str(run_dir / "broker.sock"))
            broker = BrokerProc(listener, pol["broker_config"]).start()
            yield dict(s, server=server, root=root, run_dir=str(run_dir), app_dir=str(app_dir), broker=broker)
    finally:
        if broker is not None:
            broker.stop()
        if listener is not None:
            listener.close()
        server.stop()
        shutil.rmtree(pol["state_dir"], ignore_errors=True)


def task(lab, *args, stdin=None, expect=0):
    r = user_run(lab["member"], [lab["chv_cell"], "task", *args], stdin=stdin, timeout=120)
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout) if expect == 0 else r


def agent_turn(lab, task_id, env_lines=None, extra=()):
    """One turn of the stand-in agent: its JSON line."""
    argv = [lab["chv_cell"], "run", "--task", task_id] + (["--env-fd", "0"] if env_lines is not None else []) + \
        ["--"] + HOST_PY + list(extra)
    r = user_run(lab["member"], argv, stdin=(env_lines + "\n") if env_lines is not None else "", timeout=180)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr, lab["broker"].audit()[-3:])
    return json.loads(r.stdout.splitlines()[-1])


def slot_dirs(lab, name):
    return [os.path.join(lab["pol"][k], name) for k in ("workspace_root", "agent_state_root")]


def export(lab, task_id, *paths):
    p = as_user(lab["member"], [lab["chv_cell"], "task", "export", task_id, *paths], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        return {m.name: tar.extractfile(m).read().decode("latin-1") for m in tar.getmembers()}


def test_a_task_from_a_clone_at_a_commit_to_a_pushed_branch_and_nothing_left(lab):
    server = lab["server"]
    first, second = server.commits
    token = "mt-" + secrets.token_hex(20)
    endpoint = server.start_model(token)  # the model stand-in, reached over the cell's own network
    t = task(lab, "start", "--repo", server.url, "--ref", first, "--env-fd", "0",
             stdin="TASK_MODE=fix\nMODEL_ENDPOINT=%s\n\n" % endpoint)
    try:
        assert t["repo"] == {"url": server.url, "head": first, "branch": None}
        ws, home = slot_dirs(lab, t["slot"])
        # the clone: the slot's own files, the URL as given, no credential and no helper anywhere in it
        assert os.stat(os.path.join(ws, ".git", "config")).st_uid == lab["pol"]["slots"][int(t["slot"][-1])]["uid_base"]
        conf = subprocess.run(["git", "config", "-f", os.path.join(ws, ".git", "config"), "--list"], capture_output=True,
                              text=True, check=True).stdout.splitlines()
        assert "remote.origin.url=%s" % server.url in conf and not [c for c in conf if "credential" in c], conf
        assert files_holding([ws, home], server.password) == []
        with open(os.path.join(ws, "README.md")) as fh:
            assert fh.read() == "line 1 of the project\n"  # the commit asked for, not main's head
        # turn 1, with the model credential for this turn only; the process list sampled meanwhile
        argv = [lab["chv_cell"], "run", "--task", t["task"], "--env-fd", "0", "--"] + HOST_PY + ["--hold", "2"]
        p = as_user(lab["member"], argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
        p.stdin.write("MODEL_TOKEN=%s\n\n" % token)
        p.stdin.close()
        samples, seen = sample_ps(p, "/app/host.py")
        out, err = p.stdout.read(), p.stderr.read()
        assert p.returncode == 0, (out, err)
        one = json.loads(out.splitlines()[-1])
        assert seen and not [x for x in samples if token in x or server.password in x]
        assert one["turn"] == 1 and one["previous"] == [] and one["token_sha256"] == sha(token)
        assert one["task_mode"] == "fix" and one["model_status"] == 200
        assert server.password not in json.dumps(one["environ"])
        # turn 2: the first turn's state, no model credential (it was the first turn's), the push
        two = agent_turn(lab, t["task"])
        assert two["turn"] == 2 and two["previous"] == [{"turn": 1, "commit": one["commit"]}]
        assert two["token_sha256"] is None and "MODEL_TOKEN" not in two["env_names"] and two["task_mode"] == "fix"
        # the model stand-in: the first turn's call carried the credential, the second's had none to carry
        assert two["model_status"] == 401
        assert server.model_requests() == [{"path": "/v1/edit", "authorized": True},
                                           {"path": "/v1/edit", "authorized": False}]
        assert two["push"]["ok"] is True and two["push"]["result"]["returncode"] == 0, two["push"]
        # the branch, read back from the server: the agent's two commits on the commit the task started at
        branch = "refs/heads/" + two["branch"]
        assert server.ref(branch) == two["commit"]
        assert server.ref(branch + "^") == one["commit"] and server.ref(branch + "^^") == first
        assert server.ref("refs/heads/main") == second  # untouched
        assert server.show(branch + ":NOTES.md") == ("turn 1 of the stand-in agent: model edit for turn 1\n"
                                                    "turn 2 of the stand-in agent: no answer from the model\n")
        # the guest's credential: in no file the cell sees (its slot's, /run/chv, /app, the guest's /etc)
        assert files_holding(slot_dirs(lab, t["slot"]) + [lab["run_dir"], lab["app_dir"], "/etc"],
                             server.password) == []
        # nor in chv-broker's log (its audit lines of the push, the control that the log is the right one)
        with open(lab["broker"].stderr_path) as fh:
            broker_log = fh.read()
        assert '"push"' in broker_log and server.password not in broker_log and token not in broker_log
        # the results out: a bounded export of the result and the state
        got = export(lab, t["task"], "/workspace/RESULT.md", "/home/chv/.codex/host-state.json")
        assert got["workspace/RESULT.md"] == "result after turn 2 in %s\n" % t["slot"]
        assert [x["turn"] for x in json.loads(got["home/.codex/host-state.json"])["turns"]] == [1, 2]
    finally:
        task(lab, "end", t["task"])
    # the next task in the same slot finds nothing of it
    t2 = task(lab, "start")
    try:
        assert t2["slot"] == t["slot"]
        r = user_run(lab["member"], [lab["chv_cell"], "run", "--task", t2["task"], "--", "sh", "-c", LOOK + "; env"])
        assert r.returncode == 0 and r.stdout.startswith("end\n"), r.stdout
        assert "TASK_MODE" not in r.stdout and "MODEL_TOKEN" not in r.stdout
    finally:
        task(lab, "end", t2["task"])


def test_clone_refusals_beside_the_real_clone(lab):
    server = lab["server"]
    bad_auth = server.url.replace("http://", "http://%s:%s@" % (server.user, server.password))
    for args, code, says in ((["--repo", bad_auth], 78, "user name, password"),
                             (["--repo", server.url.replace(":8080", ":8081")], 78, "not in chv_broker_sync_hosts"),
                             (["--repo", server.url, "--ref", "no-such-branch"], 76, "no-such-branch is neither a branch"),
                             (["--repo", server.url.replace("proj.git", "none.git")], 76, "git clone failed")):
        r = task(lab, "start", *args, expect=code)
        assert says in r.stderr and r.stdout == "" and server.password not in r.stderr, r.stderr
        assert task(lab, "list") == []
        for d in slot_dirs(lab, "slot0"):
            assert os.listdir(d) == [], d  # a failed clone leaves nothing
    # control: the same server, the default branch
    t = task(lab, "start", "--repo", server.url)
    try:
        assert t["repo"]["head"] == server.commits[1] and t["repo"]["branch"] == "main"
        r = user_run(lab["member"], [lab["chv_cell"], "run", "--task", t["task"], "--", "git", "-C", "/workspace",
                                     "log", "--format=%s"])
        assert r.returncode == 0 and r.stdout == "commit 2\ncommit 1\n", (r.stdout, r.stderr)
        # later fetches through the sync door take the clone as it is (its config passes the door's checks)
        r = user_run(lab["member"], [lab["chv_cell"], "run", "--task", t["task"], "--", "python3", "/app/client.py",
                                     json.dumps({"op": "sync", "action": "pull", "repo": "."})], timeout=120)
        reply = json.loads(r.stdout)
        assert r.returncode == 0 and reply["ok"] and reply["result"]["returncode"] == 0, (r.stdout, r.stderr)
    finally:
        task(lab, "end", t["task"])


def test_as_many_tasks_at_once_as_slots_each_with_its_own_branch_and_export(lab):
    server = lab["server"]
    branches = ["agent/parallel-%d-%s" % (i, secrets.token_hex(3)) for i in range(len(lab["pol"]["slots"]))]
    started = [task(lab, "start", "--repo", server.url, "--ref", "main", "--env-fd", "0",
                    stdin="AGENT_BRANCH=%s\n\n" % b) for b in branches]
    try:
        assert sorted(t["slot"] for t in started) == ["slot0", "slot1"]
        results = two_turns_each(started, lambda task_id: agent_turn(lab, task_id))
        assert_each_on_its_own_branch(server, started, branches, results,
                                      lambda task_id, path: export(lab, task_id, path))
    finally:
        for t in started:
            task(lab, "end", t["task"])
