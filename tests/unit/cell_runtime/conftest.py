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
