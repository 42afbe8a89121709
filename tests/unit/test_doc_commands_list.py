"""The list of documented commands that tests/lab/test_doc_commands.py runs
(tests/helpers/doc_commands.py), checked without a lab: every command of
README.md, docs/operations.md, docs/lab.md and docs/examples is run (with
its placeholders filled in) or excluded with a reason, and the two lists
name nothing the docs no longer have. A command added to the docs with a
placeholder this test does not know fails here, in make units, before the
lab lane runs it."""

import os
import re

import doc_commands as dc
from testpaths import ROOT


def line_of(where):
    path, _, number = where.rpartition(":")
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read().split("\n")[int(number) - 1]


def test_the_extractor_finds_commands_in_blocks_spans_and_example_comments():
    found = dc.doc_commands()
    # a fenced block's line, its comment cut off
    lines = [line_of(w) for w in found["ansible-playbook site.yml -i fleet/ --tags health_gate"]]
    assert [t for t in lines if re.match(r"^ansible-playbook site.yml -i fleet/ --tags health_gate +# every host.s gate", t)]
    # a code span in prose (also across a line break)
    assert any(w.startswith("docs/lab.md:") for w in found["ansible-doc -t module chv.fleet_lab.lab_plan"])
    assert "ansible-galaxy collection install chv-fleet-<old>.tar.gz --force" in found
    # an indented command in a comment of an example file
    assert [w for w in found["ansible-builder build -t chv-fleet-ee:0.2.0"] if w.startswith("docs/examples/")]
    # output shown in a block, a program named alone, a prose line of a comment: no command
    assert not [c for c in found if c.startswith(("fatal:", "ok:"))]
    assert "chv-cell" not in found and "ansible-playbook" not in found
    assert not [c for c in found if c.startswith("make test runs")]


def test_every_documented_command_is_run_or_excluded_with_a_reason():
    found = dc.doc_commands()
    for cmd in found:
        if cmd in dc.EXCLUDED:
            assert len(dc.EXCLUDED[cmd]) > 20, cmd
            continue
        for each in dc.filled(cmd):
            assert not dc.unfilled(each), "%s (%s): fill %r in (PLACEHOLDERS) or exclude it (EXCLUDED)" % (
                cmd, ", ".join(found[cmd]), dc.unfilled(each))
    # control: an unknown placeholder is caught
    assert dc.unfilled("ansible-playbook site.yml -i <your fleet>") == "<your fleet>"
    assert dc.unfilled("ansible-playbook site.yml -i fleet/ -e '{\"chv_fleet_batches\": [1, \"10%\"]}'") == ""


def test_the_lists_name_only_what_the_docs_have():
    found = dc.doc_commands()
    assert [c for c in dc.EXCLUDED if c not in found] == []
    assert [c for c in dc.DRY if c not in found or c in dc.EXCLUDED] == []
    assert all(len(why) > 20 for why in dc.DRY.values())
    unused = [p for p, _r, _why in dc.PLACEHOLDERS if not any(re.search(p, c) for c in found)]
    assert unused == []


def test_the_order_converges_first_and_ends_with_the_uninstall_and_lab_down():
    runs = [cmd for _doc, cmd in dc.plan()]
    assert runs[0] == "make devcoll"
    assert all("lab_up" in c for c in runs[1:3]) and runs[3] == "ansible-playbook site.yml -i fleet/"
    assert "chv.fleet.remove" in runs[-2] and "lab_down" in runs[-1]
    cordons = [i for i, c in enumerate(runs) if c.startswith("chv-cell cordon")]
    assert cordons and max(cordons) < runs.index("chv-cell uncordon")
    # every role's documentation, from the placeholder chv.fleet.<role>
    assert {"ansible-doc -t role chv.fleet." + r for r in dc.ROLES} <= set(runs)
