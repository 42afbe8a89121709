"""sync between tenants (issue 29), the pure parts: the worker's identity and mount
namespace (both isolation modes), the git directory checks, git's environment, the
reply's stderr. End to end with real git and cell uids:
tests/integration/broker/test_sync_tenants.py."""
import json
import os

import pytest
import yaml

from ansible_collections.chv.fleet.plugins.filter import door_config
from testpaths import ROOT

from chv_guest.broker import server, syncrun
from chv_guest.broker.syncrun import Rejected, check_git_dir, git_env, jail_plan

WS_DIR = "/var/lib/chv-fleet/workspaces"
WS = WS_DIR + "/slot3"

# The exact properties verified once on the lab guest "demo" (systemd 252, bookworm),
# with `nsenter -t <leader> -a systemd-run --wait --pipe -q ...` and a scratch tree
# under /tmp: the worker as 524288:524288 saw /var/lib/chv-fleet holding
# workspaces/slot0 only, could write there, got "No such file or directory" for
# slot1's file and "Permission denied" for /opt, /etc/chv, /run/chv-fleet, /home.
VERIFIED_MOUNT_PROPERTIES = [
    "TemporaryFileSystem=/var:ro",
    "PrivateTmp=yes",
    "ProtectHome=yes",
    "InaccessiblePaths=-/run/chv-fleet -/run/chv-shots -/run/chv-browser -/etc/chv -/opt -/srv -/mnt -/media"
    " -/usr/lib/chv-fleet/chv_guest/browser -/usr/lib/chv-fleet/chv-browser",
    "TemporaryFileSystem=/var/lib/chv-fleet/workspaces:ro",
    "BindPaths=/var/lib/chv-fleet/workspaces/slot3",
    "ReadWritePaths=/var/lib/chv-fleet/workspaces/slot3",
]


def _scfg(**over):
    return server.merge(server.DEFAULTS, {"sync": over})["sync"]


# ------------------------------------------------------------------ mount namespace: unit mode
def test_unit_argv_carries_the_verified_mount_properties():
    argv = server.sync_unit_argv(_scfg(unit_properties=["NoNewPrivileges=yes"]), "slot3", WS, 720896, 720896,
                                 {"PATH": "/usr/bin"}, ["/usr/bin/python3", "-I", "syncrun.py", "{}"], WS_DIR)
    props = [o.split("=", 1)[1] for o in argv[:argv.index("--")] if o.startswith("--property=")]
    start = props.index(VERIFIED_MOUNT_PROPERTIES[0])
    assert props[start:start + len(VERIFIED_MOUNT_PROPERTIES)] == VERIFIED_MOUNT_PROPERTIES
    assert props[-1] == "NoNewPrivileges=yes"  # operator properties come last (later ones win)
    cmd = argv[argv.index("--") + 1:]
    assert cmd[:5] == ["/usr/bin/setpriv", "--reuid=720896", "--regid=720896", "--clear-groups", "--inh-caps=-all"]


def test_role_defaults_are_the_brokers_and_render_into_broker_json():
    with open(os.path.join(ROOT, "roles", "broker", "defaults", "main.yml")) as fh:
        defaults = yaml.safe_load(fh)
    assert defaults["chv_broker_sync_mounts_default"] == \
        "{{ 'chv_broker_sync_mounts_default' | chv.fleet.door_default('broker') }}"
    assert door_config.door_default("chv_broker_sync_mounts_default", "broker") == list(server.SYNC_MOUNTS_DEFAULT)
    assert defaults["chv_broker_sync_mounts"] == []
    # the mount properties left the unit properties: one list, both isolation modes
    assert not [p for p in defaults["chv_broker_sync_unit_properties_default"]
                if p.split("=", 1)[0] in syncrun.MOUNT_PROPERTIES]
    with open(os.path.join(ROOT, "roles", "broker", "vars", "main.yml")) as fh:
        assert yaml.safe_load(fh)["__broker_config_values"]["sync"]["mounts"] == \
            "{{ chv_broker_sync_mounts_default + chv_broker_sync_mounts }}"


def test_mount_properties_hide_every_other_workspace():
    props = server.sync_mount_properties(_scfg(), WS_DIR, WS)
    assert props == VERIFIED_MOUNT_PROPERTIES
    # an operator's extra mounts come before the workspace's own, which nothing can drop
    props = server.sync_mount_properties(_scfg(mounts=["InaccessiblePaths=-/data"]), WS_DIR + "/", WS)
    assert props == ["InaccessiblePaths=-/data", "TemporaryFileSystem=%s:ro" % WS_DIR, "BindPaths=" + WS,
                     "ReadWritePaths=" + WS]


@pytest.mark.parametrize("bad", ["/var/lib/chv fleet/ws", "/var/lib/a:b", "relative/ws", "/var/lib/../etc"])
def test_mount_properties_refuse_unquotable_paths(bad):
    with pytest.raises(ValueError):
        server.sync_mount_properties(_scfg(), bad, bad + "/slot0")


@pytest.mark.parametrize("mounts", [["ProtectSystem=strict"], ["BindPaths=/etc/chv"], ["PrivateTmp=maybe"],
                                    ["TemporaryFileSystem=/var:exec"], "TemporaryFileSystem=/var"])
def test_broker_refuses_bad_mounts_at_start(mounts):
    with pytest.raises(ValueError, match="chv_broker_sync_mounts"):
        server.Broker(server.merge(server.DEFAULTS, {"sync": {"mounts": mounts}}))
    server.Broker(server.merge(server.DEFAULTS, {}))  # control: the defaults start


# ------------------------------------------------------------------ mount namespace: child mode
def test_jail_plan_is_the_same_namespace_parents_first():
    plan = jail_plan(VERIFIED_MOUNT_PROPERTIES)
    assert plan[:5] == [("tmpfs", "/var", ("mode=0755", True)), ("tmpfs", "/tmp", ("mode=1777", False)),
                        ("inaccessible", "/home", True), ("inaccessible", "/root", True),
                        ("inaccessible", "/opt", True)]
    paths = [p for _k, p, _a in plan]
    assert paths.index("/var") < paths.index("/var/tmp") < paths.index(WS_DIR) < paths.index(WS)
    assert plan[-1] == ("bind", WS, WS)  # the deepest: bound after the tmpfs it sits in
    assert ("tmpfs", WS_DIR, ("mode=0755", True)) in plan
    hidden = {p for k, p, _a in plan if k == "inaccessible"}
    assert {"/etc/chv", "/run/chv-fleet", "/run/chv-shots", "/run/chv-browser", "/run/user",
            "/usr/lib/chv-fleet/chv_guest/browser"} <= hidden


def test_jail_plan_refuses_what_it_cannot_make():
    for bad in (["ProtectSystem=strict"], ["BindPaths=/a:/b:rbind"], ["TemporaryFileSystem=/x:exec"],
                ["InaccessiblePaths=relative"], ["ProtectHome=maybe"], ["noequals"]):
        with pytest.raises(ValueError):
            jail_plan(bad)
    assert jail_plan(["ReadWritePaths=" + WS, "ProtectHome=no", "PrivateTmp=no"]) == []


def test_jail_refuses_root_before_any_mount():
    with pytest.raises(Rejected, match="never runs as root"):
        syncrun.enter_jail({"uid": 0, "gid": 0, "workspace": "/nonexistent", "properties": []})


def test_child_mode_starts_the_worker_with_the_jail(monkeypatch, tmp_path):
    """isolation child: the worker gets --jail with the slot's ids and the same properties as a unit."""
    seen = {}

    def fake_run_worker(argv, env, stdin_data, cap, timeout, leader_pidfd=None, kill=None):
        seen["argv"], seen["env"], seen["leader"] = argv, env, leader_pidfd
        return {"returncode": 0, "stdout": b"", "stderr": b"\x1b[31mred\x1b[0m\r\nline\n",
                "truncated": False, "ended": None}

    class FakeFreezer:
        def freeze(self, cell):
            seen["frozen"] = cell["slot"]
            return "cg"

        def thaw(self, d):
            seen["thawed"] = d

    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    ws_dir = tmp_path / "ws"
    (ws_dir / "slot3").mkdir(parents=True)
    os.chown(ws_dir / "slot3", 720896 + 5, 4242)  # a uid of the slot's range, some other group
    cfg = server.merge(server.DEFAULTS, {"workspaces_dir": str(ws_dir), "sync": {"isolation": "child",
                                                                                  "credentials_file": ""}})
    broker = server.Broker(cfg)
    monkeypatch.setattr(server, "run_worker", fake_run_worker)
    broker.freezer = FakeFreezer()
    cell = {"slot": "slot3", "pid": os.getpid(), "uid_base": 720896, "uid_size": 65536}
    rep = broker.op_sync(cell, {"op": "sync", "action": "status", "repo": "."})
    argv = seen["argv"]
    assert argv[argv.index("--jail") - 1].endswith("syncrun.py")
    jail = json.loads(argv[argv.index("--jail") + 1])
    assert jail["uid"] == jail["gid"] == 720896  # uid_base, not the owner (+5) nor its group 4242
    assert jail["properties"] == server.sync_mount_properties(cfg["sync"], str(ws_dir), str(ws_dir / "slot3"))
    assert seen["leader"] is not None and seen["frozen"] == "slot3" and seen["thawed"] == "cg"
    assert rep["stderr"] == "?[31mred?[0m?\nline\n"  # control characters never reach the cell


# ------------------------------------------------------------------ identity
@pytest.fixture
def ws_owned(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")

    def make(uid, gid):
        d = tmp_path / ("ws%d" % uid)
        d.mkdir(mode=0o700)
        os.chown(d, uid, gid)
        return str(d)
    return make


def test_identity_is_uid_base_for_uid_and_gid(ws_owned):
    broker = server.Broker(server.merge(server.DEFAULTS, {}))
    cell = {"slot": "slot3", "uid_base": 720896, "uid_size": 65536}
    assert broker._sync_identity(cell, ws_owned(720896, 720896)) == (720896, 720896)  # pylint: disable=protected-access
    # a workspace of the slot whose group is the shared agent group: still the slot's own gid
    assert broker._sync_identity(cell, ws_owned(720896 + 7, 1000)) == (720896, 720896)  # pylint: disable=protected-access
    for uid in (0, 1000, 720896 + 65536):
        with pytest.raises(server.OpError, match="owner"):
            broker._sync_identity(cell, ws_owned(uid, uid))  # pylint: disable=protected-access
    with pytest.raises(server.OpError, match="owner"):  # a record whose range holds root
        broker._sync_identity({"slot": "s", "uid_base": 0, "uid_size": 65536}, ws_owned(5, 5))  # pylint: disable=protected-access


def test_identity_refuses_a_linked_workspace(tmp_path):
    broker = server.Broker(server.merge(server.DEFAULTS, {}))
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(server.OpError, match="not a directory"):
        broker._sync_identity({"slot": "s", "uid_base": 1, "uid_size": 1}, str(tmp_path / "link"))  # pylint: disable=protected-access


# ------------------------------------------------------------------ git directory checks
@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    for d in ("objects/info", "objects/pack", "refs/heads", "refs/tags", "hooks", "info"):
        (r / ".git" / d).mkdir(parents=True)
    (r / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (r / ".git" / "config").write_text("[core]\n\trepositoryformatversion = 0\n")
    (tmp_path / "elsewhere").write_text("secret\n")
    assert check_git_dir(str(r)) == str(r / ".git")  # the positive control of every case below
    return r


def test_git_dir_alternates_refused(repo):
    (repo / ".git/objects/info/alternates").write_text("/elsewhere/objects\n")
    with pytest.raises(Rejected, match="objects/info/alternates is not allowed"):
        check_git_dir(str(repo))


def test_git_dir_http_alternates_refused(repo):
    (repo / ".git/objects/info/http-alternates").write_text("https://x/objects\n")
    with pytest.raises(Rejected, match="http-alternates is not allowed"):
        check_git_dir(str(repo))


def test_git_dir_commondir_refused(repo):
    (repo / ".git/commondir").write_text("/elsewhere/.git\n")
    with pytest.raises(Rejected, match="commondir is not allowed"):
        check_git_dir(str(repo))


@pytest.mark.parametrize("rel", ["packed-refs", "HEAD", "config", "refs", "objects", "refs/heads/main",
                                 "objects/pack/pack-1.pack", "info/exclude", "hooks/x"])
def test_git_dir_symlinks_refused_anywhere(repo, rel):
    target = repo / ".git" / rel
    if target.is_dir():
        target.rename(repo / ("moved-" + rel.replace("/", "-")))
    elif target.exists():
        target.unlink()
    os.symlink(repo.parent / "elsewhere", target)
    with pytest.raises(Rejected, match="symbolic link in the git directory: .git/" + rel):
        check_git_dir(str(repo))


def test_git_dir_symlink_inside_refused_too(repo):
    os.symlink("HEAD", repo / ".git" / "ORIG_HEAD")  # pointing inside: refused all the same
    with pytest.raises(Rejected, match="ORIG_HEAD"):
        check_git_dir(str(repo))


def test_git_dir_special_files_refused(repo):
    os.mkfifo(repo / ".git" / "FETCH_HEAD")
    with pytest.raises(Rejected, match="special file in the git directory: .git/FETCH_HEAD"):
        check_git_dir(str(repo))


def test_dot_git_file_and_link_refused(tmp_path, repo):
    other = tmp_path / "other"
    other.mkdir()
    (other / ".git").write_text("gitdir: %s\n" % (repo / ".git"))
    with pytest.raises(Rejected, match=r"\.git is a file \(a gitdir: link"):
        check_git_dir(str(other))
    (other / ".git").unlink()
    os.symlink(repo / ".git", other / ".git")
    with pytest.raises(Rejected, match=r"\.git is a symbolic link"):
        check_git_dir(str(other))
    (other / ".git").unlink()
    with pytest.raises(Rejected, match="no .git directory"):
        check_git_dir(str(other))


def test_git_dir_names_are_printable_and_bounded(repo):
    name = "\x1b[2J" + "x" * 240
    os.symlink("/", repo / ".git" / name)
    with pytest.raises(Rejected) as exc:
        check_git_dir(str(repo))
    assert "\x1b" not in str(exc.value) and len(str(exc.value)) < 200


def test_git_dir_entry_bound(repo, monkeypatch):
    monkeypatch.setattr(syncrun, "GIT_DIR_MAX_ENTRIES", 5)
    for i in range(6):
        (repo / ".git" / "objects" / ("%02x" % i)).mkdir()
    with pytest.raises(Rejected, match="more than 5 entries"):
        check_git_dir(str(repo))


# ------------------------------------------------------------------ git's environment
def test_git_env_drops_alternates_and_repository_variables():
    hostile = {"GIT_ALTERNATE_OBJECT_DIRECTORIES": "/var/lib/chv-fleet/workspaces/slot1/r/.git/objects",
               "GIT_OBJECT_DIRECTORY": "/x", "GIT_DIR": "/x", "GIT_WORK_TREE": "/x", "GIT_COMMON_DIR": "/x",
               "GIT_CONFIG_PARAMETERS": "'core.fsmonitor'='x'", "GIT_CONFIG_COUNT": "1", "GIT_SSH": "/x",
               "GIT_EXEC_PATH": "/x", "GIT_NAMESPACE": "x", "PATH": "/usr/bin", "LANG": "C.UTF-8"}
    env = git_env(hostile, WS, WS + "/repo")
    assert env["GIT_DIR"] == WS + "/repo/.git" and env["GIT_WORK_TREE"] == WS + "/repo"
    for key in ("GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR", "GIT_CONFIG_PARAMETERS",
                "GIT_CONFIG_COUNT", "GIT_SSH", "GIT_EXEC_PATH", "GIT_NAMESPACE"):
        assert key not in env, key
    assert env["GIT_CONFIG_NOSYSTEM"] == "1" and env["GIT_CONFIG_GLOBAL"] == "/dev/null"
    assert env["GIT_NO_REPLACE_OBJECTS"] == "1" and env["HOME"] == "/nonexistent"


def test_git_prefix_neutralises_repository_settings():
    prefix = syncrun.git_prefix(["https"], "/usr/lib/chv-fleet/chv_guest/broker/credential.py")
    pairs = [prefix[i + 1] for i, a in enumerate(prefix) if a == "-c"]
    for opt in ("core.hooksPath=/dev/null", "core.fsmonitor=false", "protocol.allow=never",
                "protocol.https.allow=always", "diff.ignoreSubmodules=all", "submodule.recurse=false"):
        assert opt in pairs
    assert not [p for p in pairs if p.startswith(("protocol.file", "protocol.ext"))]
    # the config allow-list knows none of the indirection keys
    assert syncrun.disallowed_git_keys(["include.path", "includeif.gitdir:/x/.path", "core.worktree",
                                        "core.fsmonitor", "core.sshcommand", "core.hookspath",
                                        "core.alternaterefscommand", "extensions.worktreeconfig",
                                        "remote.origin.uploadpack", "url.x.insteadof",
                                        "remote.origin.url"]) == sorted([
        "include.path", "includeif.gitdir:/x/.path", "core.worktree", "core.fsmonitor", "core.sshcommand",
        "core.hookspath", "core.alternaterefscommand", "extensions.worktreeconfig",
        "remote.origin.uploadpack", "url.x.insteadof"])


def test_printable_keeps_newlines_and_tabs_only():
    assert server.printable("a\tb\nc\x00d\x1b[0m\r\x7f\x9b") == "a\tb\nc?d?[0m???"
