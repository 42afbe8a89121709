"""chv.fleet.package_sync: what the roles copy and remove so that an
installed package equals the role's files, checked against the output of
ansible.builtin.find itself (the module the roles run)."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.package_sync import GUEST_TREE, SRC, guest_tree, package_files, package_sync


def _entry(path, data, mode="0644", uid=0, gid=0):
    return {"path": path, "checksum": hashlib.sha1(data).hexdigest(), "mode": mode, "uid": uid, "gid": gid,
            "isreg": True, "islnk": False}


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_bytes(b"A = 1\n")
    (src / "run.py").write_bytes(b"#!/usr/bin/python3\nprint(1)\n")
    return [str(src / "run.py"), str(src / "a.py")]


def test_a_fresh_host_gets_every_file_with_its_mode(sources):
    assert package_sync(sources, []) == {
        "install": [{"src": sources[1], "name": "a.py", "mode": "0644"},
                    {"src": sources[0], "name": "run.py", "mode": "0755"}],
        "remove": []}


def test_an_equal_host_gets_nothing(sources):
    installed = [_entry("/d/a.py", b"A = 1\n"), _entry("/d/run.py", b"#!/usr/bin/python3\nprint(1)\n", "0755")]
    assert package_sync(sources, installed) == {"install": [], "remove": []}


@pytest.mark.parametrize("change", [
    {"checksum": hashlib.sha1(b"A = 2\n").hexdigest()},   # content
    {"mode": "0664"},                                      # mode
    {"mode": "04644"},                                     # a setuid bit is a difference too
    {"uid": 1000},                                         # owner
    {"gid": 50},                                           # group
    {"islnk": True},                                       # a link where a file belongs
])
def test_any_difference_copies_that_file_only(sources, change):
    installed = [dict(_entry("/d/a.py", b"A = 1\n"), **change),
                 _entry("/d/run.py", b"#!/usr/bin/python3\nprint(1)\n", "0755")]
    assert package_sync(sources, installed) == {"install": [{"src": sources[1], "name": "a.py", "mode": "0644"}],
                                                "remove": []}


def test_a_file_without_a_source_is_removed(sources):
    installed = [_entry("/d/a.py", b"A = 1\n"), _entry("/d/run.py", b"#!/usr/bin/python3\nprint(1)\n", "0755"),
                 _entry("/d/old_module.py", b"")]
    assert package_sync(sources, installed)["remove"] == ["/d/old_module.py"]


@pytest.mark.parametrize("sources_, installed, needle", [
    ("a.py", [], "list of source files"),
    ([], {"files": []}, "list of source files"),
    ([], [{"path": "/d/a.py", "mode": "0644"}], "get_checksum: true"),
    ([], ["/d/a.py"], "not an entry of a find result"),
    (["/nonexistent/a.py"], [], "cannot read /nonexistent/a.py"),
    (["/x/a.py", "/y/a.py"], [], "two sources named a.py"),
])
def test_bad_input_is_refused_naming_it(sources_, installed, needle):
    with pytest.raises(AnsibleFilterError, match=needle):
        package_sync(sources_, installed)


def test_against_the_find_module(tmp_path, sources):
    """The real find module's result (run by ansible as the roles run it),
    over an installed directory with a changed file, a file of the wrong
    mode and a file the package no longer has."""
    inst = tmp_path / "installed"
    inst.mkdir()
    (inst / "a.py").write_bytes(b"A = 0\n")
    (inst / "run.py").write_bytes(b"#!/usr/bin/python3\nprint(1)\n")
    (inst / "stale.py").write_bytes(b"")
    (inst / "__pycache__").mkdir()
    os.chmod(str(inst / "a.py"), 0o644)
    os.chmod(str(inst / "run.py"), 0o644)
    ansible = os.path.join(os.path.dirname(sys.executable), "ansible")
    proc = subprocess.run([ansible, "localhost", "-c", "local", "-m", "ansible.builtin.find", "-a",
                           json.dumps({"paths": str(inst), "get_checksum": True})],
                          capture_output=True, text=True, check=True, env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    found = json.loads(proc.stdout.split("=>", 1)[1])["files"]
    uid, gid = os.getuid(), os.getgid()
    result = package_sync(sources, found, uid=uid, gid=gid)
    assert result == {"install": [{"src": sources[1], "name": "a.py", "mode": "0644"},
                                  {"src": sources[0], "name": "run.py", "mode": "0755"}],
                      "remove": [str(inst / "stale.py")]}
    # once the directory equals the sources, nothing is left to do
    (inst / "a.py").write_bytes(b"A = 1\n")
    os.chmod(str(inst / "run.py"), 0o755)
    os.unlink(str(inst / "stale.py"))
    proc = subprocess.run(proc.args, capture_output=True, text=True, check=True,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    found = json.loads(proc.stdout.split("=>", 1)[1])["files"]
    assert package_sync(sources, found, uid=uid, gid=gid) == {"install": [], "remove": []}


# ------------------------------------------------------------- the guest tree (src/)

def test_names_relative_to_the_install_directory_keep_packages_apart(tmp_path):
    """With ``root``, a source is installed under its ``name`` and an installed file is
    named by its path below ``root``: two packages' files of the same name stay apart."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "server.py").write_bytes(b"A = 1\n")
    (tmp_path / "b" / "server.py").write_bytes(b"B = 1\n")
    sources = [{"src": str(tmp_path / "a" / "server.py"), "name": "pkg/a/server.py"},
               {"src": str(tmp_path / "b" / "server.py"), "name": "pkg/b/server.py"}]
    installed = [_entry("/lib/pkg/a/server.py", b"A = 1\n"), _entry("/lib/pkg/b/server.py", b"B = 0\n"),
                 _entry("/lib/pkg/b/old.py", b"")]
    assert package_sync(sources, installed, root="/lib") == {
        "install": [{"src": sources[1]["src"], "name": "pkg/b/server.py", "mode": "0644"}],
        "remove": ["/lib/pkg/b/old.py"]}
    # without root the same two files would be one name: refused
    with pytest.raises(AnsibleFilterError, match="two sources named"):
        package_sync([s["src"] for s in sources], [])


def test_retired_directories_go_with_the_first_copy_only(tmp_path):
    (tmp_path / "new.py").write_bytes(b"N = 1\n")
    sources = [{"src": str(tmp_path / "new.py"), "name": "pkg/new.py"}]
    # a host of the earlier layout: the new file is missing, the old directory goes
    assert package_sync(sources, [], root="/lib", retired=["/lib/old_pkg"]) == {
        "install": [{"src": sources[0]["src"], "name": "pkg/new.py", "mode": "0644"}],
        "remove": ["/lib/old_pkg"]}
    # a host with every current file: nothing to do, the retired directory is not listed
    assert package_sync(sources, [_entry("/lib/pkg/new.py", b"N = 1\n")], root="/lib",
                        retired=["/lib/old_pkg"]) == {"install": [], "remove": []}


@pytest.mark.parametrize("role", sorted(GUEST_TREE))
def test_each_role_gets_every_file_of_its_part_of_src(role):
    tree = guest_tree(role, "/usr/lib/chv-fleet/")
    names = [s["name"] for s in tree["sources"]]
    expected = sorted(os.path.join(package, n) for package in GUEST_TREE[role]["packages"]
                      for n in os.listdir(os.path.join(SRC, package)) if n.endswith(".py"))
    assert sorted(names) == expected and len(names) == len(set(names))
    assert all(s["src"] == os.path.join(SRC, s["name"]) for s in tree["sources"])
    assert tree["dirs"][0] == "/usr/lib/chv-fleet/chv_guest"  # parents first
    assert all(d.startswith("/usr/lib/chv-fleet/chv_guest") for d in tree["dirs"])
    assert all(os.path.isfile(p) for p in tree["scripts"].values())
    assert tree["retired"] == ["/usr/lib/chv-fleet/" + d for d in GUEST_TREE[role]["retired"]]


def test_every_file_of_src_belongs_to_a_role_and_no_service_gets_the_others():
    owned = {}
    for role in GUEST_TREE:
        tree = guest_tree(role, "/x")
        for name in [s["name"] for s in tree["sources"]] + list(tree["scripts"]):
            owned.setdefault(name, set()).add(role)
    in_src = {os.path.relpath(os.path.join(d, f), SRC) for d, _dirs, files in os.walk(SRC)
              if "__pycache__" not in d for f in files}
    assert set(owned) == in_src
    # the metrics collector bounds its labels by the wire protocol's operations and the launcher's verdicts
    assert owned["chv_guest/wire/wire.py"] == {"broker", "browser", "metrics"}
    assert owned["chv_guest/cell/status.py"] == {"cell_runtime", "metrics"}
    assert owned["chv_guest/__init__.py"] == set(GUEST_TREE)
    assert not [n for n, roles in owned.items() if n.startswith("chv_guest/browser/") and roles != {"browser"}]
    assert not [n for n, roles in owned.items() if n.startswith("chv_guest/broker/") and roles != {"broker"}]


@pytest.mark.parametrize("role,root,needle", [
    ("chv_broker", "/usr/lib/chv-fleet", "no role 'chv_broker'"),
    ("broker", "usr/lib", "must be an absolute path"),
])
def test_guest_tree_refuses_bad_input_naming_it(role, root, needle):
    with pytest.raises(AnsibleFilterError, match=needle):
        guest_tree(role, root)


def test_package_files_writes_each_listed_file_byte_for_byte_under_the_root(sources):
    install = package_sync(sources, [_entry("/d/a.py", b"A = 1\n")], root="/d")["install"]
    assert [i["name"] for i in install] == ["run.py"]                       # the control: one file differs
    assert package_files(install, "/usr/lib/x/", group="wheel") == [
        {"dest": "/usr/lib/x/run.py", "content": "#!/usr/bin/python3\nprint(1)\n", "mode": "0755",
         "owner": "root", "group": "wheel"}]
    assert package_files([], "/usr/lib/x") == []


def test_package_files_of_the_guest_tree_are_every_source_with_its_text(tmp_path):
    tree = guest_tree("broker", "/usr/lib/chv-fleet")
    entries = package_files(package_sync(tree["sources"], [], root="/usr/lib/chv-fleet")["install"],
                            "/usr/lib/chv-fleet")
    assert sorted(e["dest"] for e in entries) == sorted("/usr/lib/chv-fleet/" + s["name"] for s in tree["sources"])
    for e, s in zip(entries, sorted(tree["sources"], key=lambda s: s["name"])):
        with open(s["src"], "rb") as fh:
            assert e["content"].encode("utf-8") == fh.read()


@pytest.mark.parametrize("install,root,needle", [
    ("a.py", "/d", "expects package_sync's install list"),
    ([], "d", "expects package_sync's install list"),
    ([{"src": "/x"}], "/d", "is not an entry of package_sync's install list"),
    ([{"src": "/nonexistent/a.py", "name": "a.py", "mode": "0644"}], "/d", "cannot read /nonexistent/a.py"),
])
def test_package_files_refuses_what_it_cannot_write(install, root, needle):
    with pytest.raises(AnsibleFilterError, match=re.escape(needle)):
        package_files(install, root)


def test_package_files_refuses_a_file_that_is_not_utf8(tmp_path):
    binary = tmp_path / "blob.py"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(AnsibleFilterError, match="cannot read %s as UTF-8 text" % re.escape(str(binary))):
        package_files([{"src": str(binary), "name": "blob.py", "mode": "0644"}], "/d")
