"""The roles' documentation as ansible-doc renders it: every option of a role
once, under its main entry point; validate documented briefly, with no
options of its own (it checks main's: tests/integration/playbooks/
test_role_checks.py)."""

import collections
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from testpaths import ROOT

ROLES = ("cell_runtime", "cell_nat", "broker", "browser", "metrics")


def main_options(role):
    with open(os.path.join(ROOT, "roles", role, "meta", "argument_specs.yml"), encoding="utf-8") as fh:
        return list(yaml.safe_load(fh)["argument_specs"]["main"]["options"])


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """ansible-doc -t role of the four roles of this checkout: (JSON, text)."""
    collections_dir = tmp_path_factory.mktemp("doc") / "collections"
    (collections_dir / "ansible_collections" / "chv").mkdir(parents=True)
    (collections_dir / "ansible_collections" / "chv" / "fleet").symlink_to(ROOT)
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections_dir), ANSIBLE_NOCOLOR="1")
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-doc"), "-t", "role"] + [
        "chv.fleet." + r for r in ROLES]
    as_json = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env, check=True, timeout=300)
    as_text = subprocess.run(argv, capture_output=True, text=True, env=env, check=True, timeout=300)
    return json.loads(as_json.stdout), as_text.stdout


def text_of(text, role):
    """One role's part of ansible-doc's text output."""
    parts = re.split(r"^> ROLE: \*?(chv\.fleet\.\w+)\*?", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))["chv.fleet." + role]


def listed(role_text):
    """{entry point: [the top-level option names it lists, in order]} of a role's text."""
    out = {}
    for entry, body in re.findall(r"^ENTRY POINT: \*?(\w+)\*?(.*?)(?=^ENTRY POINT: |\Z)", role_text, re.M | re.S):
        out[entry] = re.findall(r"^[-=] (\w+)", body, re.M)  # "=": a required option
    return out


@pytest.mark.parametrize("role", ROLES)
def test_each_option_is_documented_once_under_main(docs, role):
    as_json, as_text = docs
    entry_points = as_json["chv.fleet." + role]["entry_points"]
    assert sorted(entry_points["main"]["options"]) == sorted(main_options(role))
    assert "options" not in entry_points["validate"]
    assert "main" in entry_points["validate"]["short_description"]
    found = listed(text_of(as_text, role))
    assert set(found) >= {"main", "validate"}, found
    assert found["validate"] == []
    assert found["main"] == sorted(main_options(role))  # ansible-doc sorts them
    # each once in the whole text: another entry point (cell_runtime's drain) lists only its own
    names = collections.Counter(n for entry in found.values() for n in entry)
    assert [n for n, count in names.items() if count > 1] == []


def test_the_text_parser_sees_a_repeated_option():
    """Control: the text of an entry point that repeated main's options is seen as such."""
    body = "ENTRY POINT: *main* - m\n\nOptions:\n\n- a  x\n= b  y\n\nENTRY POINT: *validate* - v\n\n- a  x\n= b  y\n"
    assert listed(body) == {"main": ["a", "b"], "validate": ["a", "b"]}
