"""sync: the git host allow-list end to end, the worker running git as the
cell uid (root: setuid). The allow-list's parsing and matching:
tests/unit/broker/test_broker_sync_hosts.py."""
import json
import os

import pytest

from broker_helpers import CELL_UID, chown_tree, git, needs_root, new_repo, slot_inproc  # noqa: F401  # pylint: disable=unused-import


@pytest.fixture
def repo(env):
    ws, path = new_repo(env)
    git(path, "commit", "-q", "--allow-empty", "-m", "x")
    chown_tree(ws, CELL_UID)
    return path


# a closed port on loopback: git really runs and fails fast, with no outside network
ALLOWED = "https://bot:tok3n@127.0.0.1:9/x.git"


@needs_root
def test_pull_to_an_unlisted_host_is_refused_before_git_runs(repo, slot_inproc):
    git(repo, "remote", "add", "origin", "https://bot:tok3n@evil.example/x.git")
    slot_inproc.cfg["sync"]["hosts"] = ["127.0.0.1", "git.example.org"]
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep == {"ok": False, "error": "sync rejected: remote 'origin' (https://evil.example/x.git): "
                                         "host evil.example port 443 is not in chv_broker_sync_hosts"}, rep
    # status talks to no remote: not refused
    assert slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})["ok"] is True
    # control: a listed host -- git runs (and fails to connect to the closed port)
    git(repo, "remote", "set-url", "origin", ALLOWED)
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["returncode"] != 0, rep
    assert "127.0.0.1" in rep["result"]["stderr"] and "tok3n" not in json.dumps(rep)
    # and no host list: the unlisted host is git's (and the kernel's) business again
    git(repo, "remote", "set-url", "origin", "https://evil.invalid/x.git")
    slot_inproc.cfg["sync"]["hosts"] = []
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["returncode"] != 0, rep
    with open(os.path.join(slot_inproc.env["root"], "inproc.log")) as fh:
        assert "tok3n" not in fh.read()


@needs_root
def test_push_checks_the_pushurl_and_the_push_remote(repo, slot_inproc):
    slot_inproc.cfg["sync"]["hosts"] = ["127.0.0.1"]
    git(repo, "remote", "add", "origin", ALLOWED)
    git(repo, "config", "remote.origin.pushurl", "ssh://git@evil.example/x.git")
    rep = slot_inproc.call({"op": "sync", "action": "push", "repo": "repo"})
    assert rep["ok"] is False and "remote 'origin' (ssh://evil.example/x.git)" in rep["error"], rep
    assert slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})["ok"] is True  # fetch uses url
    git(repo, "config", "--unset", "remote.origin.pushurl")
    rep = slot_inproc.call({"op": "sync", "action": "push", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["returncode"] != 0, rep  # control: git ran
    # branch.main.pushRemote names another remote (scp-like, unlisted)
    git(repo, "remote", "add", "other", "git@evil.example:x.git")
    git(repo, "config", "branch.main.pushRemote", "other")
    rep = slot_inproc.call({"op": "sync", "action": "push", "repo": "repo"})
    assert rep["ok"] is False and "remote 'other' (evil.example:x.git)" in rep["error"], rep
    # branch.main.remote as a URL (git uses the name as the URL)
    git(repo, "config", "--unset", "branch.main.pushRemote")
    git(repo, "config", "branch.main.remote", "https://u:tok3n@evil.example/x.git")
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is False and "remote https://evil.example/x.git:" in rep["error"], rep
    assert "tok3n" not in rep["error"]


@needs_root
def test_local_remotes_are_refused_with_a_host_list(repo, slot_inproc, env):
    outside = os.path.join(env["root"], "outside")
    os.makedirs(outside)
    git(outside, "init", "-q", "--bare")
    git(repo, "remote", "add", "origin", outside)
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})  # control: no host list, git refuses
    assert rep["ok"] is True and "transport 'file' not allowed" in rep["result"]["stderr"], rep
    slot_inproc.cfg["sync"]["hosts"] = ["127.0.0.1"]
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is False and "local paths are refused while chv_broker_sync_hosts is set" in rep["error"]
    git(repo, "remote", "set-url", "origin", "file://" + outside)
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is False and "file:// URLs" in rep["error"], rep
    # a remote name with no url at all (git would read .git/remotes/<name>)
    git(repo, "remote", "remove", "origin")
    os.makedirs(os.path.join(repo, ".git", "remotes"), exist_ok=True)
    with open(os.path.join(repo, ".git", "remotes", "origin"), "w") as fh:
        fh.write("URL: https://evil.example/x.git\n")
    os.lchown(os.path.join(repo, ".git", "remotes", "origin"), CELL_UID, CELL_UID)
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is False and "remote 'origin' has no url" in rep["error"], rep


@needs_root
def test_non_git_commands_are_refused_with_a_host_list(repo, slot_inproc):
    slot_inproc.cfg["sync"]["commands"] = {"status": ["id", "-u"]}
    assert slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})["ok"] is True
    slot_inproc.cfg["sync"]["hosts"] = ["127.0.0.1"]
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["ok"] is False and "not git" in rep["error"] and "chv_broker_sync_hosts" in rep["error"]
