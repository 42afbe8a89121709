"""One lab of two booted guests, shared by the lab tests (one lab_up and
lab_down for all of them): site.yml's input checks on the first guest
(test_site_bad_input.py, which also runs lab_up's second run and lab_down's
clean exit as tests), the lab host's input filter from the second, never
converged (test_lab_firewall.py). The guests boot from the minimal image:
the hardest fresh host for site.yml's check mode."""

import json
import os
import subprocess
import sys

import pytest

from test_lab import playbook
from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
LAB = "lsite"
INVENTORY = "/var/lib/chv-fleet-lab/%s/inventory.yml" % LAB
GUESTS = 2  # more than one: the guests share the lab's network and table
LAB_VARS = ["lab_name=" + LAB, "lab_network=10.99.32.0/28", "lab_count=%d" % GUESTS, "lab_image_variant=minimal"]


def run(argv):
    env = dict(os.environ, ANSIBLE_NOCOLOR="1")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def lab(name):
    """lab_up.yml or lab_down.yml on the shared lab: (exit code, the recap's counts, the output)."""
    return playbook(name, *LAB_VARS)


@pytest.fixture(scope="session")
def site_lab():
    """lab.json of the shared lab, brought up once; down after the session
    (a no-op after test_site_bad_input.py's test_lab_down_leaves_nothing)."""
    lab("lab_down.yml")
    rc, dummy_counts, out = lab("lab_up.yml")
    assert rc == 0, out[-3000:]
    with open(os.path.join(os.path.dirname(INVENTORY), "lab.json")) as fh:
        yield json.load(fh)
    lab("lab_down.yml")
