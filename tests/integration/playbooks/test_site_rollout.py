"""site.yml's rollout keywords, run by ansible-playbook on throwaway inventories.

Every host but the switched-off one is this machine (ansible_connection
local) and the runs are `--check --tags nothing`: only the always-tagged
pre-tasks run (the rollout checks, fact gathering, the support check and
the role variable checks, all read-only), no role task. The switched-off
host points at a closed port on loopback: contacting it would make it
unreachable."""

import json
import os
import re
import subprocess
import sys
import yaml

from playbook_output import batches, recap
from testpaths import LIST_TASKS, ROOT

BIN = os.path.dirname(sys.executable)
LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


def site(tmp_path, group_vars=None, host_vars=None, extra=None):
    inventory = {"all": {"children": {
        "chv_fleet": {"hosts": {h: dict(LOCAL) for h in ("h1", "h2", "h3")}},
        "elsewhere": {"hosts": {"h4": dict(LOCAL)}}}}}
    for host, values in (host_vars or {}).items():
        inventory["all"]["children"]["chv_fleet"]["hosts"][host].update(values)
    if group_vars:
        inventory["all"]["children"]["chv_fleet"]["vars"] = group_vars
    (tmp_path / "inventory.yml").write_text(json.dumps(inventory))
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
            os.path.join(ROOT, "site.yml"), "--check", "--tags", "nothing"]
    if extra:
        argv += ["-e", json.dumps(extra)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    return proc, proc.stdout + proc.stderr


def test_default_rollout_is_a_canary_then_the_rest_of_chv_fleet_only(tmp_path):
    proc, out = site(tmp_path)
    # three hosts: 1, then 10 % (at least one), then the rest
    assert batches(out) == [["h1"], ["h2"], ["h3"]], out[-3000:]
    assert "h4" not in recap(out) and "[h4]" not in out


def test_batches_from_extra_vars_are_applied(tmp_path):
    proc, out = site(tmp_path, extra={"chv_fleet_batches": [2]})
    assert batches(out) == [["h1", "h2"], ["h3"]], out[-3000:]


def test_batches_from_the_inventory_are_refused_not_ignored(tmp_path):
    proc, out = site(tmp_path, group_vars={"chv_fleet_batches": [2]})
    assert proc.returncode != 0
    assert "chv_fleet_batches=[2]" in out and "Set them with -e" in out, out[-3000:]
    assert recap(out)["h1"]["failed"] == 1
    # control: the same value given with -e is accepted
    proc, out = site(tmp_path, group_vars={"chv_fleet_batches": [2]}, extra={"chv_fleet_batches": [2]})
    assert "Set them with -e" not in out, out[-3000:]


def test_a_target_from_the_inventory_is_refused(tmp_path):
    proc, out = site(tmp_path, group_vars={"chv_fleet_target": "elsewhere"})
    assert proc.returncode != 0 and 'chv_fleet_target=\\"elsewhere\\"' in out, out[-3000:]
    # control: the target given with -e runs on that group only
    proc, out = site(tmp_path, extra={"chv_fleet_target": "elsewhere"})
    assert batches(out) == [["h4"]], out[-3000:]


def test_a_switched_off_host_is_skipped_without_being_contacted(tmp_path):
    off = {"chv_fleet_enabled": False, "ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}
    proc, out = site(tmp_path, host_vars={"h2": off})
    assert "h2: chv_fleet_enabled is false; skipped, not contacted, nothing changed" in out, out[-3000:]
    assert recap(out)["h2"]["unreachable"] == 0 and recap(out)["h2"]["failed"] == 0
    # control: the same host switched on is contacted, and unreachable
    off["chv_fleet_enabled"] = True
    proc, out = site(tmp_path, host_vars={"h2": off})
    assert "1 of 3 hosts are unreachable (h2)" in out, out[-3000:]


DEAD = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}


def test_unreachable_hosts_within_the_allowance_are_skipped_and_reported(tmp_path):
    proc, out = site(tmp_path, host_vars={"h2": DEAD}, extra={"chv_fleet_max_unreachable_percentage": 40})
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"h2: unreachable \(.*\); skipped, nothing changed", out), out[-3000:]
    # the rollout's batches are those of the hosts reached: h2 is in none (h3 is the second batch)
    assert batches(out) == [["h1"], ["h3"]], out[-3000:]
    # the run's last lines: one per host (the fleet_summary callback, enabled by the clone's ansible.cfg)
    summary = out.split("CHV.FLEET SUMMARY", 1)[1]
    assert re.search(r"^h2: unreachable, skipped, changed=0$", summary, re.M), summary
    # (this machine has no systemd: the other hosts are skipped as unsupported, and say so)
    assert re.search(r"^h1: unsupported, skipped, changed=0$", summary, re.M), summary


def test_an_unsupported_host_is_skipped_saying_why_and_fails_with_chv_fleet_strict(tmp_path):
    # this machine has no systemd (PID 1): every host is unsupported (tasks/skip_host.yml)
    proc, out = site(tmp_path)
    assert proc.returncode == 0, out[-3000:]
    why = "chv.fleet cells need a Linux host managed by systemd or a macOS host (launchd)"
    assert re.search(r"h1: %s, this one has system=Linux service_mgr=\S+; skipped, nothing changed "
                     r"\(chv_fleet_strict=true fails instead\)" % re.escape(why), out), out[-3000:]
    assert all(recap(out)[h]["failed"] == 0 for h in ("h1", "h2", "h3")), out[-3000:]
    # chv_fleet_strict: the same hosts fail, with the same reason
    proc, out = site(tmp_path, extra={"chv_fleet_strict": True})
    assert proc.returncode != 0, out[-3000:]
    assert all(recap(out)[h]["failed"] == 1 for h in ("h1", "h2", "h3")), out[-3000:]
    assert [m for m in out.splitlines() if m.startswith("fatal: [h1]") and why in m], out[-3000:]
    assert batches(out) == [], out[-3000:]


def test_more_unreachable_hosts_than_the_allowance_stop_the_run_before_any_change(tmp_path):
    # the default allowance, 5 %: none of three hosts
    proc, out = site(tmp_path, host_vars={"h2": DEAD})
    assert proc.returncode != 0, out[-3000:]
    assert "1 of 3 hosts are unreachable (h2), more than chv_fleet_max_unreachable_percentage=5 allows" in out, \
        out[-3000:]
    assert batches(out) == [], out[-3000:]
    # a value that is no percentage is refused, naming it
    proc, out = site(tmp_path, extra={"chv_fleet_max_unreachable_percentage": "some"})
    assert proc.returncode != 0 and 'chv_fleet_max_unreachable_percentage must be a whole number from 0 to 100, got "some"' \
        in out, out[-3000:]


def test_bad_fast_path_settings_are_refused_naming_each_before_any_host_changes(tmp_path):
    proc, out = site(tmp_path, extra={"chv_fleet_full_converge": "sometimes", "chv_fleet_gate_max_age": "1h"})
    assert proc.returncode != 0, out[-3000:]
    assert 'chv_fleet_full_converge must be true or false, got "sometimes"' in out, out[-3000:]
    assert 'chv_fleet_gate_max_age must be a number of seconds >= 0, got "1h"' in out, out[-3000:]
    assert batches(out) == [], out[-3000:]
    # control: good values pass the same run
    proc, out = site(tmp_path, extra={"chv_fleet_full_converge": True, "chv_fleet_gate_max_age": 600})
    assert proc.returncode == 0, out[-3000:]


PHASES = ("install", "configure", "service")


def listed(tmp_path, *tags, system="Linux"):
    """site.yml's role tasks that --tags selects on a host of that system: {"role : task": set of its tags}
    (--list-tasks, with each role's platform include expanded: tests/helpers/list_tasks.py)."""
    (tmp_path / "one.yml").write_text(json.dumps({"all": {"children": {"chv_fleet": {"hosts": {"h1": dict(LOCAL)}}}}}))
    argv = [sys.executable, LIST_TASKS, "-i", str(tmp_path / "one.yml"), os.path.join(ROOT, "site.yml"),
            "--list-tasks"] + (["--tags", ",".join(tags)] if tags else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
                          env=dict(os.environ, CHV_LIST_SYSTEM=system))
    return dict((name, set(t.strip() for t in taglist.split(",")))
                for name, taglist in re.findall(r"^\s+(chv\.fleet\.\w+ : .*?)\tTAGS: \[(.*)\]$", proc.stdout, re.M)
                if "Validating arguments" not in name)


def test_each_phase_tag_selects_its_own_tasks_and_every_role_task_has_a_phase(tmp_path):
    everything = listed(tmp_path)
    phases = dict((phase, listed(tmp_path, phase)) for phase in PHASES)
    # every task of every role is in at least one phase: --tags install,configure,service runs the roles whole
    assert set(everything) == set().union(*phases.values()), set(everything) - set().union(*phases.values())
    assert all(tags & set(PHASES) for tags in everything.values())
    for phase, tasks in phases.items():
        assert all(phase in tags for tags in tasks.values()), (phase, tasks)
    # what each phase is for: code and packages; the files that carry policy; the units
    install, configure, service = (set(phases[p]) for p in PHASES)
    assert "chv.fleet.broker : Create the code and configuration directories" in install - configure
    assert ("chv.fleet.cell_runtime : Let the agent group run cells through sudo (exactly chv-cell-agent), render the cell policy, "
            "install the warm cells' units") \
        in configure - install - service
    assert "chv.fleet.cell_nat : Render the cell NAT rulesets and the forwarding settings" \
        in configure - install - service
    assert "chv.fleet.browser : Enable and start chv-browser and its socket" in service - install - configure
    assert not [t for t in configure | service if "Install the packages" in t or "Install chromium" in t]
    # the _common role's tasks (include_role, listed without their role): each writes in its own phase
    shared = {}
    for name in ("service_install.yml", "service_units.yml", "package.yml"):
        with open(os.path.join(ROOT, "roles", "_common", "tasks", name), encoding="utf-8") as fh:
            shared.update((t["name"], set(t.get("tags", []))) for t in yaml.safe_load(fh))
    assert shared["Install the package files that differ from the role's, in {{ _common_package_dir }}"] == {"install"}
    assert shared["Install the entry point of {{ _common_service.name }}"] == {"install"}
    assert shared["Render the configuration of {{ _common_service.name }}"] == {"configure"}
    assert shared["Install the systemd units of {{ _common_service.name }}"] == {"service"}


def test_a_role_tag_selects_that_roles_tasks_of_the_hosts_platform_only(tmp_path):
    """Each role includes its platform's task file (tasks/main.yml); the role's tag from site.yml
    reaches the included tasks (an include's own tags would not), and only that platform's."""
    linux_socket = "chv.fleet.broker : Enable and start the chv-broker socket"
    darwin_plist = "chv.fleet.broker : Render the chv-broker LaunchDaemon plist"
    linux = listed(tmp_path, "broker")
    assert linux_socket in linux and darwin_plist not in linux, sorted(linux)
    assert "broker" in linux[linux_socket] and "service" in linux[linux_socket]
    assert {name.split(" : ")[0] for name in linux} == {"chv.fleet.broker", "chv.fleet._common"}, sorted(linux)
    darwin = listed(tmp_path, "broker", system="Darwin")
    assert darwin_plist in darwin and linux_socket not in darwin, sorted(darwin)
    # control: another role's tag selects none of them
    assert not {linux_socket, darwin_plist} & set(listed(tmp_path, "cell_nat"))
