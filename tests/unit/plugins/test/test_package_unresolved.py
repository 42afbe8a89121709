"""chv.fleet.package_unresolved: only a failure for an unknown package."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.test import package_unresolved as plugin

unresolved = plugin.TestModule().tests()["package_unresolved"]


@pytest.mark.parametrize("result, expected", [
    ({"failed": True, "msg": "No package matching 'systemd-container' is available"}, True),
    ({"failed": True, "msg": "No package nftables available."}, True),
    # the same message without a failure, other failures, success: not
    ({"failed": False, "msg": "No package matching 'git' is available"}, False),
    ({"failed": True, "msg": "Failed to lock apt for exclusive operation"}, False),
    ({"failed": True, "msg": "'/usr/bin/apt-get -y install git' failed: E: Unable to fetch some archives"}, False),
    ({"changed": True}, False),
    ({"failed": True}, False),
])
def test_only_an_unknown_package_counts(result, expected):
    assert unresolved(result) is expected


def test_a_non_result_is_refused():
    with pytest.raises(AnsibleFilterError, match="tests a registered task result"):
        unresolved("No package matching 'x' is available")
