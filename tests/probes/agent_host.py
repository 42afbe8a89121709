#!/usr/bin/python3 -I
"""A stand-in for the executor's agent (/app/host.py of the design's
contract): takes exactly the contract's arguments, keeps its state in
--state, edits the task's repository, commits, and on its second turn
pushes through chv-broker's sync door.  Standard library only; runs in a
cell (tests/integration/cells/test_task_repo_real.py).

    python3 /app/host.py --state /home/chv/.codex/host-state.json --codex-home /home/chv/.codex \\
        --sandbox danger-full-access [--hold SECONDS]

Prints one JSON line: the turn, what it saw of its environment (the model
credential only as a SHA-256, never its value), its commit and the sync
door's answer."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

# the branch the agent pushes: the task's setting, else one of the slot's
BRANCH = os.environ.get("AGENT_BRANCH") or "agent/" + os.environ.get("CHV_SLOT", "work")
GIT = ["git", "-c", "user.name=stand-in agent", "-c", "user.email=agent@cell.invalid"]


def door(request):
    """One request to chv-broker through its client (the broker role's client.py, or the copy beside this
    file); its reply."""
    client = next(p for p in (os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.py"),
                              "/usr/lib/chv-fleet/chv_guest/broker/client.py") if os.path.exists(p))
    r = subprocess.run([sys.executable, "-I", client, json.dumps(request)], capture_output=True, text=True,
                       check=False)
    return json.loads(r.stdout) if r.stdout else {"ok": False, "client_exit": r.returncode, "stderr": r.stderr}


def ask_model(turn):
    """The model's edit for this turn (MODEL_ENDPOINT, with MODEL_TOKEN as the bearer credential):
    (HTTP status, its line or None)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(os.environ["MODEL_ENDPOINT"], data=json.dumps({"turn": turn}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    if os.environ.get("MODEL_TOKEN"):
        req.add_header("Authorization", "Bearer " + os.environ["MODEL_TOKEN"])
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())["line"]
    except urllib.error.HTTPError as exc:
        return exc.code, None


def git(*args):
    return subprocess.run(GIT + list(args), cwd="/workspace", capture_output=True, text=True, check=True).stdout


def main(argv):
    ap = argparse.ArgumentParser(prog="host.py")
    ap.add_argument("--state", required=True)
    ap.add_argument("--codex-home", required=True)
    ap.add_argument("--sandbox", required=True, choices=["danger-full-access"])
    ap.add_argument("--hold", type=float, default=0.0, help="stay this long (the test samples ps meanwhile)")
    args = ap.parse_args(argv)
    os.makedirs(args.codex_home, exist_ok=True)
    try:
        with open(args.state) as fh:
            state = json.load(fh)
    except FileNotFoundError:
        state = {"turns": []}
    turn = len(state["turns"]) + 1
    token = os.environ.get("MODEL_TOKEN")
    out = {"turn": turn, "previous": list(state["turns"]), "env_names": sorted(os.environ),
           "token_sha256": hashlib.sha256(token.encode()).hexdigest() if token else None,
           "task_mode": os.environ.get("TASK_MODE"),
           "environ": {k: ("<MODEL_TOKEN>" if k == "MODEL_TOKEN" else v) for k, v in os.environ.items()}}
    if turn == 1:
        git("checkout", "-q", "-b", BRANCH)
    line = "turn %d of the stand-in agent" % turn
    if os.environ.get("MODEL_ENDPOINT"):
        out["model_status"], said = ask_model(turn)
        line += ": " + (said or "no answer from the model")
    with open("/workspace/NOTES.md", "a") as fh:
        fh.write(line + "\n")
    with open("/workspace/RESULT.md", "w") as fh:
        fh.write("result after turn %d in %s\n" % (turn, os.environ.get("CHV_SLOT")))
    git("add", "NOTES.md", "RESULT.md")
    git("commit", "-q", "-m", "stand-in agent, turn %d" % turn)
    out["commit"] = git("rev-parse", "HEAD").strip()
    out["branch"] = BRANCH
    if turn == 2:
        git("config", "push.autoSetupRemote", "true")
        out["push"] = door({"op": "sync", "action": "push", "repo": "."})
    time.sleep(args.hold)
    state["turns"].append({"turn": turn, "commit": out["commit"]})
    with open(args.state, "w") as fh:
        json.dump(state, fh)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
