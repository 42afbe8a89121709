"""chv.fleet.files: the plan, its two-pass application, the diff, and the
module (in process, on files under tmp_path owned by the test's own uid/gid)."""

import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.chv.fleet.plugins.module_utils import files as f
from ansible_collections.chv.fleet.plugins.modules import files as module
from module_run import run_module

UID, GID = str(os.getuid()), str(os.getgid())


def entries(*items, **kw):
    return f.wanted_entries(list(items), kw.get("owner", UID), kw.get("group", GID))


def mode_of(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def real_run(argv):
    import subprocess
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    return p.returncode, p.stdout, p.stderr


def converge(*items):
    want = entries(*items)
    changes = f.plan(want)
    f.apply(changes, run=real_run)
    return changes


@pytest.mark.parametrize("entry,needle", [
    (dict(dest="rel/x", content="", mode="0644"), "files[0]: path must be an absolute, normalized path, got 'rel/x'"),
    (dict(dest="/a/../b", content="", mode="0644"), "absolute, normalized path"),
    (dict(dest="/a", content="", mode="64"), "files[0] (/a): mode must be an octal string"),
    (dict(dest="/a", content=""), "files[0] (/a): mode must be an octal string"),
    (dict(dest="/a", mode="0644"), "files[0] (/a): a file needs content"),
    (dict(dest="/a", state="link"), "files[0] (/a): a link needs src"),
    (dict(dest="/a", state="link", src="/x\0y"), "(no NUL byte), got '/x\\x00y'"),
    (dict(dest="/a", state="dir"), "files[0] (/a): state must be one of file, link, absent, got 'dir'"),
    (dict(dest="/a", content="", mode="0644", validate="true"), "validate must contain %s"),
    (dict(dest="/a", content="", mode="0644", owner="no-such-user-chv"), "files[0] (/a): owner 'no-such-user-chv'"),
])
def test_bad_entries_are_named(entry, needle):
    with pytest.raises(f.FilesError) as err:
        entries(entry)
    assert needle in str(err.value)


def test_a_destination_twice_is_refused():
    with pytest.raises(f.FilesError, match=r"files\[1\]: /a is listed twice"):
        entries(dict(dest="/a", state="absent"), dict(dest="/a", state="absent"))


def test_create_then_nothing_to_do_then_content_and_mode(tmp_path):
    dest = str(tmp_path / "conf")
    (change,) = converge(dict(dest=dest, content="one\n", mode="0640"))
    assert change.kind == "create" and open(dest).read() == "one\n" and mode_of(dest) == 0o640
    assert f.plan(entries(dict(dest=dest, content="one\n", mode="0640"))) == []
    (change,) = f.plan(entries(dict(dest=dest, content="one\n", mode="0600")))
    assert change.kind == "attrs" and change.attrs[0] == 0o640
    (change,) = converge(dict(dest=dest, content="two\n", mode="0600"))
    assert change.kind == "content" and change.before == b"one\n"
    assert open(dest).read() == "two\n" and mode_of(dest) == 0o600


def test_force_false_leaves_an_existing_file_as_it_is(tmp_path):
    dest = str(tmp_path / "remembered")
    converge(dict(dest=dest, content="0\n", mode="0644", force=False))
    assert f.plan(entries(dict(dest=dest, content="1\n", mode="0600", force=False))) == []
    assert open(dest).read() == "0\n"


def test_a_failed_validate_changes_nothing_and_leaves_no_temporary_file(tmp_path):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    with open(first, "w") as out:
        out.write("old\n")
    want = entries(dict(dest=first, content="new\n", mode="0644", validate="grep -q new %s"),
                   dict(dest=second, content="bad\n", mode="0644", validate="grep -q good %s"))
    with pytest.raises(f.FilesError, match=r"second: validate \(grep -q good %s\) failed with 1, nothing was changed"):
        f.apply(f.plan(want), run=real_run)
    assert open(first).read() == "old\n" and not os.path.exists(second)
    assert sorted(os.listdir(str(tmp_path))) == ["first"]


def test_validate_sees_the_new_content_with_its_mode(tmp_path):
    dest = str(tmp_path / "checked")
    seen = []

    def run(argv):
        seen.append((argv[:-1], open(argv[-1]).read(), mode_of(argv[-1])))
        return 0, "", ""
    f.apply(f.plan(entries(dict(dest=dest, content="x\n", mode="0440", validate="check -f %s"))), run=run)
    assert seen == [(["check", "-f"], "x\n", 0o440)]


def test_links_are_made_and_retargeted_and_a_file_in_the_way_is_refused(tmp_path):
    link, target = str(tmp_path / "link"), str(tmp_path / "target")
    (change,) = converge(dict(dest=link, state="link", src=target))
    assert change.kind == "link" and os.readlink(link) == target
    assert f.plan(entries(dict(dest=link, state="link", src=target))) == []
    (change,) = converge(dict(dest=link, state="link", src="/elsewhere"))
    assert change.before == target and os.readlink(link) == "/elsewhere"
    with open(str(tmp_path / "plain"), "w"):
        pass
    with pytest.raises(f.FilesError, match="plain exists and is not a symlink"):
        f.plan(entries(dict(dest=str(tmp_path / "plain"), state="link", src=target)))


def test_absent_removes_files_and_links_but_never_a_directory(tmp_path):
    plain, link = str(tmp_path / "plain"), str(tmp_path / "link")
    with open(plain, "w") as out:
        out.write("bye\n")
    os.symlink("/nowhere", link)
    changes = converge(dict(dest=plain, state="absent"), dict(dest=link, state="absent"),
                       dict(dest=str(tmp_path / "never"), state="absent"))
    assert [(c.kind, c.before) for c in changes] == [("remove", b"bye\n"), ("remove", "/nowhere")]
    assert os.listdir(str(tmp_path)) == []
    os.mkdir(str(tmp_path / "d"))
    with pytest.raises(f.FilesError, match="/d exists and is a directory"):
        f.plan(entries(dict(dest=str(tmp_path / "d"), state="absent")))


def test_a_missing_directory_fails_except_in_check_mode(tmp_path):
    dest = str(tmp_path / "missing" / "conf")
    want = entries(dict(dest=dest, content="", mode="0644"))
    with pytest.raises(f.FilesError, match="its directory .*/missing does not exist"):
        f.plan(want)
    assert [c.kind for c in f.plan(want, check_mode=True)] == ["create"]


def test_the_diff_shows_content_links_attrs_and_removal(tmp_path):
    dest, link = str(tmp_path / "c"), str(tmp_path / "l")
    converge(dict(dest=dest, content="a\n", mode="0644"), dict(dest=link, state="link", src="/x"))
    changes = f.plan(entries(dict(dest=dest, content="b\n", mode="0644"), dict(dest=link, state="link", src="/y")))
    assert [(d["before"], d["after"]) for d in f.diff(changes)] == [("a\n", "b\n"), ("/x\n", "/y\n")]
    (attrs,) = f.diff(f.plan(entries(dict(dest=dest, content="a\n", mode="0600"))))
    assert attrs["before"] == "mode=0644 uid=%s gid=%s\n" % (UID, GID)
    assert attrs["after"] == "mode=0600 uid=%s gid=%s\n" % (UID, GID)
    (gone,) = f.diff(f.plan(entries(dict(dest=dest, state="absent"))))
    assert (gone["before"], gone["after"], gone["after_header"]) == ("a\n", "", dest + " (absent)")
    (big,) = f.diff(f.plan(entries(dict(dest=str(tmp_path / "big"), content="z" * (f.DIFF_MAX + 1), mode="0644"))))
    assert big["after"] == "(%d bytes, not shown)\n" % (f.DIFF_MAX + 1)


def test_owner_changes_are_chowned_before_the_mode():
    fake = os.stat_result((stat.S_IFREG | 0o2750, 0, 0, 1, 1000, 1000, 0, 0, 0, 0))
    want = f.wanted_entries([dict(dest="/srv/w", content="x", mode="02750", owner="524288", group="1000")], "0", "0")
    (change,) = f.plan(want, lstat_fn=lambda p: fake, read=lambda p: b"x")
    assert change.kind == "attrs"
    calls = []
    f.apply([change], run=None, chown=lambda *a: calls.append(("chown",) + a),
            chmod=lambda *a: calls.append(("chmod",) + a))
    assert calls == [("chown", "/srv/w", 524288, 1000), ("chmod", "/srv/w", 0o2750)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(["file", "link", "absent"]),
                          st.text(max_size=20), st.sampled_from(["0600", "0644", "0755"])),
                min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_after_apply_nothing_differs(tmp_path_factory, items):
    root = str(tmp_path_factory.mktemp("prop"))
    for rounds in range(2):  # a second round over what the first made: every state over every state
        want = []
        for name, state, text, mode in items if rounds == 0 else reversed(items):
            entry = dict(dest=os.path.join(root, name), state=state)
            if state == "file":
                entry.update(content=text, mode=mode)
            elif state == "link":
                entry.update(src="/target/" + text.replace("\0", "0"))  # a NUL is refused (above)
            want.append(entry)
        for entry in want:  # a link cannot replace a file: the test removes it first, as an operator would
            if entry["state"] == "link" and os.path.lexists(entry["dest"]) and not os.path.islink(entry["dest"]):
                os.unlink(entry["dest"])
        converge(*want)
        assert f.plan(entries(*want)) == []
        for entry in want:
            if entry["state"] == "file":
                assert open(entry["dest"], encoding="utf-8", newline="").read() == entry["content"]
                assert mode_of(entry["dest"]) == int(entry["mode"], 8)
            elif entry["state"] == "link":
                assert os.readlink(entry["dest"]) == entry["src"]
            else:
                assert not os.path.lexists(entry["dest"])


def run(capsys, **args):
    return run_module(module, capsys, **args)


def test_module_check_mode_then_changed_then_ok(tmp_path, capsys):
    spec = [dict(dest=str(tmp_path / "conf"), content="c\n", mode="0644"),
            dict(dest=str(tmp_path / "link"), state="link", src="conf")]
    checked = run(capsys, check=True, diff=True, files=spec, owner=UID, group=GID)
    assert checked["changed"] and checked["changed_files"] == [e["dest"] for e in spec]
    assert checked["diff"][0]["after"] == "c\n" and not os.path.lexists(spec[0]["dest"])
    done = run(capsys, files=spec, owner=UID, group=GID)
    assert done["changed"] and open(spec[1]["dest"]).read() == "c\n"
    again = run(capsys, diff=True, files=spec, owner=UID, group=GID)
    assert not again["changed"] and again["changed_files"] == [] and "diff" not in again


def test_module_names_the_bad_entry(tmp_path, capsys):
    bad = run(capsys, files=[dict(dest=str(tmp_path / "x"), content="", mode="0644", validate="false %s")],
              owner=UID, group=GID)
    assert bad["failed"] and bad["msg"].startswith("chv.fleet.files: %s: validate (false %%s) failed" % (tmp_path / "x"))
    assert os.listdir(str(tmp_path)) == []
