"""site.yml validates every targeted host before the first one changes:
its first play runs the checks (the rollout settings, the roles' argument
specs and validate entry points, pool overlaps, the shared settings, the
preflight) over all hosts at once, and a host that fails them ends the run
there, before the deploy play's canary batch starts.

Three hosts, each this machine (ansible_connection local), `--check --tags
nothing` as in test_site_rollout.py. Each host's Python is a wrapper that
runs it in a mount namespace of its own in which /proc/1/comm says systemd
(the rollout's support check skips a host without systemd) and
/sys/fs/cgroup is a tmpfs with a cgroup.controllers file (the preflight's
cgroup2 check; this machine's hierarchy may be another), so that every
check runs on every host as on a Debian 12 guest. Needs root."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from playbook_output import DEPLOY_PLAY, batches, recap
from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
VALIDATE_PLAY = "PLAY [Validate every targeted host before the first change]"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="mount namespaces (unshare, mount --bind) need root")

WRAPPER = """#!/bin/sh
# {python} with /proc/1/comm saying systemd and a cgroup2-looking
# /sys/fs/cgroup, in a mount namespace of its own (gone with it)
exec unshare --mount --propagation private /bin/sh -c '
mount --bind "$0/comm" /proc/1/comm || exit 97
mount -t tmpfs chv-fake-cgroup /sys/fs/cgroup && : > /sys/fs/cgroup/cgroup.controllers || exit 97
exec "$@"' {fake} {python} "$@"
"""
HOSTS = ("h1", "h2", "h3")


def site(tmp_path, last_host_vars, playbook="site.yml", more_hosts=None, host_vars=None):
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "comm").write_text("systemd\n")
    wrapper = fake / "python"
    wrapper.write_text(WRAPPER.format(fake=fake, python=sys.executable))
    wrapper.chmod(0o755)
    hosts = dict((h, {"ansible_connection": "local", "ansible_python_interpreter": str(wrapper)}) for h in HOSTS)
    hosts[HOSTS[-1]].update(last_host_vars)
    for host, values in (host_vars or {}).items():
        hosts[host].update(values)
    hosts.update(more_hosts or {})
    (tmp_path / "inventory.yml").write_text(json.dumps({"all": {"children": {"chv_fleet": {"hosts": hosts}}}}))
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           os.path.join(ROOT, playbook), "--check", "--tags", "nothing"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    return proc, proc.stdout + proc.stderr


def test_a_bad_value_on_the_last_host_fails_the_run_before_the_canary_batch(tmp_path):
    # h3, the last host of the last batch, has a value of the wrong type for a cell_runtime option
    proc, out = site(tmp_path, {"chv_cell_claim_timeout": "soon"})
    assert proc.returncode != 0, out[-3000:]
    assert VALIDATE_PLAY in out, out[-3000:]
    failed = re.findall(r"^fatal: \[([\w-]+)\]: FAILED! => (.*)$", out, re.M)
    assert [host for host, _ in failed] == ["h3"], failed
    assert "chv_cell_claim_timeout" in failed[0][1] and "soon" in failed[0][1], failed
    # the deploy play, whose first batch is the canary h1, never started: no host of it ran a task
    assert DEPLOY_PLAY not in out and batches(out) == [], out[-3000:]
    assert all(recap(out)[h]["changed"] == 0 for h in HOSTS), recap(out)


def test_control_the_same_fleet_without_the_bad_value_is_validated_once_then_rolled_out_batch_by_batch(tmp_path):
    proc, out = site(tmp_path, {"chv_cell_claim_timeout": 45})
    assert proc.returncode == 0, out[-3000:]
    validation = out.split(VALIDATE_PLAY, 1)[1].split(DEPLOY_PLAY, 1)[0]
    # every host ran every check of the validation play, the preflight last, before the first batch
    preflight = validation.split("TASK [Check that the host can run cells (preflight)]", 1)[1].split("TASK [", 1)[0]
    assert sorted(re.findall(r"^ok: \[([\w-]+)\]", preflight, re.M)) == list(HOSTS), validation[-3000:]
    assert batches(out) == [["h1"], ["h2"], ["h3"]], out[-3000:]
    # a banner at the start of each batch: its number, the number of batches and its hosts
    banners = re.findall(r"^included: \S+/batch\.yml for [\w-]+ => \(item=(batch \d+ of \d+ .*)\)$", out, re.M)
    assert banners == ["batch 1 of 3 (1 of 3 hosts): h1", "batch 2 of 3 (1 of 3 hosts): h2",
                       "batch 3 of 3 (1 of 3 hosts): h3"], banners
    # the run's last lines, one per host (the fleet_summary callback, enabled by the clone's ansible.cfg)
    summary = out.split("CHV.FLEET SUMMARY", 1)[1]
    for i, h in enumerate(HOSTS, 1):
        assert re.search(r"^%s: ok, changed=0, batch: %d of 3, path: full \(no stamp of an earlier converge\), gate: not run$" % (h, i), summary, re.M), summary
    # the roles' validate entry points ran in the validation play only, not again in each batch
    assert "Check the variables against the main entry point's argument spec" not in out.split(DEPLOY_PLAY, 1)[1]


def test_the_fleet_check_looks_at_every_host_and_names_each(tmp_path):
    """chv.fleet.check: a bad value on h3 and an unreachable h4 stop nothing;
    every host is validated (the gate does not run in check mode) and the
    last play prints one line per host; the run fails."""
    dead = {"h4": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1}}
    proc, out = site(tmp_path, {"chv_cell_claim_timeout": "soon"}, playbook="playbooks/check.yml", more_hosts=dead)
    assert proc.returncode != 0, out[-3000:]
    lines = out.split("TASK [Print one line per host]", 1)[1]
    for expected in ('"h1: validated; gate not run"', '"h2: validated; gate not run"',
                     '"h3: no gate: FAILED the validation or skipped (above)"', '"h4: UNREACHABLE"'):
        assert expected in lines, lines
    # the preflight, the validation's last check, ran on h1 and h2 after h3 failed: no threshold stopped them
    preflight = out.split("TASK [Check that the host can run cells (preflight)]", 1)[1].split("TASK [", 1)[0]
    assert sorted(re.findall(r"^ok: \[([\w-]+)\]", preflight, re.M)) == ["h1", "h2"], preflight
    # control: site.yml with the same hosts stops at the validation (h4 alone is over the allowance)
    proc, out = site(tmp_path, {}, more_hosts=dead)
    assert proc.returncode != 0 and DEPLOY_PLAY not in out, out[-3000:]


def test_hosts_whose_cell_pools_overlap_fail_naming_each_other_from_one_read_of_the_pools(tmp_path):
    # h1 and h3 overlap, h2 overlaps neither
    pools = {"h1": {"chv_cell_pool": "10.210.0.0/16"}, "h2": {"chv_cell_pool": "10.211.0.0/16"}}
    proc, out = site(tmp_path, {"chv_cell_pool": "10.210.128.0/17"}, host_vars=pools)
    assert proc.returncode != 0 and DEPLOY_PLAY not in out, out[-3000:]
    failed = dict(re.findall(r"^fatal: \[([\w-]+)\]: FAILED! => (.*)$", out, re.M))
    assert sorted(failed) == ["h1", "h3"], failed
    assert "h1: chv_cell_pool 10.210.0.0/16 overlaps h3's chv_cell_pool 10.210.128.0/17" in failed["h1"], failed
    assert "h3: chv_cell_pool 10.210.128.0/17 overlaps h1's chv_cell_pool 10.210.0.0/16" in failed["h3"], failed
    # every host's pool was read and the pairs compared once for the run (run_once), not by each host
    read = out.split("TASK [Read every targeted host's cell pool", 1)[1].split("TASK [", 1)[0]
    assert re.findall(r"^ok: \[([\w-]+)\]", read, re.M) == ["h1"], read
    # control: the same hosts with disjoint pools pass every check
    proc, out = site(tmp_path, {"chv_cell_pool": "10.212.0.0/16"}, host_vars=pools)
    assert proc.returncode == 0, out[-3000:]


def test_a_health_gate_destination_that_is_no_host_port_fails_naming_it(tmp_path):
    proc, out = site(tmp_path, {"chv_fleet_health_allow": ["pypi.org"]})
    assert proc.returncode != 0 and DEPLOY_PLAY not in out, out[-3000:]
    failed = dict(re.findall(r"^fatal: \[([\w-]+)\]: FAILED! => (.*)$", out, re.M))
    assert sorted(failed) == ["h3"], failed
    assert ('chv_fleet_health_allow must be a list of HOST:PORT or [IPv6]:PORT strings, got [\\"pypi.org\\"]'
            in failed["h3"]), failed
    # control: the same destination with its port passes every check
    proc, out = site(tmp_path, {"chv_fleet_health_allow": ["pypi.org:443"]})
    assert proc.returncode == 0, out[-3000:]
