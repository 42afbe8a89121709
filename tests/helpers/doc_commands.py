"""The commands of README.md, docs/operations.md, docs/lab.md and
docs/examples, as their text has them, and how tests/lab/test_doc_commands.py
runs them (EXCLUDED, PLACEHOLDERS, plan); tests/unit/test_doc_commands_list.py
checks that each is run or excluded with a reason.

A command is a line of a fenced code block, or an inline code span, whose
first word is a command the docs tell an operator to type: on the
controller, from a clone's root (CONTROLLER), or as root on a guest
(ON_GUEST). In the files of docs/examples (comments), a comment line indented
by two or more spaces after its `#`, or a code span. A trailing `# comment`
is not part of the command. Output shown in a block (`fatal: ...`, `ok:
...`) is not a command: its first word is none of these."""

import glob
import os
import re

from labtraces import LAB_ROOT
from testpaths import ROOT

DOCS = ("README.md", "docs/operations.md", "docs/lab.md")
EXAMPLES = "docs/examples"
CONTROLLER = ("ansible-playbook", "ansible", "ansible-doc", "ansible-galaxy", "ansible-builder", "ansible-inventory",
              "ansible-vault", "make", "pip")
ON_GUEST = ("chv-cell",)
_WORD = re.compile(r"^(%s)(\s|$)" % "|".join(re.escape(w) for w in sorted(CONTROLLER + ON_GUEST, key=len, reverse=True)))
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# a code span: on one line, or across one line break (prose wraps it)
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")


def _strip_comment(line):
    """The command without a trailing `# comment` (a # after white space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _command(text):
    """The command a text is, or None: a command word and at least one argument (a bare
    `chv-cell` or `ansible-playbook` names the program in a sentence)."""
    text = " ".join(text.split())
    return text if _WORD.match(text) and len(text.split()) > 1 else None


def _markdown(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        text = fh.read()
    found = []
    for block in _FENCE.finditer(text):
        first = text[:block.start()].count("\n") + 2
        for k, line in enumerate(block.group(1).split("\n")):
            cmd = _command(_strip_comment(line))
            if cmd:
                found.append((cmd, "%s:%d" % (path, first + k)))
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in _SPAN.finditer(prose):
        cmd = _command(span.group(1))
        if cmd:
            found.append((cmd, "%s:%d" % (path, prose[:span.start()].count("\n") + 1)))
    return found


def _example(path):
    """Commands in the comments of a file of docs/examples."""
    found = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    comments = [(n, re.sub(r"^\s*#", "", line)) for n, line in enumerate(lines, 1) if line.lstrip().startswith("#")]
    for n, body in comments:
        if re.match(r"^\s{2,}\S", body):
            cmd = _command(_strip_comment(body.strip()))
            if cmd:
                found.append((cmd, "%s:%d" % (path, n)))
    text = "\n".join(body for _n, body in comments)
    for span in _SPAN.finditer(text):
        cmd = _command(span.group(1))
        if cmd:
            found.append((cmd, "%s:%d" % (path, comments[text[:span.start()].count("\n")][0])))
    return found


def example_files():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, EXAMPLES, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    fh.read()
            except UnicodeDecodeError:
                continue
            out.append(os.path.relpath(path, ROOT))
    return out


def doc_commands():
    """{command: [where, ...]}, in the order of first appearance."""
    out = {}
    for path in DOCS:
        for cmd, where in _markdown(path):
            out.setdefault(cmd, []).append(where)
    for path in example_files():
        for cmd, where in (_markdown(path) if path.endswith(".md") else _example(path)):
            out.setdefault(cmd, []).append(where)
    return out


def on_guest(cmd):
    return cmd.split()[0] in ON_GUEST


# --- what tests/lab/test_doc_commands.py runs -------------------------------
LAB = "ldocs"
NETWORK = "10.99.42.0/28"
GUEST = LAB + "1"
LAB_INVENTORY = os.path.join(LAB_ROOT, LAB, "inventory.yml")
ROLES = sorted(r for r in os.listdir(os.path.join(ROOT, "roles")) if not r.startswith("_"))

# Commands that cannot run in the lab, with the reason.
EXCLUDED = {
    "make demo": "what this test stands for: it brings up the lab `demo` on a fixed network (a developer's own) and a "
                 "venv in the clone; here `make devcoll`, the venv's bin on PATH and this test's own lab",
    "make test": "runs this test (its lab lane)",
    "make lint": "a stage of make test (its host lane)",
    "make sanity": "a stage of make test (its host lane)",
    "make units": "a stage of make test (its host lane)",
    "make integration": "a stage of make test (its host lane)",
    "make integration-playbooks": "a stage of make test (its host lane)",
    "make docs": "a stage of make test (its host lane)",
    "make lab-tests": "the stage of make test that runs this test",
    "make molecule": "make test's guest lanes (molecule-fleet, molecule-trixie)",
    "make lab-down": "removes the lab `demo` (a developer's own); this test runs the lab_down playbook it wraps",
    "make bench": "benchmarks, not tests: tens of minutes and labs of their own",
    "make image": "bakes a CHV guest image (minutes, qemu-utils); not a test",
    "make test-vm": "boots the baked image under qemu TCG: 20 to 25 minutes (docs/chv.md)",
    "ansible-galaxy collection install chv-fleet-0.2.0.tar.gz":
        "installs into the controller's first collections path: from a clone's root build/dev-collections, where "
        "chv.fleet is the clone already; tests/release installs the built tarball into an empty path and loads it",
    "ansible-galaxy collection install chv-fleet-<old>.tar.gz --force":
        "needs an older release's tarball (a rollback is not covered by make test, docs/operations.md says so)",
    "ansible-galaxy collection install -r requirements.yml":
        "the README's requirements.yml names a tarball to build first and installs into the user's collections "
        "path; tests/release installs the built tarball",
    "pip install -r ~/.ansible/collections/ansible_collections/chv/fleet/requirements.txt":
        "follows the install above (a collection in ~/.ansible) and changes the Python it runs in",
    "ansible-builder build -t chv-fleet-ee:0.2.0": "builds a container image (podman or docker, a registry): none "
                                                   "here; tests/release runs ansible-builder create on the same file",
    "ansible-builder create": "run from the execution environment's directory with the collection's tarball beside "
                              "it: tests/release/test_release.py does exactly that and checks the context",
    "ansible-playbook chv.fleet.site -i docs/examples/inventory --vault-password-file <your file>":
        "the example inventory's guests are documentation addresses (192.0.2.0/24, 198.51.100.0/24), never "
        "reachable; tests/integration/playbooks/test_from_a_clone.py loads it from a clone's root, "
        "test_example_inventory.py runs the roles' checks on its values, the fleet scenario converges its layers",
    "ansible-playbook chv.fleet.remove": "names the playbook in a sentence (no inventory: it would target no host); "
                                         "docs/operations.md's `ansible-playbook chv.fleet.remove -i fleet/` runs",
    "chv-cell run": "a fragment: a cell needs a slot and a payload (docs/cells.md); the health gate runs real cells "
                    "through it in every site.yml run here",
    "chv-cell run --ignore-cordon": "a fragment (as chv-cell run); the health gate's own cell uses it",
    "chv-cell audit": "the whole isolation catalog in real cells, minutes; the fleet scenario runs it "
                      "(molecule/shared/tests/test_catalog.py)",
}

# site.yml commands that differ from one run for real here only by options whose effect other suites
# run on real hosts, and the playbooks other suites run for real on a converged guest (the uninstall):
# each is checked as written, cheaply, with --list-hosts --list-tasks appended (the
# shell parses it, the playbook loads from the clone with its roles, the inventory and target name the
# lab guest, the tags select tasks), not run: a run of site.yml costs as much as a converge of a
# converged guest (docs/operations.md), and make test's lab lane has room for a few only. With the
# suite that runs what the options do:
DRY = {
    "ansible-playbook site.yml -i fleet/ -e '{\"chv_fleet_batches\": [1, 5, \"25%\"]}'":
        "batches from -e applied: tests/integration/playbooks/test_site_rollout.py",
    "ansible-playbook site.yml -i fleet/ -e chv_fleet_target='chv_fleet:&rack7'":
        "a target from -e: tests/integration/playbooks/test_site_rollout.py",
    "ansible-playbook site.yml -i fleet/ --tags configure":
        "the configure phase on a converged guest: molecule/shared/tests/test_rollout.py",
    "ansible-playbook -i <lab inventory> site.yml": "the same run as `ansible-playbook site.yml -i fleet/` (the "
                                                    "converge here), on the lab's own inventory file",
    "ansible-playbook -i inventory/ chv.fleet.site": "the same run as `ansible-playbook site.yml -i fleet/`, the "
                                                     "playbook named by the collection (FQCN): the listing loads it",
    "ansible-playbook site.yml -i fleet/ --check --diff":
        "check mode on a converged guest, reporting no change: molecule/shared/tests/test_rollout.py (trixie); "
        "on a fresh guest: tests/lab/test_site_bad_input.py",
    "ansible-playbook chv.fleet.remove -i fleet/":
        "the uninstall of a converged guest, its drain and a second run that finds nothing: "
        "molecule/shared/tests/test_uninstall.py (playbooks/remove.yml, which this FQCN names; the listing loads "
        "it from the clone)",
    "ansible-playbook chv.fleet_lab.lab_up -e ...": "the playbook named by the lab collection (FQCN): the listing "
                                                    "loads it; a second lab_up that changes nothing: "
                                                    "tests/lab/test_site_bad_input.py",
}


# Placeholders, filled in: (pattern, replacement, reason).
PLACEHOLDERS = [
    (r"lab_name=dev -e lab_count=2 \[-e lab_distro=trixie\]", "lab_name=dev -e lab_count=2",
     "the optional trixie guest: a second image to build; the trixie scenario boots one"),
    (r"lab_name=dev\b", "lab_name=%s -e lab_network=%s" % (LAB, NETWORK),
     "this test's own lab and network, beside make test's other labs and a developer's `dev`"),
    (r"lab_count=2\b", "lab_count=1", "one guest: no command needs two, and each would be converged"),
    (r"chv\.fleet_lab\.lab_up -e \.\.\.", "chv.fleet_lab.lab_up -e lab_name=%s -e lab_network=%s -e lab_count=1"
     % (LAB, NETWORK), "the same lab's options (a second lab_up, which changes nothing)"),
    (r"/var/lib/chv-fleet-lab/dev/", "%s/%s/" % (LAB_ROOT, LAB), "this test's lab (above)"),
    (r"-i <inventory>", "-i fleet/", "the inventory, as `fleet/` elsewhere"),
    (r"-i <lab inventory>", "-i " + LAB_INVENTORY, "the lab's inventory"),
    (r"chv\.fleet\.<role>", None, "every role: " + ", ".join(ROLES)),
    (r"--reason \"chv\.fleet rollout: \.\.\.\"", "--reason \"chv.fleet rollout: doc commands test\"",
     "a reason of this test's"),
    (r" \[--reason TEXT\]", " --reason \"doc commands test\"", "the optional reason, given"),
]
DRY_OPTIONS = " --list-hosts --list-tasks"
CHECK_UNFILLED = re.compile(r"<[^<>]+>|\.\.\.|\[[^\]]*\]")


def filled(cmd):
    """The commands to run for a documented one, placeholders filled in (more than one for <role>)."""
    out = [cmd]
    for pattern, repl, _why in PLACEHOLDERS:
        if repl is None:
            out = [re.sub(pattern, "chv.fleet." + role, c) for c in out for role in ROLES] \
                if any(re.search(pattern, c) for c in out) else out
        else:
            out = [re.sub(pattern, repl, c) for c in out]
    return out


def unfilled(cmd):
    """What still looks like a placeholder in a command to run ('' if nothing): JSON brackets are not."""
    rest = re.sub(r"'\{.*\}'", "", cmd)
    return " ".join(CHECK_UNFILLED.findall(rest))


def plan():
    """[(documented command, command to run)] in the order they run (a DRY one with the listing options)."""
    runs = []
    for cmd in doc_commands():
        if cmd in EXCLUDED:
            continue
        for each in filled(cmd):
            if cmd in DRY:
                each += DRY_OPTIONS
            if each not in [r for _d, r in runs]:
                runs.append((cmd, each))

    def key(item):
        index, (_doc, cmd) = item
        words = cmd.split()
        if cmd == "make devcoll":
            return (0, index)
        if "lab_up" in cmd:
            return (1, index)
        if cmd == "ansible-playbook site.yml -i fleet/":
            return (2, index)  # the converge (make demo's)
        if "lab_down" in cmd:
            return (6, index)
        if "chv.fleet.remove" in words or "playbooks/remove.yml" in words:
            return (5, index)
        if on_guest(cmd) and "uncordon" in words:
            return (4, index)
        return (3, index)
    return [r for _i, r in sorted(enumerate(runs), key=key)]
