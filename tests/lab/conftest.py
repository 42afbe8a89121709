"""One lab of two booted guests, shared by the lab tests (one lab_up and
lab_down for all of them): site.yml's input checks on the first guest
(test_site_bad_input.py, which also runs lab_up's second run and lab_down's
clean exit as tests), the lab host's input filter from the second, never
converged (test_lab_firewall.py). The guests boot from the minimal image:
the hardest fresh host for site.yml's check mode."""

import json
import os
import re
import subprocess
import sys

import pytest

from testpaths import LAB_PLAYBOOKS, ROOT

BIN = os.path.dirname(sys.executable)
LAB = "lsite"
INVENTORY = "/var/lib/chv-fleet-lab/%s/inventory.yml" % LAB
GUESTS = 2  # more than one: the guests share the lab's network and table
LAB_ARGS = ["-e", "lab_name=" + LAB, "-e", "lab_network=10.99.32.0/28", "-e", "lab_count=%d" % GUESTS,
            "-e", "lab_image_variant=minimal"]


def run(argv):
    env = dict(os.environ, ANSIBLE_NOCOLOR="1")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def lab(name):
    """lab_up.yml or lab_down.yml on the shared lab: (process, the recap's counts)."""
    proc = run([os.path.join(BIN, "ansible-playbook"), os.path.join(LAB_PLAYBOOKS, name)] + LAB_ARGS)
    recap = re.search(r"localhost\s+:\s+(.*)", proc.stdout.split("PLAY RECAP")[-1])
    return proc, dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", recap.group(1))) if recap else {}


@pytest.fixture(scope="session")
def site_lab():
    """lab.json of the shared lab, brought up once; down after the session
    (a no-op after test_site_bad_input.py's test_lab_down_leaves_nothing)."""
    lab("lab_down.yml")
    up = lab("lab_up.yml")[0]
    assert up.returncode == 0, up.stdout[-3000:]
    with open(os.path.join(os.path.dirname(INVENTORY), "lab.json")) as fh:
        yield json.load(fh)
    lab("lab_down.yml")
