"""chv.fleet.package_sync: what the roles copy and remove so that an
installed package equals the role's files, checked against the output of
ansible.builtin.find itself (the module the roles run)."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.package_sync import package_sync


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
