"""The roles' validate entry points check main's options (their argument
specs document none of their own), which site.yml relies on; main's own
start checks them once, through ansible-core.

One playbook on this machine (ansible_connection local, --check; the
validate entry points change nothing): for each role, a value of the wrong
type for an option that only the argument spec checks fails the validate
entry point at that check, naming the variable; beside it, the control, the
same entry point with a good value passes. --list-tasks of a play that runs
each role's main lists ansible-core's check of main's spec once and no
second one."""

import json
import os
import re
import subprocess
import sys

import pytest

from testpaths import LIST_TASKS, ROOT

BIN = os.path.dirname(sys.executable)
# one option per role that only the argument spec looks at (no semantic check reads it)
BAD = {"cell_runtime": ("chv_cell_claim_timeout", "soon", 45),
       "cell_nat": ("cell_nat_ratelimit", "many", 5),
       "broker": ("chv_broker_sync_timeout", "soon", 60),
       "browser": ("chv_browser_idle_timeout", "soon", 120)}
SPEC_TASK = "Check the variables against the main entry point's argument spec"
# a check the spec cannot express, of each role (tasks/checks.yml): main runs them, as validate does
CHECKS = {"cell_runtime": "Check the cells' settings (slots, chv_cell_ifname_prefix, host paths, apt pins, layered lists, "
                          "fail-closed settings, agent user, cell policy)",
          "cell_nat": "Validate the policy, discover the uplink and list foreign firewall chains",
          "broker": "Check semantic constraints the argument spec cannot express",
          "browser": "Check semantic constraints the argument spec cannot express"}

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  vars:
    outcomes: {{}}
  tasks:
{cases}
    - name: Report
      ansible.builtin.copy:
        content: "{{{{ outcomes | to_json }}}}"
        dest: {out}
        mode: "0600"
      check_mode: false
"""
CASE = """
    - name: "{role} {kind}"
      block:
        - name: Run the validate entry point
          ansible.builtin.include_role:
            name: chv.fleet.{role}
            tasks_from: validate
          vars: {vars}
        - name: Record the pass
          ansible.builtin.set_fact:
            outcomes: "{{{{ outcomes | combine({{'{role} {kind}': 'passed'}}) }}}}"
      rescue:
        - name: Record where and why it failed
          ansible.builtin.set_fact:
            outcomes: "{{{{ outcomes | combine({{'{role} {kind}': {{'task': ansible_failed_task.name,
                                                 'errors': ansible_failed_result.argument_errors | default([]),
                                                 'msg': ansible_failed_result.msg}}}}) }}}}"
"""


def ansible_playbook(tmp_path, text, *args, program=None):
    """program: ansible-playbook, or tests/helpers/list_tasks.py (the roles' Linux task files listed too)."""
    (tmp_path / "play.yml").write_text(text)
    return subprocess.run((program or [os.path.join(BIN, "ansible-playbook")]) + [
                           "-i", "localhost,", "-c", "local",
                           "-e", "ansible_python_interpreter=" + sys.executable, str(tmp_path / "play.yml")]
                          + list(args), capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1", CHV_LIST_SYSTEM="Linux"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("checks")
    cases = "".join(CASE.format(role=role, kind=kind, vars=json.dumps({name: value}))
                    for role, (name, bad, good) in sorted(BAD.items())
                    for kind, value in (("bad", bad), ("good", good)))
    proc = ansible_playbook(tmp_path, PLAYBOOK.format(cases=cases, out=tmp_path / "outcomes.json"), "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "outcomes.json").read_text())


@pytest.mark.parametrize("role", sorted(BAD))
def test_validate_checks_mains_options(outcomes, role):
    name, bad, _good = BAD[role]
    failed = outcomes["%s bad" % role]
    assert failed["task"] == "%s of chv.fleet.%s" % (SPEC_TASK, role), failed
    assert [e for e in failed["errors"] if name in e], failed
    # control: the same entry point with a value of the right type
    assert outcomes["%s good" % role] == "passed"


def test_main_checks_its_spec_once(tmp_path):
    text = "- hosts: localhost\n  gather_facts: false\n  roles:\n" + "".join(
        "    - chv.fleet.%s\n" % role for role in sorted(BAD))
    proc = ansible_playbook(tmp_path, text, "--list-tasks", program=[sys.executable, LIST_TASKS])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for role in BAD:
        tasks = re.findall(r"^\s+chv\.fleet\.%s : (.*?)\tTAGS:" % role, proc.stdout, re.M)
        assert tasks, proc.stdout[-3000:]
        assert len([t for t in tasks if t.startswith("Validating arguments against arg spec 'main'")]) == 1, tasks
        assert not [t for t in tasks if t.startswith(SPEC_TASK)], tasks
        # control: the checks main shares with the validate entry point are listed, once
        assert tasks.count(CHECKS[role]) == 1, tasks


# cell_runtime's checks are one task (tasks/checks.yml), each check a list of messages taken in order
# until one fails: a bad value for each check, its message (naming the variable and the value), and a
# case with two bad values that reports the first check's only
CELL_CHECKS = {
    "slot": ({"chv_cell_slots": 0}, "chv_cell_slots 0 must be a count >= 1 or a non-empty list"),
    "ifname": ({"chv_cell_ifname_prefix": "averyveryverylongprefix"},
               'chv_cell_ifname_prefix "averyveryverylongprefix" leaves no room for the slot index'),
    "path": ({"chv_cell_ledger": "var/ledger.json"}, 'chv_cell_ledger "var/ledger.json" must be absolute'),
    "apt_pin": ({"chv_cell_apt_pins": [{"package": "Bad Name", "version": "1"}]},
                'chv_cell_apt_pins entries need a Debian package name and a version pattern'),
    "list": ({"chv_cell_syscall_deny": ["@raw-io"]}, 'chv_cell_syscall_deny* entries are bare syscall names'),
    "fail_closed": ({"chv_cell_task_ttl": 0}, "chv_cell_task_ttl (0) is 1 to 604800 seconds"),
    "agent": ({"chv_cell_agent_home": "/home/a b"},
              "chv_cell_agent_home (\"/home/a b\") and every chv_cell_workspace_aliases entry"),
    "policy": ({"chv_cell_workspace_root": "var/lib/chv-fleet/workspaces"},
               "chv_cell_workspace_root: 'var/lib/chv-fleet/workspaces' must be an absolute normalised path"),
    "first": ({"chv_cell_slots": 0, "chv_cell_agent_home": "/home/a b"}, "chv_cell_slots 0 must be a count"),
}


@pytest.fixture(scope="module")
def cell_outcomes(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cell_checks")
    cases = "".join(CASE.format(role="cell_runtime", kind=kind, vars=json.dumps(values))
                    for kind, (values, _needle) in sorted(CELL_CHECKS.items()))
    cases += CASE.format(role="cell_runtime", kind="good", vars=json.dumps({}))
    proc = ansible_playbook(tmp_path, PLAYBOOK.format(cases=cases, out=tmp_path / "outcomes.json"), "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "outcomes.json").read_text())


@pytest.mark.parametrize("kind", sorted(CELL_CHECKS))
def test_each_cell_runtime_check_names_its_variable(cell_outcomes, kind):
    failed = cell_outcomes["cell_runtime %s" % kind]
    assert failed != "passed" and failed["task"].startswith("Check the cells' settings"), failed
    assert CELL_CHECKS[kind][1] in failed["msg"], failed
    assert "\\" not in failed["msg"], failed  # no escape left over from the template's string literals
    if kind == "first":
        assert "chv_cell_agent_home" not in failed["msg"], failed
    # control: the same entry point with the role's values passes every check
    assert cell_outcomes["cell_runtime good"] == "passed"
