"""chv.fleet.directories: the plan, its application, and the module (in
process, on directories under tmp_path owned by the test's own uid/gid)."""

import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.chv.fleet.plugins.module_utils import directories as d
from ansible_collections.chv.fleet.plugins.modules import directories as module
from module_run import run_module

UID, GID = str(os.getuid()), str(os.getgid())


def entries(*items, **kw):
    return d.wanted_entries([dict(path=p, mode=m) for p, m in items], kw.get("owner", UID), kw.get("group", GID))


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("entry,needle", [
    (dict(path="rel/dir", mode="0755"), "absolute, normalized path, got 'rel/dir'"),
    (dict(path="/a/../b", mode="0755"), "absolute, normalized path, got '/a/../b'"),
    (dict(path="/a/", mode="0755"), "absolute, normalized path"),
    (dict(path="/a", mode="755x"), "paths[0] (/a): mode must be an octal string"),
    (dict(path="/a", mode="0855"), "mode must be an octal string"),
    (dict(path="/a", mode="0755", owner="no-such-user-chv"), "paths[0] (/a): owner 'no-such-user-chv' does not exist"),
    (dict(path="/a", mode="0755", group="no-such-group-chv"), "group 'no-such-group-chv' does not exist"),
])
def test_bad_entries_are_named(entry, needle):
    with pytest.raises(d.DirectoryError) as err:
        d.wanted_entries([entry], UID, GID)
    assert needle in str(err.value)


def test_unknown_names_are_allowed_in_check_mode_only():
    wanted = d.wanted_entries([dict(path="/a", mode="0755", owner="no-such-user-chv")], UID, GID, allow_unknown=True)
    assert wanted[0].uid is None and wanted[0].owner == "no-such-user-chv"


def test_a_path_twice_must_be_the_same_entry():
    assert len(entries(("/a", "0755"), ("/a", "0755"))) == 1
    with pytest.raises(d.DirectoryError, match="/a is listed twice with different settings"):
        entries(("/a", "0755"), ("/a", "0700"))


def test_missing_directories_are_made_with_their_parents_then_nothing_differs(tmp_path):
    top = str(tmp_path / "x")
    wanted = entries((top + "/y/z", "0750"), (top + "/y/z/w", "02750"), (top + "/v", "0700"))
    changes = d.plan(wanted)
    assert [(c.path, c.created, c.parents) for c in changes] == [
        (top + "/y/z", True, [top, top + "/y"]), (top + "/y/z/w", True, []), (top + "/v", True, [])]
    assert not os.path.exists(top)  # planning changes nothing
    d.apply(changes)
    assert (mode_of(top + "/y/z"), mode_of(top + "/y/z/w"), mode_of(top + "/v")) == (0o750, 0o2750, 0o700)
    assert mode_of(top) == 0o755 & ~_umask()
    assert d.plan(wanted) == []


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_wrong_mode_is_the_only_change(tmp_path):
    path = str(tmp_path / "m")
    os.mkdir(path, 0o777)
    os.chmod(path, 0o777)
    (change,) = d.plan(entries((path, "0755")))
    assert (change.created, change.mode, change.uid, change.gid) == (False, (0o777, 0o755), None, None)
    d.apply([change])
    assert mode_of(path) == 0o755


def test_owner_and_group_differences_are_planned_and_chowned_before_the_mode():
    fake = os.stat_result((stat.S_IFDIR | 0o2750, 0, 0, 1, 1000, 1000, 0, 0, 0, 0))
    wanted = d.wanted_entries([dict(path="/srv/w", mode="02750", owner="524288", group="1000")], "0", "0")
    (change,) = d.plan(wanted, stat_fn=lambda p: fake)
    assert (change.mode, change.uid, change.gid) == (None, (1000, 524288), None)
    calls = []
    d.apply([change], chown=lambda *a: calls.append(("chown",) + a), chmod=lambda *a: calls.append(("chmod",) + a))
    assert calls == [("chown", "/srv/w", 524288, 1000), ("chmod", "/srv/w", 0o2750)]
    assert d.diff([change]) == {"before": "/srv/w mode=2750 uid=1000 gid=1000\n",
                                "after": "/srv/w mode=2750 uid=524288 gid=1000\n"}


def test_a_file_in_the_way_fails_before_anything_changes(tmp_path):
    (tmp_path / "f").write_text("")
    first = str(tmp_path / "first")
    with pytest.raises(d.DirectoryError, match="/f exists and is not a directory"):
        d.plan(entries((first, "0755"), (str(tmp_path / "f"), "0755")))
    assert not os.path.exists(first)


def test_a_symlink_to_a_directory_counts_as_one(tmp_path):
    os.mkdir(str(tmp_path / "real"), 0o755)
    os.chmod(str(tmp_path / "real"), 0o755)
    os.symlink("real", str(tmp_path / "link"))
    assert d.plan(entries((str(tmp_path / "link"), "0755"))) == []


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from("abc"), min_size=1, max_size=3),
                          st.sampled_from(["0700", "0750", "0755", "02750"])), min_size=1, max_size=6))
def test_after_apply_nothing_differs(tmp_path_factory, items):
    root = str(tmp_path_factory.mktemp("prop"))
    seen, wanted = set(), []
    for parts, mode in items:
        path = os.path.join(root, *parts)
        if path not in seen:
            seen.add(path)
            wanted.append((path, mode))
    want = entries(*wanted)
    d.apply(d.plan(want))
    assert d.plan(want) == []
    for path, mode in wanted:
        assert mode_of(path) == int(mode, 8)


def run(capsys, **args):
    return run_module(module, capsys, **args)


def test_module_check_mode_then_changed_then_ok(tmp_path, capsys):
    paths = [dict(path=str(tmp_path / "a"), mode="0750"), dict(path=str(tmp_path / "a" / "b"), mode="0700")]
    checked = run(capsys, check=True, diff=True, paths=paths, owner=UID, group=GID)
    assert checked["changed"] and checked["changed_paths"] == [p["path"] for p in paths]
    assert checked["diff"]["before"] == "%s absent\n%s absent\n" % (paths[0]["path"], paths[1]["path"])
    assert not os.path.exists(paths[0]["path"])
    done = run(capsys, paths=paths, owner=UID, group=GID)
    assert done["changed"] and mode_of(paths[1]["path"]) == 0o700
    again = run(capsys, diff=True, paths=paths, owner=UID, group=GID)
    assert not again["changed"] and again["changed_paths"] == [] and "diff" not in again


def test_module_fails_naming_the_entry_and_changes_nothing(tmp_path, capsys):
    paths = [dict(path=str(tmp_path / "a"), mode="0750"),
             dict(path=str(tmp_path / "b"), mode="0750", owner="no-such-user-chv")]
    out = run(capsys, paths=paths, owner=UID, group=GID)
    assert out["failed"] and "paths[1] (%s): owner 'no-such-user-chv' does not exist" % paths[1]["path"] in out["msg"]
    assert not os.path.exists(paths[0]["path"])
    # in check mode the name may come from an earlier task of the same run
    out = run(capsys, check=True, paths=paths, owner=UID, group=GID)
    assert out["changed"] and not out.get("failed")
