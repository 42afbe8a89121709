"""The lab playbooks for real: bad input fails before touching anything, and
a guest that cannot boot is reported and removed. lab_up's idempotence and
lab_down's clean exit are tested on the two-guest lab of
test_site_bad_input.py (one lab brought up for both)."""

import json
import os
import re
import subprocess
import sys

import pytest

from labtraces import LAB_ROOT, lab_traces
from testpaths import LAB_PLAYBOOKS, ROOT

BIN = os.path.dirname(sys.executable)


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/systemd-nspawn"),
                                reason="the lab needs root and systemd-nspawn")


def playbook(name, *extra):
    env = dict(os.environ, ANSIBLE_NOCOLOR="1")
    cmd = [os.path.join(BIN, "ansible-playbook"),
           os.path.join(LAB_PLAYBOOKS, name)]
    for e in extra:
        cmd += ["-e", e]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    recap = re.search(r"localhost\s+:\s+(.*)", proc.stdout.split("PLAY RECAP")[-1])
    out = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", recap.group(1))) if recap else {}
    return proc.returncode, out, proc.stdout + proc.stderr


def failure_msgs(raw):
    return [json.loads(m)["msg"] for m in re.findall(r"^fatal: \[localhost\]: FAILED! => (\{.*\})$", raw, re.M)]


@pytest.mark.parametrize("extra,needle", [
    (["lab_count=0"], "lab_count 0"),
    (["lab_count=abc"], "lab_count"),
    (["lab_name=Bad_Name"], "'Bad_Name'"),
    (["lab_name=averyverylongname"], "'averyverylongname' is 17 characters"),
    (["lab_name=abcdefghijkl"], "'abcdefghijkl1' is 13 characters"),
    (["lab_distro=sid"], "'sid'"),
    (["lab_network=10.99.30.0/31"], "smaller than one /30"),
    (["lab_network=not-a-net"], "'not-a-net'"),
    (["lab_network=127.0.0.0/24"], "overlaps routes"),
])
def test_bad_input_fails_before_touching_anything(extra, needle):
    name = next((e.split("=", 1)[1] for e in extra if e.startswith("lab_name=")), "lbad")
    rc, out, raw = playbook("lab_up.yml", *(extra if name != "lbad" else ["lab_name=lbad"] + extra))
    assert rc != 0
    assert any(needle in m for m in failure_msgs(raw)), raw[-2000:]
    # nothing of this lab was created (other labs, such as Molecule's scenarios in the other
    # lanes of make test, come and go meanwhile: only this lab's directory is looked for)
    assert not os.path.exists(os.path.join(LAB_ROOT, name))
    assert out.get("changed", 0) == 0


def test_guest_that_fails_to_boot_is_reported_and_removed(tmp_path):
    """A root file system without an init cannot boot: the module fails with
    the console's tail and removes every trace of the guest."""
    lab = "lboot"
    lab_dir = os.path.join(LAB_ROOT, lab)
    broken = tmp_path / "broken.tar.zst"
    subprocess.run(["bash", "-c", "mkdir -p %s/r/etc/ssh %s/r/root && tar --zstd -cf %s -C %s/r ."
                    % (tmp_path, tmp_path, broken, tmp_path)], check=True)
    proc = subprocess.run(
        [os.path.join(BIN, "ansible"), "localhost", "-m", "chv.fleet_lab.lab_guest", "-a", json.dumps(dict(
            name=lab + "1", lab=lab, lab_dir=lab_dir, image=str(broken), address="10.99.31.2",
            host_address="10.99.31.1", authorized_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 lab", boot_timeout=5))],
        capture_output=True, text=True, env=dict(os.environ, ANSIBLE_NOCOLOR="1"), timeout=120, check=False)
    try:
        assert proc.returncode != 0
        result = json.loads(proc.stdout.split("=>", 1)[1])
        assert "failed to boot" in result["msg"], result
        assert result["console_tail"], result
        assert result["left_behind"] == []
        assert [t for t in lab_traces(lab) if not t.startswith("directory")] == []
        assert not os.path.exists(os.path.join(lab_dir, lab + "1"))
    finally:
        subprocess.run(["rm", "-rf", lab_dir], check=False)
