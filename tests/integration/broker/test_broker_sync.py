"""sync: path confinement, the run-as identity, git hardening, credentials."""
import json
import os

import pytest

from broker_helpers import CELL_UID, chown_tree, client_argv, client_env, git, needs_root, new_repo, slot_inproc, write_record  # noqa: F401  # pylint: disable=unused-import

pytestmark = needs_root


@pytest.fixture
def workspaces(env):
    """slot0 and slot1 workspaces, each with a git repo, owned by that slot's uids."""
    for slot, uid in (("slot0", CELL_UID), ("slot1", CELL_UID + 65536)):
        ws, repo = new_repo(env, slot)
        with open(os.path.join(repo, "README"), "w") as fh:
            fh.write(slot)
        chown_tree(ws, uid)
    secret = os.path.join(env["root"], "outside")
    os.makedirs(secret)
    git(secret, "init", "-q")
    chown_tree(secret, CELL_UID)  # a tree the cell uid owns, outside the workspace
    return env


def test_status_in_workspace_and_confinement(workspaces, slot_inproc):
    ws = os.path.join(workspaces["ws"], "slot0")
    ok = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert ok["ok"] is True, ok
    assert ok["result"]["returncode"] == 0 and "?? README" in ok["result"]["stdout"]
    assert ok["result"]["stdout"].startswith("## ")
    # absolute path inside the workspace: allowed
    assert slot_inproc.call({"op": "sync", "action": "status", "repo": ws + "/repo"})["ok"] is True

    os.symlink(os.path.join(workspaces["root"], "outside"), os.path.join(ws, "escape"))
    os.symlink("../slot1/repo", os.path.join(ws, "sideways"))
    os.lchown(os.path.join(ws, "escape"), CELL_UID, CELL_UID)
    for repo in ("../slot1/repo", "repo/../../slot1/repo", "../../outside", "escape", "sideways",
                 os.path.join(workspaces["root"], "outside"), os.path.join(workspaces["ws"], "slot1", "repo"),
                 "/", "", "nonexistent", "repo/README"):
        rep = slot_inproc.call({"op": "sync", "action": "status", "repo": repo})
        assert rep["ok"] is False and rep["error"].startswith("sync rejected"), (repo, rep)


def test_bad_actions_and_types(workspaces, slot_inproc):
    for req in ({"op": "sync", "action": "clone", "repo": "repo"},
                {"op": "sync", "action": "status", "repo": ["repo"]},
                {"op": "sync", "action": "status", "repo": "re\x00po"},
                {"op": "sync"}):
        assert slot_inproc.call(req)["ok"] is False, req


def test_runs_as_workspace_owner_never_root(workspaces, slot_inproc, env):
    cfg = slot_inproc.cfg
    cfg["sync"]["commands"] = {"status": ["id", "-u"]}
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["stdout"].strip() == str(CELL_UID)
    # a workspace owned by root (or by anyone outside the slot's range) is refused
    os.chown(os.path.join(env["ws"], "slot0"), 0, 0)
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["ok"] is False and "owner" in rep["error"]


def test_no_shell(workspaces, slot_inproc):
    slot_inproc.cfg["sync"]["commands"] = {"status": ["echo", "$(id)", ";", "id"]}
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["result"]["stdout"] == "$(id) ; id\n"


def test_dangerous_git_config_refused(workspaces, slot_inproc):
    repo = os.path.join(workspaces["ws"], "slot0", "repo")
    assert slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})["ok"] is True
    marker = os.path.join(workspaces["root"], "pwned")
    for key, value in (("core.fsmonitor", "touch " + marker),
                       ("filter.x.smudge", "touch " + marker),
                       ("url.https://evil.invalid/.insteadOf", "https://github.com/"),
                       ("include.path", "/nonexistent/chv-include"),
                       ("core.sshCommand", "touch " + marker)):
        git(repo, "config", key, value)
        rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
        assert rep["ok"] is False and key.lower() in rep["error"].lower(), (key, rep)
        git(repo, "config", "--unset", key)
    assert not os.path.exists(marker)
    assert slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})["ok"] is True


def test_hooks_never_run(workspaces, slot_inproc):
    repo = os.path.join(workspaces["ws"], "slot0", "repo")
    marker = os.path.join(workspaces["root"], "hooked")
    hook = os.path.join(repo, ".git", "hooks", "pre-commit")
    with open(hook, "w") as fh:
        fh.write("#!/bin/sh\ntouch %s\n" % marker)
    os.chmod(hook, 0o755)
    slot_inproc.cfg["sync"]["commands"] = {"status": ["git", "commit", "-q", "--allow-empty", "-m", "x",
                                                 "--author", "a <a@b>"]}
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    assert rep["ok"] is True
    assert not os.path.exists(marker)


def test_gitdir_outside_workspace_refused(workspaces, slot_inproc):
    other = os.path.join(workspaces["root"], "outside", ".git")
    d = os.path.join(workspaces["ws"], "slot0", "linked")
    os.makedirs(d)
    with open(os.path.join(d, ".git"), "w") as fh:
        fh.write("gitdir: %s\n" % other)
    chown_tree(d, CELL_UID)
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "linked"})
    assert rep["ok"] is False and "git directory" in rep["error"]


def test_pull_uses_only_broker_credentials(workspaces, slot_inproc, env):
    """pull over a disallowed protocol fails; credentials reach git via the helper only."""
    repo = os.path.join(workspaces["ws"], "slot0", "repo")
    git(repo, "remote", "add", "origin", os.path.join(workspaces["root"], "outside"))
    rep = slot_inproc.call({"op": "sync", "action": "pull", "repo": "repo"})
    assert rep["ok"] is True and rep["result"]["returncode"] != 0
    assert "transport 'file' not allowed" in rep["result"]["stderr"]


def test_credential_helper_lookup():
    from chv_guest.broker import credential
    text = "# comment\nhttps://bot:s%40cret@git.example.org\nhttps://other:x@example.com:8443\n"
    assert credential.lookup(text, "https", "git.example.org") == ("bot", "s@cret")
    assert credential.lookup(text, "https", "example.com:8443") == ("other", "x")
    assert credential.lookup(text, "http", "git.example.org") is None
    assert credential.lookup(text, "https", "evil.example") is None


def test_credentials_reach_the_helper_and_never_the_file(workspaces, slot_inproc, env):
    """The credentials the broker writes to the worker's stdin reach the helper run as the workspace owner."""
    cred = os.path.join(env["root"], "creds")
    with open(cred, "w") as fh:
        fh.write("https://bot:tok@git.example.org\n")
    os.chmod(cred, 0o600)
    slot_inproc.cfg["sync"]["credentials_file"] = cred
    from broker_helpers import SRC, SYNC_PYTHON
    slot_inproc.cfg["sync"]["commands"] = {"status": [
        "sh", "-c", 'printf "protocol=https\\nhost=git.example.org\\n\\n" | %s -I %s get'
        % (SYNC_PYTHON, os.path.join(SRC, "chv_guest", "broker", "credential.py"))]}
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    # a command that is not git contacts no remote git could name: it gets no credential at all
    # (git gets the line of its checked remote: test_sync_race.py::test_git_gets_only_the_credential_of_its_remote)
    assert rep["result"]["returncode"] == 0 and rep["result"]["stdout"] == "", rep
    # the file itself is not readable by that uid
    slot_inproc.cfg["sync"]["commands"] = {"status": ["cat", cred]}
    rep = slot_inproc.call({"op": "sync", "action": "status", "repo": "repo"})
    # (not there at all: the worker's mount namespace has no /tmp of the guest, issue 29)
    assert rep["result"]["returncode"] != 0 and ("Permission denied" in rep["result"]["stderr"]
                                                 or "No such file or directory" in rep["result"]["stderr"])


def test_sync_from_a_real_cell_for_another_slot_is_refused(workspaces, broker_proc, cell):
    write_record(workspaces["cells"], "slot0", cell.pid)
    sock = workspaces["sock"]
    own = cell.run(client_argv(sock, {"op": "sync", "action": "status", "repo": "repo"}), env=client_env(sock))
    assert json.loads(own.stdout)["ok"] is True, own
    other = cell.run(client_argv(sock, {"op": "sync", "action": "status",
                                        "repo": os.path.join(workspaces["ws"], "slot1", "repo")}),
                     env=client_env(sock))
    assert json.loads(other.stdout)["ok"] is False


def test_confine_directly(scratch):
    """confine() itself refuses escapes (prepare() re-checks the pinned cwd as a second guard)."""
    from chv_guest.broker.syncrun import Rejected, confine
    ws = os.path.join(scratch, "ws")
    os.makedirs(os.path.join(ws, "repo"))
    os.makedirs(os.path.join(scratch, "other"))
    os.symlink(os.path.join(scratch, "other"), os.path.join(ws, "out"))
    os.symlink("repo", os.path.join(ws, "in"))
    assert confine(ws, "repo") == os.path.realpath(os.path.join(ws, "repo"))
    assert confine(ws, "in") == os.path.realpath(os.path.join(ws, "repo"))
    assert confine(ws, os.path.join(ws, "repo")) == os.path.realpath(os.path.join(ws, "repo"))
    for bad in ("../other", "out", os.path.join(scratch, "other"), "/", "repo/../../other", "missing", ""):
        with pytest.raises(Rejected):
            confine(ws, bad)


def test_sync_unit_argv_sandboxes_and_drops_to_the_owner():
    from chv_guest.broker import server
    scfg = server.merge(server.DEFAULTS, {})["sync"]
    scfg["unit_properties"] = ["NoNewPrivileges=yes", "PrivateNetwork=yes"]
    worker = ["/usr/bin/python3", "-I", "/usr/lib/chv-fleet/chv_guest/broker/syncrun.py", "{}"]
    argv = server.sync_unit_argv(scfg, "slot3", "/var/lib/chv-fleet/workspaces/slot3", 720896, 720896,
                                 {"PATH": "/usr/bin", "LANG": "C.UTF-8"}, worker)
    sep = argv.index("--")
    opts, command = argv[:sep], argv[sep + 1:]
    assert opts[0] == "/usr/bin/systemd-run"
    assert {"--wait", "--pipe", "--collect", "--quiet"} <= set(opts)
    assert any(o.startswith("--unit=chv-broker-sync-slot3-") for o in opts)
    props = [o.split("=", 1)[1] for o in opts if o.startswith("--property=")]
    assert "RuntimeMaxSec=120" in props and "ReadWritePaths=/var/lib/chv-fleet/workspaces/slot3" in props
    assert props[-2:] == ["NoNewPrivileges=yes", "PrivateNetwork=yes"]
    assert "--setenv=PATH=/usr/bin" in opts and "--setenv=LANG=C.UTF-8" in opts
    assert command[:5] == ["/usr/bin/setpriv", "--reuid=720896", "--regid=720896", "--clear-groups", "--inh-caps=-all"]
    assert command[-len(worker):] == worker  # an argument vector, never a shell


def test_unknown_isolation_refused_at_start():
    from chv_guest.broker import server
    cfg = server.merge(server.DEFAULTS, {"sync": {"isolation": "chroot"}})
    with pytest.raises(ValueError, match='chv_broker_sync_isolation must be one of unit, child, not "chroot"'):
        server.Broker(cfg)
