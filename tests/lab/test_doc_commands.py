"""Every command of README.md, docs/operations.md, docs/lab.md and
docs/examples, run as its text has it, from the root of a fresh `git clone`
of this checkout, against a lab guest (issue 32: the docs' commands work
verbatim on a fresh clone after `make demo`).

The commands are read from the docs themselves (tests/helpers/doc_commands.py:
the lines of code blocks and the code spans that start with a command), so
a command added to the docs is run here without a change to this test.
Those that cannot run in the lab are EXCLUDED there, each with its reason;
a few site.yml commands whose options other suites run on real hosts are
checked as written without a run (DRY: --list-hosts --list-tasks appended),
to keep the cost at a handful of site.yml runs;
a command with a placeholder is run with it filled in (PLACEHOLDERS, each
with its reason); tests/unit/test_doc_commands_list.py checks that every
command is one or the other and that both lists name only commands the
docs still have.

What stands for `make demo` (which brings up the lab `demo` on a fixed
network and builds a venv): `make devcoll` in the clone (a documented
command itself, run first), the project venv's bin first on PATH, as the
docs say, and the lab of this test (one guest, LAB on NETWORK, its own next
to make test's other labs), which the documented lab_up brings up and the
plain `ansible-playbook site.yml -i fleet/` converges before every other
site.yml command. `fleet/` and `inventory/` are inventory directories this
test writes into the clone: the lab's inventory and a group `rack7` holding
the guest (docs/operations.md targets `chv_fleet:&rack7`). The environment
is the caller's without what the Makefile exports (ANSIBLE_COLLECTIONS_PATH
and friends): the clone's own ansible.cfg must find the collections.

Order: make devcoll, lab_up, the converge, then the commands in the order
the docs name them (a guest's uncordon after its cordons), the uninstall
(listed, DRY: the fleet scenario runs it on its converged canary),
lab_down last; then nothing of the lab is left. Right after the converge,
one run that is not a documented command: site.yml with
docs/examples/ansible.cfg, which must take the fast path and print under 40 lines, with no ok or
skipping line and nothing of another platform (docs/operations.md,
"ansible.cfg"). A command passes when it
exits 0, and an ansible-playbook run on the inventory also when the guest
is in its recap with no failure and not unreachable (a target that matched
no host is not a pass). Guest commands run as root on the guest over SSH,
as ops run them by hand. Three runs of site.yml (the converge, the quiet
run, the gate) are most of its time: check mode, which the trixie scenario
runs on its converged guest, is listed (DRY)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from doc_commands import DRY_OPTIONS, GUEST, LAB, LAB_INVENTORY, LAB_ROOT, on_guest, plan, unfilled
from labtraces import lab_traces
from playbook_output import recap
from testpaths import ROOT

BIN = os.path.dirname(sys.executable)


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/systemd-nspawn"),
                                reason="the lab needs root and systemd-nspawn")


def _env():
    env = dict((k, v) for k, v in os.environ.items()
               if k not in ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS", "ANSIBLE_ROLES_PATH",
                            "ANSIBLE_CONFIG", "PYTHONPATH"))
    env.update(PATH=BIN + os.pathsep + env.get("PATH", ""), ANSIBLE_NOCOLOR="1")
    return env


def _lab_down(clone):
    subprocess.run(["ansible-playbook", "lab/playbooks/lab_down.yml", "-e", "lab_name=" + LAB],
                   cwd=clone, env=_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh clone of this checkout's HEAD, with the inventories `fleet/` and `inventory/`."""
    path = tmp_path_factory.mktemp("doc-commands") / "chv.fleet"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", ROOT, str(path)], check=True, timeout=300)
    os.chmod(path, 0o755)  # Ansible ignores an ansible.cfg in a world-writable directory
    for name in ("fleet", "inventory"):
        os.mkdir(path / name)
        os.symlink(LAB_INVENTORY, path / name / "lab.yml")
        (path / name / "rack7.yml").write_text(json.dumps({"all": {"children": {"rack7": {"hosts": {GUEST: {}}}}}}))
    _lab_down(str(path))
    yield str(path)
    _lab_down(str(path))
    assert lab_traces(LAB) == []


def _guest():
    with open(os.path.join(LAB_ROOT, LAB, "lab.json"), encoding="utf-8") as fh:
        lab = json.load(fh)
    guest = next(g for g in lab["guests"] if g["name"] == GUEST)
    return guest["address"], os.path.join(LAB_ROOT, LAB, "id_ed25519")


def run(clone, cmd):
    if on_guest(cmd):
        address, key = _guest()
        argv = ["ssh", "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "root@" + address, cmd]
        return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return subprocess.run(cmd, shell=True, executable="/bin/bash", cwd=clone, env=_env(), capture_output=True,
                          text=True, timeout=1200, check=False)


# docs/operations.md, "ansible.cfg": a no-change run with docs/examples/ansible.cfg prints under 40 lines
# for one guest (issue 32). Not a command of the docs: the same site.yml run with that file (and the clone's
# collections, which the file does not name), right after the converge.
OUTPUT_DOC = "docs/operations.md \"ansible.cfg\": a no-change run with docs/examples/ansible.cfg, under 40 lines"
OUTPUT_CMD = ("ANSIBLE_CONFIG=docs/examples/ansible.cfg ANSIBLE_COLLECTIONS_PATH=build/dev-collections "
              "ansible-playbook site.yml -i fleet/")
RUNS = plan()
RUNS.insert([c for _d, c in RUNS].index("ansible-playbook site.yml -i fleet/") + 1, (OUTPUT_DOC, OUTPUT_CMD))


def check_quiet_run(stdout, counts):
    """What a no-change run prints with docs/examples/ansible.cfg right after the converge: the fast path
    (the converge recorded the host as it left it), under 40 lines, no ok or skipping line, nothing of the
    other platform; the batch banner and the summary line are there (the control: the output is the run's)."""
    lines = stdout.splitlines()
    assert counts[GUEST]["changed"] == 0, stdout
    assert len(lines) < 40, "%d lines:\n%s" % (len(lines), stdout)
    assert not [line for line in lines if line.startswith(("ok:", "skipping:"))], stdout
    assert "darwin.yml" not in stdout and "linux.yml" not in stdout, stdout
    assert "tasks/batch.yml for " + GUEST in stdout, stdout
    assert re.search(r"^%s: ok, changed=0, .*path: fast \(as the last converge left it\)" % re.escape(GUEST), stdout,
                     re.M), stdout


@pytest.mark.parametrize("doc,cmd", RUNS, ids=[c for _d, c in RUNS])
def test_a_documented_command_works_from_a_fresh_clone(clone, doc, cmd):
    assert not unfilled(cmd), "a placeholder this test does not fill (PLACEHOLDERS): %s in %r" % (unfilled(cmd), doc)
    proc = run(clone, cmd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "%s\n(documented as %r)\n%s" % (cmd, doc, out[-4000:])
    words = [w for w in shlex.split(cmd) if not re.match(r"^[A-Z_]+=", w)]
    if cmd.endswith(DRY_OPTIONS):
        # checked, not run (DRY): the guest is a host of the play (the lab's playbooks: localhost), and the
        # play lists role tasks
        host, role = ("localhost", r"chv\.fleet_lab\.lab") if "fleet_lab" in cmd else (GUEST, r"chv\.fleet\.\w+")
        assert re.search(r"^\s+%s$" % host, proc.stdout, re.M), out[-3000:]
        # remove.yml is a play of its own tasks (no role): its drain
        task = r"Wait until no cell runs on the host" if "chv.fleet.remove" in words else role + " : "
        assert re.search(r"^\s+%s.*\tTAGS: " % task, proc.stdout, re.M), out[-3000:]
    elif words[0] == "ansible-playbook" and "-i" in words:
        counts = recap(proc.stdout)
        assert GUEST in counts, "%s ran on no lab guest: %s" % (cmd, out[-3000:])
        assert counts[GUEST]["failed"] == 0 and counts[GUEST]["unreachable"] == 0, out[-4000:]
        if doc == OUTPUT_DOC:
            check_quiet_run(proc.stdout, counts)
    elif words[0] == "ansible-playbook":
        counts = recap(proc.stdout)
        assert counts and all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), out[-4000:]
    elif words[0] == "ansible" and "-m" in words:
        assert re.search(r"^%s \| SUCCESS" % GUEST, proc.stdout, re.M), out[-3000:]
