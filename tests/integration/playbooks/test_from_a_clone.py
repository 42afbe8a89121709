"""The commands of README and docs, run verbatim from the clone's root: the
root's ansible.cfg (collections_path = build/dev-collections, which make
devcoll fills) finds chv.fleet and the lab collection, chv.fleet_lab,
without the Makefile's ANSIBLE_COLLECTIONS_PATH. Each playbook is loaded
(--syntax-check: its roles, modules and plugins resolved); ansible-doc
documents a lab module without a warning (lab/galaxy.yml). The control:
the same site.yml command from a directory without that ansible.cfg fails
with chv.fleet's roles and modules not found."""

import os
import re
import subprocess
import sys

import pytest

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
EXAMPLE = "docs/examples/inventory"
VAULT = EXAMPLE + "/example-vault-password"

pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "build", "dev-collections")),
                                reason="make devcoll has not run (make demo and make test run it)")


def run(argv, cwd=ROOT):
    env = dict((k, v) for k, v in os.environ.items()
               if k not in ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS", "ANSIBLE_ROLES_PATH",
                            "ANSIBLE_CONFIG", "PYTHONPATH"))
    env.update(ANSIBLE_NOCOLOR="1", ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false")
    return subprocess.run([os.path.join(BIN, argv[0])] + argv[1:], capture_output=True, text=True, timeout=300,
                          check=False, cwd=cwd, env=env)


@pytest.mark.parametrize("argv", [
    # README, docs/operations.md
    ["ansible-playbook", "-i", EXAMPLE, "site.yml", "--vault-password-file", VAULT],
    ["ansible-playbook", "chv.fleet.site", "-i", EXAMPLE, "--vault-password-file", VAULT],
    ["ansible-playbook", "chv.fleet.remove", "-i", EXAMPLE, "--vault-password-file", VAULT],
    # docs/lab.md, README "Development"
    ["ansible-playbook", "lab/playbooks/lab_up.yml", "-e", "lab_name=dev", "-e", "lab_count=2"],
    ["ansible-playbook", "lab/playbooks/lab_down.yml", "-e", "lab_name=dev"],
    ["ansible-playbook", "chv.fleet_lab.lab_up", "-e", "lab_name=dev"],
], ids=lambda argv: " ".join(argv[1:3]))
def test_a_documented_playbook_command_loads_from_the_clones_root(argv):
    proc = run(argv + ["--syntax-check"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MANIFEST" not in proc.stderr and "chv.fleet" not in proc.stderr, proc.stderr


def test_ansible_doc_documents_the_lab_modules_without_a_warning():
    proc = run(["ansible-doc", "-t", "module", "chv.fleet_lab.lab_plan"])
    assert proc.returncode == 0 and "lab_plan" in proc.stdout, proc.stderr
    assert "MANIFEST" not in proc.stderr and "[WARNING]" not in proc.stderr, proc.stderr
    proc = run(["ansible-doc", "-t", "role", "chv.fleet.cell_runtime"])
    assert proc.returncode == 0 and "chv_cell_slots" in proc.stdout, proc.stderr


def test_control_the_same_command_outside_the_clone_finds_no_role(tmp_path):
    proc = run(["ansible-playbook", "-i", os.path.join(ROOT, EXAMPLE), os.path.join(ROOT, "site.yml"),
                "--vault-password-file", os.path.join(ROOT, VAULT), "--syntax-check"], cwd=str(tmp_path))
    assert proc.returncode != 0
    assert re.search(r"(not found|couldn't resolve).*chv\.fleet|chv\.fleet.*(not found|couldn't resolve)", proc.stderr), \
        proc.stderr[-2000:]
