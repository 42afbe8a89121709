"""chv.fleet.converge_digest (plugins/filter/converge_digest.py): the digest
of a run's inputs moves with any input and with any file of the collection,
and with nothing else."""

import os

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.converge_digest import converge_digest


@pytest.fixture
def root(tmp_path):
    (tmp_path / "roles" / "r" / "tasks").mkdir(parents=True)
    (tmp_path / "roles" / "r" / "tasks" / "main.yml").write_text("---\n")
    (tmp_path / "site.yml").write_text("---\n")
    return tmp_path


def test_the_same_inputs_and_files_give_the_same_digest_whatever_the_key_order(root):
    a = converge_digest({"vars": {"x": 1, "y": [1, 2]}, "host": "h"}, str(root))
    assert a == converge_digest({"host": "h", "vars": {"y": [1, 2], "x": 1}}, str(root))
    assert len(a) == 64


def test_an_input_a_file_or_a_files_name_changes_it_and_bytecode_or_docs_do_not(root):
    inputs = {"vars": {"x": 1}}
    base = converge_digest(inputs, str(root))
    assert converge_digest({"vars": {"x": 2}}, str(root)) != base
    (root / "roles" / "r" / "__pycache__").mkdir()
    (root / "roles" / "r" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"x")
    (root / "docs").mkdir()
    (root / "docs" / "x.md").write_text("x")
    assert converge_digest(inputs, str(root)) == base  # control for the changes below
    (root / "roles" / "r" / "tasks" / "main.yml").write_text("---\n# changed\n")
    changed = converge_digest(inputs, str(root))
    assert changed != base
    os.rename(str(root / "roles" / "r" / "tasks" / "main.yml"), str(root / "roles" / "r" / "tasks" / "other.yml"))
    assert converge_digest(inputs, str(root)) not in (base, changed)


def test_bad_input_is_refused_naming_it(tmp_path):
    with pytest.raises(AnsibleFilterError, match="expects a dict of inputs"):
        converge_digest(["x"], str(tmp_path))
    with pytest.raises(AnsibleFilterError, match="holds none of roles"):
        converge_digest({}, str(tmp_path))
