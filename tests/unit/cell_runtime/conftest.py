"""pytest fixtures of the launcher's unit tests. Constants and helpers live
in cellrt.py: a module named conftest is not unique across the test
directories, so tests import from cellrt, never from conftest."""

import copy

import pytest

from cellrt import BASE_POLICY


@pytest.fixture
def raw_policy():
    return copy.deepcopy(BASE_POLICY)


@pytest.fixture
def policy(raw_policy):
    from chv_guest.cell import policy as policymod

    assert policymod.validate(raw_policy) == []
    return policymod.merged(raw_policy)


@pytest.fixture
def task_policy(policy, tmp_path):
    """The policy with its state, workspaces and homes in tmp_path, short
    waits and a task TTL of 100 s (tasks' tests)."""
    p = dict(policy)
    p["state_dir"] = str(tmp_path / "state")
    p["workspace_root"] = str(tmp_path / "ws")
    p["agent_state_root"] = str(tmp_path / "home")
    p["claim_timeout"] = 0.2
    p["task_ttl"] = 100.0
    return p
