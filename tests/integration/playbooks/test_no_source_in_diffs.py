"""Program files are never shown as diffs: the _common role's package entry
point (every role's Python package, the launcher's included) writes them
with diff off and names each file it installs with its sha256 instead.

One playbook on this machine (ansible_connection local), `--check --diff`
on an empty directory: the entry point reports both files as installs,
names each with the sha256 of the role's file, and prints none of their
source; beside it, the control, a plain copy of the same file into the
same directory, whose diff shows the source."""

import hashlib
import os
import re
import subprocess
import sys

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
SOURCE = "MARKER = 'the program source of a chv_guest module'\n"

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Install a package through the _common role's package entry point
      ansible.builtin.include_role:
        name: chv.fleet._common
        tasks_from: package
      vars:
        _common_package_dir: {dest}
        _common_package_sync:
          install:
            - {{src: {src}, name: one.py, mode: "0644"}}
            - {{src: {src}, name: sub/two.py, mode: "0644"}}
          remove: []

    - name: Control, a copy of the same file with its diff
      ansible.builtin.copy:
        src: {src}
        dest: {dest}/control.py
        mode: "0644"
"""


def test_the_package_entry_point_shows_checksums_not_source(tmp_path):
    src = tmp_path / "module.py"
    src.write_text(SOURCE)
    dest = tmp_path / "installed"
    dest.mkdir()
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(src=src, dest=dest))
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", "ansible_python_interpreter=" + sys.executable, str(tmp_path / "play.yml"),
                           "--check", "--diff"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    package, control = out.split("TASK [Control, a copy of the same file with its diff]", 1)
    # both files reported as installs (one chv.fleet.files run), each named by its path with the sha256 of
    # the role's file, and no source
    assert re.search(r"^TASK \[chv\.fleet\._common : Install the package files that differ from the role's, in "
                     r"%s\] \**\nchanged: \[localhost\]$" % re.escape(str(dest)), package, re.M), package
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()
    for name in ("one.py", "sub/two.py"):
        assert '"%s/%s sha256:%s"' % (dest, name, digest) in package, package
    assert "MARKER" not in package, package
    # control: the same file copied with its diff shows its source
    assert "+MARKER = 'the program source of a chv_guest module'" in control, control
    assert os.listdir(dest) == []
