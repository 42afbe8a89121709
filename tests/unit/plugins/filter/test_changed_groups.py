"""chv.fleet.changed_groups: which groups of chv.fleet.files entries a
check-mode run found different."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.changed_groups import changed_groups

GROUPS = {
    "install": [{"dest": "/opt/b/chv-broker"}],
    "configure": [{"dest": "/etc/chv/broker.json"}],
    "service": [{"dest": "/etc/systemd/system/a.socket"}, {"dest": "/etc/systemd/system/a.service"}],
}


def test_each_group_lists_its_changed_destinations_in_order():
    checked = {"changed": False, "changed_files": ["/etc/systemd/system/a.service", "/etc/chv/broker.json"]}
    assert changed_groups(GROUPS, checked) == {
        "install": [], "configure": ["/etc/chv/broker.json"], "service": ["/etc/systemd/system/a.service"]}


@pytest.mark.parametrize("checked", [{"changed_files": []}, {"skipped": True}, {}, None])
def test_nothing_checked_or_nothing_changed_is_no_difference(checked):
    assert changed_groups(GROUPS, checked) == {"install": [], "configure": [], "service": []}


@pytest.mark.parametrize("groups,needle", [
    ([{"dest": "/a"}], "expects {group: [entries]}"),
    ({"install": "/a"}, "group install must be a list of entries with dest"),
    ({"install": [{"path": "/a"}]}, "group install must be a list of entries with dest"),
])
def test_bad_groups_are_named(groups, needle):
    with pytest.raises(AnsibleFilterError, match=needle.replace("[", r"\[").replace("{", r"\{")):
        changed_groups(groups, {"changed_files": []})
