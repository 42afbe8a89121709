"""sync between tenants (issue 29): slot A's repository made to point at slot B's
files, B's agent state and a file under the browser's venv through each indirection
git follows; none of their contents may come back, and the worker runs as A's own
uid and gid. Real git, real worker processes as the cells' uids (child isolation: no
systemd as PID 1 here; the systemd-run properties: tests/unit/broker/test_broker_sync_mounts.py).

Two layouts of the slot directories: "agent-group" is the one the issue was found on
(directories 2750 and files 0640 of the shared agent group, which the old worker ran
with), "private" the per-slot one (0700 uid_base:uid_base). Every test starts with its
positive control: a clean repository of A syncs (status returncode 0).
"""
import json
import os
import shutil
import subprocess
import uuid

import pytest

from broker_helpers import CELL_UID, CELL_UID_SIZE, git, needs_root, slot_inproc  # noqa: F401  # pylint: disable=unused-import

pytestmark = needs_root

UID_A, UID_B = CELL_UID, CELL_UID + CELL_UID_SIZE
AGENT_GID = 64321  # stands for the agent group every slot directory belonged to


def _own(path, uid, layout):
    gid = AGENT_GID if layout == "agent-group" else uid
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(root, n)
            os.lchown(p, uid, gid)
            if not os.path.islink(p) and layout == "agent-group":
                os.chmod(p, 0o2750 if os.path.isdir(p) else 0o640)
    os.lchown(path, uid, gid)
    os.chmod(path, 0o2750 if layout == "agent-group" else 0o700)


@pytest.fixture(params=["agent-group", "private"])
def tenants(request, env):
    layout, token = request.param, uuid.uuid4().hex[:12]
    t = {"layout": layout, "ws_a": os.path.join(env["ws"], "slot0"), "ws_b": os.path.join(env["ws"], "slot1"),
         "mark_ws": "chvmarkws" + token, "mark_state": "chvmarkstate" + token, "mark_venv": "chvmarkvenv" + token,
         "mark_key": "chvmarkkey" + token, "mark_commit": "chvmarkcommit" + token}
    # slot B: a repository (its commit message, a config key and a file are markers), its agent state
    b_repo = os.path.join(t["ws_b"], "repo")
    os.makedirs(b_repo)
    git(b_repo, "init", "-q")
    with open(os.path.join(b_repo, "notes.txt"), "w") as fh:
        fh.write(t["mark_ws"] + "\n")
    git(b_repo, "add", "notes.txt")
    git(b_repo, "commit", "-q", "-m", t["mark_commit"])
    git(b_repo, "config", "chvmark." + t["mark_key"], "1")
    t["b_repo"], t["b_git"] = b_repo, os.path.join(b_repo, ".git")
    t["b_sha"] = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=b_repo, check=True,
                                capture_output=True, text=True).stdout.strip()
    t["b_file"] = os.path.join(b_repo, "notes.txt")
    state_b = os.path.join(env["root"], "agent-state", "slot1")
    os.makedirs(state_b)
    t["b_state"] = os.path.join(state_b, "state.json")
    with open(t["b_state"], "w") as fh:
        fh.write(t["mark_state"] + "\n")
    _own(t["ws_b"], UID_B, layout)
    _own(state_b, UID_B, layout)
    # a file cells never see: under the browser's venv (world-readable, as a venv is)
    venv_root = "/opt/chv-sync-test-" + token
    os.makedirs(os.path.join(venv_root, "venv"), mode=0o755)
    t["venv_file"] = os.path.join(venv_root, "venv", "pyvenv.cfg")
    with open(t["venv_file"], "w") as fh:
        fh.write(t["mark_venv"] + "\n")
    os.chmod(t["venv_file"], 0o644)
    # slot A: a clean repository (the positive control) and the hostile one
    for name in ("clean", "evil"):
        repo = os.path.join(t["ws_a"], name)
        os.makedirs(repo)
        git(repo, "init", "-q")
        git(repo, "commit", "-q", "--allow-empty", "-m", "a")
    t["evil"], t["evil_git"] = os.path.join(t["ws_a"], "evil"), os.path.join(t["ws_a"], "evil", ".git")
    with open(os.path.join(t["ws_a"], "canary"), "w") as fh:  # a file of A itself: checks without the namespace
        fh.write("chvcanary" + token + "\n")
    t["canary"], t["mark_canary"] = os.path.join(t["ws_a"], "canary"), "chvcanary" + token
    t["markers"] = [t[k] for k in ("mark_ws", "mark_state", "mark_venv", "mark_key", "mark_commit")]
    t["own"] = lambda: _own(t["ws_a"], UID_A, layout)
    t["own"]()
    yield t
    shutil.rmtree(venv_root, ignore_errors=True)


def _status_command(broker, argv):
    """The operator's "status" command (a new dict: the defaults' one is shared)."""
    broker.cfg["sync"]["commands"] = dict(broker.cfg["sync"]["commands"], status=argv)


def _sync(broker, repo="evil", action="status"):
    return broker.call({"op": "sync", "action": action, "repo": repo})


def _control(broker):
    rep = _sync(broker, "clean")
    assert rep["ok"] is True and rep["result"]["returncode"] == 0, rep
    assert rep["result"]["stdout"].startswith("## main"), rep


def _no_marker(t, rep, extra=()):
    text = json.dumps(rep)
    leaked = [m for m in list(t["markers"]) + list(extra) if m in text]
    assert not leaked, (leaked, rep)


def _control_output(broker, argv, expected):
    """The status command set to ``argv``; on the clean repository it prints ``expected``."""
    _status_command(broker, argv)
    rep = _sync(broker, "clean")
    assert rep["ok"] is True and rep["result"]["returncode"] == 0 and rep["result"]["stdout"].strip() == expected, rep


def _refused(t, broker, error):
    """A's tree owned by A again, then its sync: refused with ``error``, no marker in the reply."""
    t["own"]()
    rep = _sync(broker)
    _no_marker(t, rep)
    assert rep["ok"] is False and error in rep["error"], rep


def _main_at_b_commit(t):
    with open(os.path.join(t["evil_git"], "refs", "heads", "main"), "w") as fh:
        fh.write(t["b_sha"] + "\n")


def _relink(path, target):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


TARGETS = ("b_file", "b_state", "venv_file")


@pytest.mark.parametrize("target", TARGETS)
def test_alternates_symlink(tenants, slot_inproc, target):
    t = tenants
    _control(slot_inproc)
    alt = os.path.join(t["evil_git"], "objects", "info", "alternates")
    _relink(alt, t[target])
    _refused(t, slot_inproc, "objects/info/alternates")


def test_alternates_file_naming_another_slots_objects(tenants, slot_inproc):
    """A plain alternates file (no link) naming B's object store, a ref of A naming B's commit."""
    t = tenants
    _control_output(slot_inproc, ["git", "log", "-1", "--format=%B"], "a")
    with open(os.path.join(t["evil_git"], "objects", "info", "alternates"), "w") as fh:
        fh.write(os.path.join(t["b_git"], "objects") + "\n")
    _main_at_b_commit(t)
    _refused(t, slot_inproc, "objects/info/alternates")
    # the same with the alternates naming A's own clean repository: refused by the check itself
    with open(os.path.join(t["evil_git"], "objects", "info", "alternates"), "w") as fh:
        fh.write(os.path.join(t["ws_a"], "clean", ".git", "objects") + "\n")
    rep = _sync(slot_inproc)
    assert rep["ok"] is False and "objects/info/alternates" in rep["error"], rep


@pytest.mark.parametrize("target", TARGETS)
def test_packed_refs_symlink(tenants, slot_inproc, target):
    t = tenants
    _control(slot_inproc)
    _relink(os.path.join(t["evil_git"], "packed-refs"), t[target])
    _refused(t, slot_inproc, "symbolic link in the git directory: .git/packed-refs")
    # a link to a file of A itself is refused too: the check, not only the namespace
    _relink(os.path.join(t["evil_git"], "packed-refs"), t["canary"])
    rep = _sync(slot_inproc)
    _no_marker(t, rep, [t["mark_canary"]])
    assert rep["ok"] is False and "symbolic link" in rep["error"], rep


def test_symlinked_objects_dir(tenants, slot_inproc):
    t = tenants
    _control_output(slot_inproc, ["git", "log", "-1", "--format=%B"], "a")
    _relink(os.path.join(t["evil_git"], "objects"), os.path.join(t["b_git"], "objects"))
    _main_at_b_commit(t)
    _refused(t, slot_inproc, "symbolic link in the git directory: .git/objects")


def test_symlinked_refs_dir(tenants, slot_inproc):
    t = tenants
    _control_output(slot_inproc, ["git", "for-each-ref", "--format=%(refname) %(subject)"], "refs/heads/main a")
    git(t["b_repo"], "branch", t["mark_ws"] + "-branch")
    _own(t["ws_b"], UID_B, t["layout"])
    _relink(os.path.join(t["evil_git"], "refs"), os.path.join(t["b_git"], "refs"))
    _refused(t, slot_inproc, "symbolic link in the git directory: .git/refs")


@pytest.mark.parametrize("how", ["gitdir-file", "dot-git-symlink"])
def test_git_dir_elsewhere(tenants, slot_inproc, how):
    """A's .git is a `gitdir:` file, or a link, to B's git directory: B's config never read."""
    t = tenants
    _control(slot_inproc)
    shutil.rmtree(t["evil_git"])
    if how == "gitdir-file":
        with open(t["evil_git"], "w") as fh:
            fh.write("gitdir: %s\n" % t["b_git"])
    else:
        os.symlink(t["b_git"], t["evil_git"])
    t["own"]()
    rep = _sync(slot_inproc)
    _no_marker(t, rep)
    assert rep["ok"] is False and (".git is a file" in rep["error"] if how == "gitdir-file"
                                   else ".git is a symbolic link" in rep["error"]), rep


def test_commondir_file(tenants, slot_inproc):
    t = tenants
    _control(slot_inproc)
    with open(os.path.join(t["evil_git"], "commondir"), "w") as fh:
        fh.write(t["b_git"] + "\n")
    _refused(t, slot_inproc, ".git/commondir is not allowed")


@pytest.mark.parametrize("key", ["include.path", "includeIf.gitdir:/.path", "core.worktree", "core.fsmonitor",
                                 "core.sshCommand"])
def test_config_indirections(tenants, slot_inproc, key):
    t = tenants
    _control(slot_inproc)
    value = {"core.fsmonitor": "cat %s >&2" % t["b_file"], "core.sshCommand": "cat %s >&2" % t["b_file"],
             "core.worktree": t["b_repo"]}.get(key, t["b_git"] + "/config")
    git(t["evil"], "config", key, value)
    t["own"]()
    rep = _sync(slot_inproc)
    _no_marker(t, rep)
    assert rep["ok"] is False and key.lower() in rep["error"].lower(), rep


def test_hooks_do_not_run(tenants, slot_inproc):
    t = tenants
    _control(slot_inproc)
    _status_command(slot_inproc, ["git", "commit", "-q", "--allow-empty", "-m", "x", "--author", "a <a@b>"])
    git(t["evil"], "config", "user.name", "a")
    git(t["evil"], "config", "user.email", "a@b")
    for hook in ("pre-commit", "commit-msg", "post-commit"):
        path = os.path.join(t["evil_git"], "hooks", hook)
        with open(path, "w") as fh:
            fh.write("#!/bin/sh\ncat %s %s %s >&2\n" % (t["b_file"], t["b_state"], t["canary"]))
        os.chmod(path, 0o755)
    t["own"]()
    rep = _sync(slot_inproc)
    _no_marker(t, rep, [t["mark_canary"]])
    assert rep["ok"] is True and rep["result"]["returncode"] == 0, rep  # the commit ran, its hooks did not


@pytest.mark.parametrize("url", ["ext::sh -c cat% {b_file}% >&2", "file://{b_repo}", "{b_repo}"])
def test_local_and_ext_transports_refused(tenants, slot_inproc, url):
    t = tenants
    _control(slot_inproc)
    git(t["evil"], "remote", "add", "origin", url.format(**t))
    t["own"]()
    rep = _sync(slot_inproc, action="pull")
    _no_marker(t, rep)
    assert rep["ok"] is True and rep["result"]["returncode"] != 0, rep
    assert "not allowed" in rep["result"]["stderr"], rep


def test_submodule_git_dirs_are_not_entered(tenants, slot_inproc):
    """A gitlink whose sub/.git names a git dir (inside A) with alternates: status stays out of it."""
    t = tenants
    _control(slot_inproc)
    sub_git = os.path.join(t["evil"], "subgit")
    shutil.copytree(os.path.join(t["ws_a"], "clean", ".git"), sub_git, symlinks=True)
    os.symlink(t["b_file"], os.path.join(sub_git, "objects", "info", "alternates"))
    os.makedirs(os.path.join(t["evil"], "sub"))
    with open(os.path.join(t["evil"], "sub", ".git"), "w") as fh:
        fh.write("gitdir: ../subgit\n")
    sha = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=os.path.join(t["ws_a"], "clean"),
                         check=True, capture_output=True, text=True).stdout.strip()
    git(t["evil"], "update-index", "--add", "--cacheinfo", "160000,%s,sub" % sha)
    t["own"]()
    rep = _sync(slot_inproc)
    _no_marker(t, rep)
    assert rep["ok"] is True and rep["result"]["returncode"] == 0, rep
    assert "object directory" not in rep["result"]["stderr"], rep


def test_worker_ids_and_view_are_the_slots_own(tenants, slot_inproc, env):
    t = tenants
    _control(slot_inproc)
    _status_command(slot_inproc, [
        "sh", "-c", 'grep -E "^(Uid|Gid|Groups|CapEff|NoNewPrivs):" /proc/self/status; ls -a "$1"; '
        'cat "$2" "$3" "$4" 2>/dev/null; echo done', "sh", env["ws"], t["b_file"], t["b_state"], t["venv_file"]])
    rep = _sync(slot_inproc, "clean")
    assert rep["ok"] is True, rep
    lines = dict(line.split(":", 1) for line in rep["result"]["stdout"].splitlines() if ":" in line)
    assert lines["Uid"].split() == [str(UID_A)] * 4, rep
    assert lines["Gid"].split() == [str(UID_A)] * 4, rep  # the slot's own gid, never the agent group
    assert lines["Groups"].split() == [], rep
    assert int(lines["CapEff"].strip(), 16) == 0 and lines["NoNewPrivs"].strip() == "1", rep
    listing = [line for line in rep["result"]["stdout"].splitlines() if ":" not in line]
    assert listing[:3] == [".", "..", "slot0"] and listing[-1] == "done", rep  # no slot1 in the workspaces dir
    _no_marker(t, rep)
    # control for the negative: the files are there and readable by what the old worker ran as
    for path in (t["b_file"], t["b_state"]):
        with open(path) as fh:
            assert fh.read().strip() in t["markers"]
    if t["layout"] == "agent-group":
        probe = subprocess.run(["cat", t["b_file"], t["b_state"], t["venv_file"]], user=UID_A, group=AGENT_GID,
                               extra_groups=[], capture_output=True, text=True, check=False)
        assert [m in probe.stdout for m in (t["mark_ws"], t["mark_state"], t["mark_venv"])] == [True] * 3, probe
