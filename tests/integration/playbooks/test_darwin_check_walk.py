"""The macOS task paths walked in check mode on this Linux machine: no
macOS machine is available, so a local host is given a Mac's facts
(system and os_family Darwin, distribution MacOSX 14, service manager
launchd: a module of this test returns them as facts, as the setup module
would on a Mac) and the four roles run on it as site.yml runs them (each
role's validate entry point, then the roles), with `--check`. A callback of
this test records every task result with its file and line.

Checks: the run succeeds; every task of every darwin task file
(roles/*/tasks/darwin.yml, the _common role's launchd.yml and
rundirs.yml and the cell_nat role's pf_anchor.yml, which they
include) got a result on the host and none failed; no task of a
Linux task file is listed, not even as skipped; and nothing on this
machine changed (the files the macOS tasks would write, the user and
group databases). The launchd entry
point is also walked with state absent (bootout, removal). Runs in a few
tens of seconds, as root or not."""

import glob
import hashlib
import json
import os
import re
import subprocess
import sys

import hostlock
import pytest

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
DARWIN_FILES = sorted(glob.glob(os.path.join(ROOT, "roles", "*", "tasks", "darwin.yml"))) + [
    os.path.join(ROOT, "roles", "_common", "tasks", name) for name in ("launchd.yml", "rundirs.yml")] + [
    os.path.join(ROOT, "roles", "cell_nat", "tasks", name) for name in ("pf_anchor.yml",)]
# What the macOS tasks would write on a Mac, and what account tasks would change.
WATCHED = ["/etc/synthetic.conf", "/etc/pf.anchors", "/Library", "/etc/chv-fleet/seatbelt", "/private",
           "/etc/passwd", "/etc/group", "/etc/shadow", "/etc/sudoers.d", "/var/lib/chv-fleet", "/usr/lib/chv-fleet",
           "/etc/chv-fleet", "/opt/chv-browser", "/usr/local/bin/chv-cell", "/run/chv", "/run/chv-fleet"]

FACTS_MODULE = '''#!/usr/bin/python
from ansible.module_utils.basic import AnsibleModule
m = AnsibleModule(argument_spec={}, supports_check_mode=True)
m.exit_json(changed=False, ansible_facts={
    "system": "Darwin", "os_family": "Darwin", "distribution": "MacOSX", "distribution_major_version": "14",
    "distribution_version": "14.5", "distribution_release": "23.5.0", "service_mgr": "launchd",
    "kernel": "23.5.0", "architecture": "arm64", "machine": "arm64"})
'''

CALLBACK = '''
import json
from ansible.plugins.callback import CallbackBase

class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "walk_record"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.records = []

    def _add(self, result, status):
        task = result._task
        self.records.append({"path": task.get_path(), "name": task.get_name(), "host": result._host.get_name(),
                             "status": status, "changed": bool(result._result.get("changed")),
                             "msg": str(result._result.get("msg", ""))[:300]})

    def v2_runner_on_ok(self, result):
        self._add(result, "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._add(result, "ignored" if ignore_errors else "failed")

    def v2_runner_on_skipped(self, result):
        self._add(result, "skipped")

    def v2_runner_on_unreachable(self, result):
        self._add(result, "unreachable")

    def v2_playbook_on_stats(self, stats):
        with open(__import__("os").environ["WALK_RECORD"], "w") as fh:
            json.dump(self.records, fh)
'''

PLAYBOOK = '''
- name: Walk chv.fleet's macOS tasks in check mode (a Mac's facts on a local connection)
  hosts: mac
  gather_facts: false
  vars:
    # per-host settings a macOS host needs (docs/macos.md)
    chv_cell_agent_home: /Users/chv
    chv_browser_executable_path: /Applications/Chromium.app/Contents/MacOS/Chromium
  tasks:
    - name: Give the host a Mac's facts
      darwin_facts:

    - name: Check every role's variables first, as site.yml does
      ansible.builtin.include_role:
        name: "chv.fleet.{{ role }}"
        tasks_from: validate
      loop: [cell_runtime, cell_nat, broker, browser]
      loop_control:
        loop_var: role

    - name: Run the roles in site.yml's order
      ansible.builtin.include_role:
        name: "chv.fleet.{{ role }}"
      loop: [cell_runtime, cell_nat, broker, browser]
      loop_control:
        loop_var: role

    - name: Remove a LaunchDaemon (the launchd entry point, state absent)
      ansible.builtin.include_role:
        name: chv.fleet._common
        tasks_from: launchd
      vars:
        __chv_launchd_label: org.chv-fleet.walk-test
        __chv_launchd_content: ""
        __chv_launchd_state: absent
'''


def task_lines(path):
    """The line of each task of a task file (its "- name:" line), static
    imports left out (their tasks run in their place; the checks they
    import are the Linux path's too), and meta tasks (flush_handlers
    reports no result)."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    starts = [i for i, line in enumerate(lines) if re.match(r"^- name: ", line)]
    out = []
    for k, start in enumerate(starts):
        body = lines[start:starts[k + 1] if k + 1 < len(starts) else len(lines)]
        if not any(re.match(r"^  ansible\.builtin\.(import_tasks|meta):", line) for line in body):
            out.append(start + 1)
    return out


def snapshot():
    out = {}
    for path in WATCHED:
        if os.path.isdir(path):
            entries = []
            for base, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files) + dirs:
                    p = os.path.join(base, name)
                    st = os.lstat(p)
                    entries.append((p, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns))
            out[path] = entries
        elif os.path.exists(path):
            with open(path, "rb") as fh:
                out[path] = hashlib.sha256(fh.read()).hexdigest()
        else:
            out[path] = None
    return out


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("darwin-walk")
    (tmp / "library").mkdir()
    (tmp / "library" / "darwin_facts.py").write_text(FACTS_MODULE)
    (tmp / "callbacks").mkdir()
    (tmp / "callbacks" / "walk_record.py").write_text(CALLBACK)
    (tmp / "walk.yml").write_text(PLAYBOOK)
    (tmp / "inventory.yml").write_text(json.dumps({"all": {"hosts": {"mac": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LIBRARY=str(tmp / "library"),
               ANSIBLE_CALLBACK_PLUGINS=str(tmp / "callbacks"), ANSIBLE_CALLBACKS_ENABLED="walk_record",
               ANSIBLE_RETRY_FILES_ENABLED="0", WALK_RECORD=str(tmp / "record.json"), ANSIBLE_ROLES_PATH="",
               ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-local"), ANSIBLE_REMOTE_TEMP=str(tmp / "ansible-remote"))
    env["ANSIBLE_COLLECTIONS_PATH"] = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # this checkout (tests/conftest.py)
    syntax = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp / "inventory.yml"),
                             str(tmp / "walk.yml"), "--syntax-check"], capture_output=True, text=True, env=env,
                            cwd=str(tmp), check=False, timeout=300)
    with hostlock.unchanged():  # no other test of make test's lanes changes the accounts meanwhile
        before = snapshot()
        proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp / "inventory.yml"),
                               str(tmp / "walk.yml"), "--check", "--diff"], capture_output=True, text=True, env=env,
                              cwd=str(tmp), check=False, timeout=600)
        after = snapshot()
    with open(tmp / "record.json", encoding="utf-8") as fh:
        records = json.load(fh)
    return syntax, proc, records, before, after


def test_the_walk_playbook_passes_the_syntax_check(walk):
    syntax = walk[0]
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr


def test_the_check_run_succeeds(walk):
    _syntax, proc, records, _b, _a = walk
    failed = [r for r in records if r["status"] in ("failed", "unreachable")]
    assert proc.returncode == 0 and failed == [], (failed, proc.stdout[-4000:])


@pytest.mark.parametrize("path", DARWIN_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_task_of_the_darwin_file_was_walked_without_error(walk, path):
    records = walk[2]
    seen = {}
    for r in records:
        file_, _, line = r["path"].rpartition(":")
        if os.path.realpath(file_) == os.path.realpath(path):
            seen.setdefault(int(line), set()).add(r["status"])
    lines = task_lines(path)
    assert lines, path
    missing = [n for n in lines if n not in seen]
    assert missing == [], "tasks at lines %s of %s got no result" % (missing, path)
    assert all("failed" not in s and "unreachable" not in s for s in seen.values()), seen


def test_no_linux_task_is_listed(walk):
    """Each role includes only its platform's task file (tasks/main.yml: "{{ ansible_facts['system'] | lower
    }}.yml"): no task of a linux.yml got a result, not even a skip, and the output names no linux.yml; the
    darwin.yml of every role did run (the control: the same records hold them)."""
    _syntax, proc, records, _b, _a = walk
    linux = [r for r in records if re.search(r"/tasks/linux\.yml:", r["path"])]
    assert linux == [], sorted({(r["path"], r["status"]) for r in linux})
    assert "linux.yml" not in proc.stdout
    darwin = {os.path.relpath(os.path.realpath(r["path"].rpartition(":")[0]), ROOT) for r in records
              if re.search(r"/tasks/darwin\.yml:", r["path"])}
    assert darwin == {os.path.relpath(p, ROOT) for p in DARWIN_FILES if p.endswith("/darwin.yml")}, darwin


def test_nothing_on_this_machine_changed(walk):
    _syntax, _proc, _records, before, after = walk
    assert after == before


def test_the_walk_counts(walk, capsys):
    """How many darwin tasks ran and how many were skipped (printed for the report, checked: some of each)."""
    records = walk[2]
    darwin = [r for r in records if any(os.path.realpath(r["path"].rpartition(":")[0]) == os.path.realpath(p)
                                        for p in DARWIN_FILES)]
    statuses = {}
    for r in darwin:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    with capsys.disabled():
        sys.stdout.write("\n[darwin walk] %d task results in the darwin files (%s); %d distinct tasks\n"
                         % (len(darwin), ", ".join("%s %d" % kv for kv in sorted(statuses.items())),
                            sum(len(task_lines(p)) for p in DARWIN_FILES)))
    assert statuses.get("ok", 0) > 0 and statuses.get("skipped", 0) > 0


def test_the_browser_renders_the_anchor_again_with_its_door_uid(walk):
    """The door: after the browser role writes chv-browser's uid drop-in, the
    cell_nat role's pf entry point renders the anchor again in the same run
    (its render task has a result from the cell_nat role and one from the
    browser's include), so chv-browser never runs without the cells' rules."""
    records = walk[2]
    render = os.path.join(ROOT, "roles", "cell_nat", "tasks", "pf_anchor.yml")
    line = next(n for n in task_lines(render)
                if "pf-anchor.conf.j2" in "".join(open(render, encoding="utf-8").readlines()[n - 1:n + 3]))
    results = [r for r in records if os.path.realpath(r["path"].rpartition(":")[0]) == os.path.realpath(render)
               and int(r["path"].rpartition(":")[2]) == line]
    assert len(results) == 2 and {r["status"] for r in results} == {"ok"}, results
