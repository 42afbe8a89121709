"""chv.fleet.converge_state's logic (plugins/module_utils/converge_state.py):
the stamp of a converge and the fast path's verdict, on a real directory
tree, with the host's other readers as fakes."""

import json
import os

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import converge_state as cs


def readers(units=None, packages=("git",), tables=("inet chv_cell",), users=None, sysctls=None):
    state = {"units": dict(units or {"chv-cell-nat.service": {"file": "enabled", "active": "active"}}),
             "packages": set(packages), "tables": set(tables),
             "users": dict(users or {"chv": [1000, 1000, "/home/chv", "/bin/bash"]}),
             "sysctls": dict(sysctls or {"net.ipv4.ip_forward": "1"})}
    read = {"units": lambda names: dict((n, state["units"][n]) for n in names if n in state["units"]),
            "packages": lambda: state["packages"], "nft_tables": lambda: state["tables"],
            "user": lambda n: state["users"].get(n), "group": lambda n: 1000 if n == "chv" else None,
            "sysctl": lambda k: state["sysctls"].get(k),
            "lstat": os.lstat, "readlink": os.readlink, "listdir": os.listdir}
    return state, read


@pytest.fixture
def tree(tmp_path):
    etc = tmp_path / "etc"
    (etc / "sub").mkdir(parents=True)
    (etc / "policy.json").write_text("{}")
    (etc / "sub" / "unit").write_text("[Unit]\n")
    (etc / "__pycache__").mkdir()
    os.symlink("policy.json", str(etc / "link"))
    want = {"paths": [str(etc), str(tmp_path / "absent")], "tops": [str(tmp_path)],
            "units": ["chv-cell-nat.service"], "users": ["chv"], "groups": ["chv"], "nft_tables": ["inet chv_cell"],
            "sysctls": ["net.ipv4.ip_forward"], "packages": ["git"]}
    return etc, want


def test_a_host_as_the_stamp_left_it_is_fresh_and_the_gate_age_is_reported(tree):
    etc, want = tree
    _, read = readers()
    stamp = json.loads(json.dumps(cs.stamp(want, "d1", "healthy", 1000.0, read)))  # as saved and loaded
    assert cs.verify(stamp, want, "d1", 1060.0, read) == {"fresh": True, "reasons": [], "gate_age": 60.0}
    # what the manifest holds: every path under a root (links recorded, not followed), the missing root as
    # None, a top alone; never __pycache__
    paths = stamp["state"]["paths"]
    assert paths[str(etc / "link")]["type"] == "l" and paths[str(etc / "link")]["target"] == "policy.json"
    assert paths[str(etc.parent / "absent")] is None
    assert str(etc / "sub" / "unit") in paths and not any("__pycache__" in p for p in paths)
    # the top alone: its other entries are not the roles'
    assert paths[str(etc.parent)]["type"] == "d"
    assert sorted(p for p in paths if not p.startswith(str(etc))) == sorted([str(etc.parent), str(etc.parent / "absent")])


def replace_atomically(etc):
    """A new file renamed over the old one, as a tool that writes atomically does."""
    (etc / "policy.json.tmp").write_text("{}")
    os.rename(str(etc / "policy.json.tmp"), str(etc / "policy.json"))


@pytest.mark.parametrize("change, reason", [
    (replace_atomically, "policy.json: ino, ctime_ns changed"),
    (lambda etc: os.chmod(str(etc / "policy.json"), 0o600), "policy.json: mode, ctime_ns changed"),
    (lambda etc: (etc / "sub" / "unit").unlink(), "unit: gone"),
    (lambda etc: (etc / "sub" / "new").write_text(""), "new: new"),
])
def test_a_changed_removed_or_added_file_takes_the_full_path_naming_it(tree, change, reason):
    etc, want = tree
    _, read = readers()
    stamp = cs.stamp(want, "d1", "healthy", 1000.0, read)
    # control: before the change, fresh
    assert cs.verify(stamp, want, "d1", 1001.0, read)["fresh"]
    change(etc)
    got = cs.verify(stamp, want, "d1", 1002.0, read)
    assert not got["fresh"] and any(r.endswith(reason) for r in got["reasons"]), got


def test_a_rewrite_in_place_changes_the_ctime(tree):
    etc, want = tree
    _, read = readers()
    stamp = cs.stamp(want, "d1", "", 1000.0, read)
    rec = stamp["state"]["paths"][str(etc / "policy.json")]
    with open(str(etc / "policy.json"), "w") as fh:
        fh.write("{}")  # same size, same inode
    os.utime(str(etc / "policy.json"), ns=(0, 0))  # even with the old times put back by a tool
    now = cs.entry(str(etc / "policy.json"))
    assert now["ino"] == rec["ino"] and now["size"] == rec["size"]
    got = cs.verify(stamp, want, "d1", 1001.0, read)
    assert not got["fresh"] and got["reasons"] == ["%s: ctime_ns changed" % (etc / "policy.json")], got


def test_a_runtime_path_may_be_rewritten_but_not_removed_retyped_or_chmodded(tmp_path):
    """What a role's service rewrites as it runs (the metrics collector's file and state directory): its
    contents, inode and change time are the service's; its type, mode and owner are the role's."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "events.json").write_text("{}")
    prom = tmp_path / "chv_fleet.prom"
    prom.write_text("a 1\n")
    want = {"paths": [], "runtime": [str(state), str(prom)]}
    _, read = readers()
    stamp = json.loads(json.dumps(cs.stamp(want, "d1", "", 1000.0, read)))
    assert sorted(stamp["state"]["paths"][str(prom)]) == ["gid", "mode", "type", "uid"]
    assert str(state / "events.json") not in stamp["state"]["paths"]  # the directory alone
    # the service's runs: the file replaced with other contents, the state directory's entries renamed
    (tmp_path / "new.prom").write_text("a 12345\n")
    os.rename(str(tmp_path / "new.prom"), str(prom))
    (state / "events.json.tmp").write_text('{"n": 1}')
    os.rename(str(state / "events.json.tmp"), str(state / "events.json"))
    assert cs.verify(stamp, want, "d1", 1001.0, read) == {"fresh": True, "reasons": [], "gate_age": 1.0}
    # control: the same rewrite under `paths` takes the full path
    walked = {"paths": [str(state), str(prom)]}
    walked_stamp = cs.stamp(walked, "d1", "", 1000.0, read)
    prom.write_text("a 123456\n")
    assert not cs.verify(walked_stamp, walked, "d1", 1001.0, read)["fresh"]
    # ... and a runtime path's mode, type or presence is still compared
    os.chmod(str(state), 0o755)
    got = cs.verify(stamp, want, "d1", 1002.0, read)
    assert got["reasons"] == ["%s: mode changed" % state], got
    os.chmod(str(state), 0o700)
    prom.unlink()
    assert cs.verify(stamp, want, "d1", 1003.0, read)["reasons"] == ["%s: gone" % prom]


@pytest.mark.parametrize("what, mutate, reason", [
    ("unit", lambda s: s["units"].update({"chv-cell-nat.service": {"file": "enabled", "active": "inactive"}}),
     "unit chv-cell-nat.service: inactive, was active"),
    ("unit file", lambda s: s["units"].update({"chv-cell-nat.service": {"file": "disabled", "active": "active"}}),
     "unit chv-cell-nat.service: disabled, was enabled"),
    ("package", lambda s: s["packages"].discard("git"), "package git: false, was true"),
    ("table", lambda s: s["tables"].clear(), "nft table inet chv_cell: false, was true"),
    ("user", lambda s: s["users"].pop("chv"), 'user chv: null, was [1000, 1000, "/home/chv", "/bin/bash"]'),
    ("sysctl", lambda s: s["sysctls"].update({"net.ipv4.ip_forward": "0"}), 'sysctl net.ipv4.ip_forward: "0", was "1"'),
])
def test_the_hosts_other_state_is_compared_too(tree, what, mutate, reason):
    etc, want = tree
    state, read = readers()
    stamp = cs.stamp(want, "d1", "", 1000.0, read)
    assert cs.verify(stamp, want, "d1", 1001.0, read)["fresh"], what  # control
    mutate(state)
    got = cs.verify(stamp, want, "d1", 1001.0, read)
    assert got == {"fresh": False, "reasons": [reason], "gate_age": 1.0}, what


def test_a_socket_started_service_may_come_and_go_but_its_socket_may_not():
    units = {"chv-broker.socket": {"file": "enabled", "active": "active"},
             "chv-broker.service": {"file": "static", "active": "active"},
             "chv-cell-nat-check.timer": {"file": "enabled", "active": "active"},
             "chv-cell-nat-check.service": {"file": "static", "active": "inactive"}}
    now = json.loads(json.dumps(units))
    now["chv-broker.service"]["active"] = "inactive"
    now["chv-cell-nat-check.service"]["active"] = "activating"
    assert cs.differences({"units": units}, {"units": now}) == []
    now["chv-broker.socket"]["active"] = "failed"
    assert cs.differences({"units": units}, {"units": now}) == ["unit chv-broker.socket: failed, was active"]


def test_other_inputs_another_want_no_stamp_or_a_rollouts_cordon_take_the_full_path(tree):
    etc, want = tree
    _, read = readers()
    stamp = cs.stamp(want, "d1", "", 1000.0, read)
    assert cs.verify(stamp, want, "d2", 1001.0, read)["reasons"] == [
        "the run's inputs differ from the last converge's (collection, variables or facts)"]
    other = dict(want, units=[])
    assert cs.verify(stamp, other, "d1", 1001.0, read)["reasons"] == ["the roles own other things than at the last converge"]
    assert cs.verify(None, want, "d1", 1001.0, read) == {"fresh": False, "reasons": ["no stamp of an earlier converge"],
                                                         "gate_age": None}
    assert not cs.verify(dict(stamp, version=0), want, "d1", 1001.0, read)["fresh"]
    rollout = json.dumps({"reason": "drain", "since": 1.0, "by": "root", "rollout": True})
    assert cs.verify(stamp, want, "d1", 1001.0, read, rollout)["reasons"] == [
        "a rollout's cordon is on the host (a run that stopped before its gate)"]
    # a cordon set by hand is no reason: the fast path leaves it as it is, as the full one does
    by_hand = json.dumps({"reason": "maintenance", "since": 1.0, "by": "root", "rollout": False})
    assert cs.verify(stamp, want, "d1", 1001.0, read, by_hand)["fresh"]


def test_many_differences_are_reported_as_the_first_ten_and_a_count(tree):
    etc, want = tree
    _, read = readers()
    stamp = cs.stamp(want, "d1", "", 1000.0, read)
    for i in range(15):
        (etc / ("extra%02d" % i)).write_text("")
    got = cs.verify(stamp, want, "d1", 1001.0, read)
    # fifteen new files and their directory's change time
    assert len(got["reasons"]) == 11 and got["reasons"][-1] == "and 6 more", got


def test_save_and_load_round_trip_root_only(tmp_path):
    path = str(tmp_path / "converged.json")
    assert cs.load(path) is None
    cs.save(path, {"version": cs.STAMP_VERSION, "digest": "d"})
    assert cs.load(path) == {"version": cs.STAMP_VERSION, "digest": "d"}
    assert os.stat(path).st_mode & 0o777 == 0o600
    (tmp_path / "converged.json").write_text("[1]")
    assert cs.load(path) is None  # not a stamp of this module
    assert os.listdir(str(tmp_path)) == ["converged.json"]


def test_readers_parse_systemctl_dpkg_and_nft_output():
    assert cs.parse_units("Id=a.socket\nUnitFileState=enabled\nActiveState=active\n\nId=b.service\n"
                          "UnitFileState=\nActiveState=inactive\n") == {
        "a.socket": {"file": "enabled", "active": "active"}, "b.service": {"file": "", "active": "inactive"}}
    assert cs.parse_dpkg_status("Package: git\nStatus: install ok installed\n\nPackage: vim\n"
                                "Status: deinstall ok config-files\n") == {"git"}
    assert cs.parse_nft_tables("table inet chv_cell\ntable ip nat\n") == {"inet chv_cell", "ip nat"}
