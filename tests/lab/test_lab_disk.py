"""The slots' disks on a converged lab guest (chv_cell_disk_max; docs/cells.md
"Disk quota"): the cell_runtime role, run for real on one lab guest with
64M disks, mounts each slot's image (loop, through the loop devices
lab_guest binds in) and binds the slot's workspace and home to it; a cell
of slot0 gets ENOSPC in its workspace while its first write succeeded, the
guest's root keeps its free space; a second converge changes nothing.
On the one-guest lab of tests/lab/conftest.py (the converge: about 1 min)."""

import json
import os
import re
import subprocess
import sys

import pytest

from labtraces import LAB_ROOT
from testpaths import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/systemd-nspawn"),
                                reason="the lab needs root and systemd-nspawn")

PLAY = """- hosts: chv_fleet
  gather_facts: false
  roles: [chv.fleet.cell_runtime]
"""
VARS = {"chv_cell_disk_max": "64M", "chv_cell_slots": 2, "chv_cell_require_ruleset": False,
        "chv_cell_require_limits": False}
WRITE = ("head -c 4096 /dev/zero > /workspace/small && echo small-ok; "
         "dd if=/dev/zero of=/workspace/big bs=1M count=100 2>&1 | tail -n 4; rm -f /workspace/big; exit 42")


@pytest.fixture(scope="module")
def lab(one_guest_lab):
    """The shared one-guest lab (tests/lab/conftest.py)."""
    return one_guest_lab


def converge(lab, tmp_path):
    play = tmp_path / "disk.yml"
    play.write_text(PLAY)
    cmd = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i",
           os.path.join(LAB_ROOT, lab["lab"], "inventory.yml"), str(play), "-e", json.dumps(VARS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, ANSIBLE_NOCOLOR="1"), capture_output=True, text=True,
                          timeout=600, check=False)
    recap = re.search(r"^\S+\s+:\s+(ok=.*)$", proc.stdout.split("PLAY RECAP")[-1], re.M)
    return proc, dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", recap.group(1))) if recap else {}


def on_guest(lab, *argv):
    guest = lab["guests"][0]
    cmd = ["ssh", "-i", lab["key"], "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
           "-o", "LogLevel=ERROR", "root@" + guest["address"], " ".join("'%s'" % a.replace("'", "'\\''") for a in argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_a_converged_guest_mounts_each_slots_disk_and_a_cell_hits_its_quota(lab, tmp_path):
    first, recap = converge(lab, tmp_path)
    assert first.returncode == 0 and recap.get("failed") == 0, first.stdout[-4000:]
    mounts = on_guest(lab, "findmnt", "-rn", "-o", "TARGET,SOURCE,FSTYPE,OPTIONS")
    assert mounts.returncode == 0, mounts.stderr
    table = {ln.split()[0]: ln.split()[1:] for ln in mounts.stdout.splitlines()}
    for slot in ("slot0", "slot1"):
        image = table["/var/lib/chv-fleet/disks/" + slot]
        assert image[0].startswith("/dev/loop") and image[1] == "ext4", image
        for d in ("/var/lib/chv-fleet/workspaces/", "/var/lib/chv-fleet/agent-state/"):
            got = table[d + slot]
            assert got[0].startswith(image[0]) and got[1] == "ext4", (d, got, image)  # the image's own device
            assert {"nodev", "nosuid"} <= set(got[2].split(",")), got
    size = on_guest(lab, "stat", "-c", "%s %b", "/var/lib/chv-fleet/disks/slot0.img").stdout.split()
    assert int(size[0]) == 64 << 20 and int(size[1]) * 512 >= 64 << 20, size  # preallocated
    cell = on_guest(lab, "chv-cell", "run", "--slot", "slot0", "--", "sh", "-c", WRITE)
    assert cell.returncode == 42, (cell.returncode, cell.stdout, cell.stderr)  # the cell ran its payload
    assert "small-ok" in cell.stdout and "No space left on device" in cell.stdout, cell.stdout
    # The guest's root is untouched: the 100 MB write stopped below the 64M
    # image (the root has gigabytes free, so ENOSPC came from the image) and
    # the image file still holds exactly its preallocated blocks. The root's
    # free space is no measure: the lab's guests share this machine's disk,
    # which other work moves by more than the write (a make test run: 146 MB).
    copied = re.search(r"^(\d+) bytes", cell.stdout, re.M)
    assert copied and int(copied.group(1)) <= 64 << 20, cell.stdout
    assert on_guest(lab, "stat", "-c", "%s %b", "/var/lib/chv-fleet/disks/slot0.img").stdout.split() == size
    second, recap2 = converge(lab, tmp_path)
    assert second.returncode == 0 and recap2.get("changed") == 0, second.stdout[-4000:]
