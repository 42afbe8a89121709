"""The sync door against a running cell (issue 29 red-team, items 1-3): the cell swaps
its repository's config between chv-broker's check and git's use (a filter driver after
the key allow-list passed), floods the door with output, and ends mid-sync.

Real worker processes as the slot's uid (child isolation), a real cgroup v2 directory
named as the launcher names a cell's (broker_helpers.CellCgroup) holding the cell's
processes. Each negative beside its control in the same test.
"""
import http.server
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from broker_helpers import CELL_UID, SYNC_PYTHON, chown_tree, git, needs_root, new_repo, slot_inproc  # noqa: F401  # pylint: disable=unused-import

pytestmark = needs_root

_FLIP = r'''
import os, sys, time
repo, good, evil = sys.argv[1:4]
c = os.path.join(repo, ".git", "config")
i = 0
while True:
    with open(evil if i % 2 else good, "rb") as fh:
        data = fh.read()
    with open(c + ".tmp", "wb") as fh:
        fh.write(data)
    os.rename(c + ".tmp", c)
    os.utime(os.path.join(repo, "f.txt"))  # stat-dirty: status must run the clean filter
    i += 1
    with open(os.path.join(repo, "..", "flips.tmp"), "w") as fh:
        fh.write(str(i))
    os.rename(os.path.join(repo, "..", "flips.tmp"), os.path.join(repo, "..", "flips"))
    time.sleep(0.002)
'''


@pytest.fixture
def racy(env):
    ws, repo = new_repo(env)
    with open(os.path.join(repo, "f.txt"), "w") as fh:
        fh.write("hello\n")
    with open(os.path.join(repo, ".gitattributes"), "w") as fh:
        fh.write("f.txt filter=x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    leak = os.path.join(ws, "LEAK")
    with open(os.path.join(repo, ".git", "config"), "rb") as fh:
        good = fh.read()
    with open(os.path.join(ws, "good.cfg"), "wb") as fh:
        fh.write(good)
    with open(os.path.join(ws, "evil.cfg"), "wb") as fh:
        # (double quotes: an unquoted ";" starts a comment in git's config)
        fh.write(good + ('[filter "x"]\n\tclean = "sh -c \'id > %s; cat /proc/self/fd/$CHV_BROKER_CRED_FD >> %s;'
                         ' cat\'"\n' % (leak, leak)).encode())
    chown_tree(ws, CELL_UID)
    return {"ws": ws, "repo": repo, "leak": leak}


def _flipper(broker, r):
    p = subprocess.Popen([SYNC_PYTHON, "-I", "-c", _FLIP, r["repo"], os.path.join(r["ws"], "good.cfg"),
                          os.path.join(r["ws"], "evil.cfg")], user=CELL_UID, group=CELL_UID, extra_groups=[])
    broker.cgroup.add(p.pid)  # a process of the cell
    return p


def _flips(r):
    try:
        with open(os.path.join(r["ws"], "flips")) as fh:
            return int(fh.read() or 0)
    except (OSError, ValueError):
        return 0


class _NoFreeze:
    def freeze(self, cell):
        return None

    def thaw(self, d):
        pass


def _race(broker, r, runs, seconds):
    """Syncs while the cell flips its config; (leaked after run n or None, syncs that ran git)."""
    ran, end = 0, time.monotonic() + seconds
    for i in range(runs):
        if time.monotonic() > end:
            break
        rep = broker.call({"op": "sync", "action": "status", "repo": "repo"})
        if rep.get("ok") and rep["result"]["returncode"] == 0:
            ran += 1
        if os.path.exists(r["leak"]):
            return i + 1, ran
    return None, ran


def test_config_swapped_between_check_and_git_never_runs_a_filter(racy, slot_inproc):
    r = racy
    # control: a clean config syncs (the filter is not defined: git status runs nothing)
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["returncode"] == 0 and rep["result"]["stdout"].startswith("## main"), rep
    flipper = _flipper(slot_inproc, r)
    try:
        # counter-proof: without the freeze the cell wins the race here (a filter runs outside the cell)
        real = slot_inproc.broker.freezer
        slot_inproc.broker.freezer = _NoFreeze()
        leaked, _ran = _race(slot_inproc, r, 150, 60)
        assert leaked, "the race did not reproduce without the freeze: this run shows nothing"
        with open(r["leak"]) as fh:
            assert "uid=%d" % CELL_UID in fh.read()
        os.unlink(r["leak"])
        # the fix: the cell is frozen for each sync; it keeps flipping between them
        slot_inproc.broker.freezer = real
        before = _flips(r)
        leaked, ran = _race(slot_inproc, r, 60, 60)
        assert leaked is None and not os.path.exists(r["leak"]), "a filter ran: %s" % leaked
        assert ran > 0 and _flips(r) > before, (ran, before, _flips(r))  # git ran, and the cell really ran too
        assert not slot_inproc.cgroup.frozen()  # thawed after the syncs
    finally:
        flipper.kill()
        flipper.wait()


def test_output_is_capped_and_the_worker_killed(racy, slot_inproc):
    cap = slot_inproc.cfg["sync"]["max_output_bytes"]
    slot_inproc.cfg["sync"]["commands"] = dict(slot_inproc.cfg["sync"]["commands"],
                                               status=["sh", "-c", "head -c %d /dev/zero | tr '\\0' x" % (cap // 2)],
                                               pull=["yes", "chv-flood"])
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})  # control: below the cap
    assert rep["ok"] is True and rep["result"]["truncated"] is False and len(rep["result"]["stdout"]) == cap // 2, rep
    t0 = time.monotonic()
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})  # endless output
    took = time.monotonic() - t0
    assert rep["ok"] is True and rep["result"]["truncated"] is True, rep
    assert len(rep["result"]["stdout"]) == cap and rep["result"]["returncode"] == -9, rep
    assert took < 10, took  # killed at the cap, not at the timeout (30 s here)
    left = subprocess.run(["pgrep", "-u", str(CELL_UID), "-x", "yes"], capture_output=True, text=True, check=False)
    assert left.stdout == "", left.stdout


def test_a_sync_ends_with_its_cell(racy, slot_inproc):
    late = os.path.join(racy["repo"], "late")
    slot_inproc.cfg["sync"]["commands"] = dict(slot_inproc.cfg["sync"]["commands"],
                                               status=["sh", "-c", "sleep 2; echo late > late"])
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})  # control: it writes
    assert rep["ok"] is True and rep["result"]["returncode"] == 0 and os.path.exists(late), rep
    os.unlink(late)
    out = {}
    th = threading.Thread(target=lambda: out.update(rep=slot_inproc.call({"op": "sync", "action": "status",
                                                                          "repo": "repo"})))
    th.start()
    time.sleep(0.7)  # the sync runs (the cell is frozen meanwhile)
    t0 = time.monotonic()
    slot_inproc.leader.kill()  # the run ends: SIGKILL reaches a frozen process
    th.join(10)
    took = time.monotonic() - t0
    assert not th.is_alive() and took < 2, took
    assert out["rep"]["ok"] is False and "the cell ended" in out["rep"]["error"], out
    time.sleep(2.5)  # past the moment the command would have written
    assert not os.path.exists(late)
    left = subprocess.run(["pgrep", "-u", str(CELL_UID), "-f", "echo late"], capture_output=True, text=True,
                          check=False)
    assert left.stdout == "", left.stdout


class _AuthHandler(http.server.BaseHTTPRequestHandler):
    seen = []

    def do_GET(self):  # noqa: N802
        auth = self.headers.get("Authorization")
        _AuthHandler.seen.append(auth)
        self.send_response(401 if not auth else 403)
        self.send_header("WWW-Authenticate", 'Basic realm="t"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def test_git_gets_only_the_credential_of_its_remote(racy, slot_inproc, env):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _AuthHandler)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cred = os.path.join(env["root"], "creds")
        with open(cred, "w") as fh:
            fh.write("https://other:chvsecretother@git.example.org\nhttp://bot:tok@127.0.0.1:%d\n" % port)
        os.chmod(cred, 0o600)
        slot_inproc.cfg["sync"]["credentials_file"] = cred
        slot_inproc.cfg["sync"]["protocols"] = ["http"]
        git(racy["repo"], "remote", "add", "origin", "http://127.0.0.1:%d/r.git" % port)
        git(racy["repo"], "config", "--unset", "core.bare")
        chown_tree(racy["ws"], CELL_UID)
        # what the worker's git tree holds: the memfd, read by a git command of the operator's
        slot_inproc.cfg["sync"]["commands"] = dict(slot_inproc.cfg["sync"]["commands"], pull=["git", "fetch"])
        _AuthHandler.seen.clear()
        rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
        assert rep["ok"] is True, rep
        import base64
        assert base64.b64encode(b"bot:tok").decode() in " ".join(a or "" for a in _AuthHandler.seen), (
            _AuthHandler.seen, rep)
        assert "chvsecretother" not in json.dumps(rep)
    finally:
        srv.shutdown()


def test_the_worker_keeps_only_the_checked_hosts_lines():
    from chv_guest.broker import syncrun  # pylint: disable=import-outside-toplevel
    data = b"https://a:1@git.example.org\nhttps://b:2@evil.example\nhttp://c:3@git.example.org\nhttps://d:4@git.example.org:8443\n"
    assert syncrun.credential_lines(data, {("https", "git.example.org", 443)}) == b"https://a:1@git.example.org\n"
    assert syncrun.credential_lines(data, {("https", "git.example.org", 8443)}) == b"https://d:4@git.example.org:8443\n"
    assert syncrun.credential_lines(data, set()) == b""
