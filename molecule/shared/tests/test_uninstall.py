"""playbooks/remove.yml on the converged guest: it waits for running cells
(and with a short bound refuses, removing nothing), then leaves the guest as
the first converge found it: the same files, unit files, users, groups,
nftables tables and sysctls as the snapshot molecule/shared/converge.yml
took before the first converge (tests/helpers/host_snapshot.py).

Runs in the fleet scenario only (its image has the roles' packages baked
in, so a difference is the collection's, not a package's: on the trixie
scenario's minimal image the converge installs them, and distribution
packages stay), and last: it removes what every other test needs
(ends_the_guest)."""

import json
import os
import re
import subprocess

import pytest

from conftest import inventory_argv, only_in
from testpaths import ROOT

REMOVE = os.path.join(ROOT, "playbooks", "remove.yml")
SNAPSHOT = os.path.join(ROOT, "tests", "helpers", "host_snapshot.py")
BEFORE = "/root/chv-fleet-before.json"

pytestmark = [only_in("fleet"), pytest.mark.ends_the_guest]


def remove(*args):
    proc = subprocess.run(["ansible-playbook"] + inventory_argv() + [REMOVE] + list(args),
                          capture_output=True, text=True, check=False, timeout=900)
    return proc, proc.stdout + proc.stderr


def snapshot(host):
    with open(SNAPSHOT) as fh:
        script = fh.read()
    with host.sudo():
        return json.loads(host.check_output("python3 - <<'EOF'\n%s\nEOF" % script))


def test_remove_drains_then_leaves_the_guest_as_it_was(host):
    with host.sudo():
        before = json.loads(host.file(BEFORE).content_string)
        assert host.file("/etc/chv-fleet/cell-policy.json").exists  # control: converged
        host.run_expect([0], "systemd-run --unit=chv-molecule-drain --collect chv-cell run -- sleep 300")
        host.run_expect([0], "for i in $(seq 100); do chv-cell status | grep -q 'running pid=[0-9]*$' && exit 0; "
                             "sleep 0.1; done; exit 1")
        try:
            proc, out = remove("-e", "chv_fleet_drain_timeout=4")
            assert proc.returncode != 0 and "did not drain within chv_fleet_drain_timeout=4 s" in out, out[-3000:]
            assert "removing chv.fleet held back, nothing of it done" in out
            assert host.file("/etc/chv-fleet/cell-policy.json").exists
            assert host.service("chv-broker.socket").is_running
        finally:
            host.run("systemctl stop chv-molecule-drain")
    proc, out = remove()
    assert proc.returncode == 0, out[-4000:]
    after = snapshot(host)
    added = sorted(set(after["files"]) - set(before["files"]) - {BEFORE})  # the snapshot itself
    removed = sorted(set(before["files"]) - set(after["files"]))
    assert (added, removed) == ([], []), (added[:50], removed[:50])
    for key in ("units", "users", "groups", "nft_tables", "sysctls"):
        assert after[key] == before[key], (key, before[key], after[key])
    # a second run finds nothing to remove
    proc, out = remove()
    assert proc.returncode == 0 and re.search(r"\bchanged=0\b", out.split("PLAY RECAP")[-1]), out[-3000:]
