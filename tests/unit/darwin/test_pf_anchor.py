"""The pf anchor of the macOS slot users, rendered from the cell_nat role's
template (templates/pf-anchor.conf.j2 with vars/Darwin.yml's rule list,
the chv.fleet.pf_anchor_rules filter) for several policy variants, checked
rule by rule against the rules each policy implies, written out here by
hand: the exact list, in order (the rules are quick: order is meaning),
nothing extra."""

import base64
import re

import pytest

from darwin_render import darwin_vars, evaluate, render
from ansible_collections.chv.fleet.plugins.filter.darwin import darwin_slots, pf_anchor_rules
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import CellNatError
from ansible_collections.chv.fleet.plugins.module_utils.pf_anchor import anchor_rules

U2 = "user { 524288 589824 }"
U1 = "user { 524288 }"
HEAD = [
    "block drop out quick inet6 proto { tcp udp } all %s",
    "block drop out quick inet proto { tcp udp } to self %s",
    "block drop out quick inet proto { tcp udp } to 127.0.0.0/8 %s",
    "block drop out quick inet proto { tcp udp } to 169.254.0.0/16 %s",
]
# The private and special-purpose ranges (cell_nat.SPECIAL_PURPOSE, merged
# where adjacent), blocked after DNS and the carve-outs, before the allow list.
SPECIAL = ["block drop out quick inet proto { tcp udp } to %s %%s" % net for net in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/3")]

VARIANTS = {
    "open egress, two slots": dict(
        slots=2, allow=[], deny=[], dns=[],
        expected=[h % U2 for h in HEAD] + [b % U2 for b in SPECIAL]
        + ["pass out quick inet proto { tcp udp } all %s keep state" % U2]),
    "deny list and a resolver, one slot": dict(
        slots=1, allow=[], deny=[{"cidr": "10.0.0.0/8"}, {"cidr": "192.0.2.7", "proto": "udp", "ports": [161]}],
        dns=["192.0.2.53"],
        expected=[h % U1 for h in HEAD] + [
            "block drop out quick inet proto { tcp udp } to 10.0.0.0/8 %s" % U1,
            "block drop out quick inet proto udp to 192.0.2.7/32 port 161 %s" % U1,
            "pass out quick inet proto { tcp udp } to 192.0.2.53 port 53 %s keep state" % U1]
        + [b % U1 for b in SPECIAL] + ["pass out quick inet proto { tcp udp } all %s keep state" % U1]),
    "allow list with a carve-out, ports and a range": dict(
        slots=2,
        allow=[{"cidr": "203.0.113.0/24", "proto": "tcp", "ports": [443, "8000-8080"]}, "198.51.100.0/24"],
        deny=[{"cidr": "203.0.113.9/32", "proto": "tcp", "ports": [443]}],
        dns=["192.0.2.53", "192.0.2.54"],
        expected=[h % U2 for h in HEAD] + [
            "block drop out quick inet proto tcp to 203.0.113.9/32 port 443 %s" % U2,
            "pass out quick inet proto { tcp udp } to 192.0.2.53 port 53 %s keep state" % U2,
            "pass out quick inet proto { tcp udp } to 192.0.2.54 port 53 %s keep state" % U2,
            "pass out quick inet proto tcp to 203.0.113.0/24 port 443 %s keep state" % U2,
            "pass out quick inet proto tcp to 203.0.113.0/24 port 8000:8080 %s keep state" % U2,
            "pass out quick inet proto { tcp udp } to 198.51.100.0/24 %s keep state" % U2]
        + [b % U2 for b in SPECIAL] + ["block drop out quick inet proto { tcp udp } all %s" % U2]),
    "allow list, both protocols on a port": dict(
        slots=1, allow=[{"cidr": "192.0.2.0/28", "ports": [22]}], deny=[], dns=[],
        expected=[h % U1 for h in HEAD] + [
            "pass out quick inet proto tcp to 192.0.2.0/28 port 22 %s keep state" % U1,
            "pass out quick inet proto udp to 192.0.2.0/28 port 22 %s keep state" % U1]
        + [b % U1 for b in SPECIAL] + ["block drop out quick inet proto { tcp udp } all %s" % U1]),
}

# pf.conf grammar of the rules the anchor may hold (pass/block out quick, TCP/UDP, a user set)
RULE = re.compile(
    r"^(pass|block drop) out quick inet6? proto (tcp|udp|\{ tcp udp \}) "
    r"(all|to (self|\d+\.\d+\.\d+\.\d+(/\d+)?)( port \d+(:\d+)?)?) user \{( \d+)+ \}( keep state)?$")


# The doors: chv-browser's drop-in in cell_nat_door_dir, as tasks/pf_anchor.yml reads it (slurp).
UD = "user { 410 524288 589824 }"
VARIANTS["a door's uid beside two slots, a deny list"] = dict(
    slots=2, allow=[], deny=[{"cidr": "10.0.2.101/32"}], dns=[], doors=["410\n"],
    expected=[h % UD for h in HEAD] + [
        "block drop out quick inet proto { tcp udp } to 10.0.2.101/32 %s" % UD]
    + [b % UD for b in SPECIAL] + ["pass out quick inet proto { tcp udp } all %s keep state" % UD])


def rendered(variant):
    """The anchor as the role renders it: vars/Darwin.yml's __cell_nat_door_uids
    and __cell_nat_pf_rules evaluated, then the template."""
    v = VARIANTS[variant]
    dvars = darwin_vars("cell_nat")
    slots = darwin_slots(v["slots"])
    read = {"results": [{"item": "/etc/chv-fleet/nft/door.d/d%d.uid" % i, "source": "d%d.uid" % i,
                         "content": base64.b64encode(text.encode()).decode()}
                        for i, text in enumerate(v.get("doors", []))]}
    doors = evaluate(dvars["__cell_nat_door_uids"], __cell_nat_door_read=read)
    rules = evaluate(dvars["__cell_nat_pf_rules"], cell_nat_slots=slots, __cell_nat_door_uids=doors,
                     __cell_nat_egress_allow=v["allow"], __cell_nat_egress_deny=v["deny"],
                     cell_nat_dns_resolvers=v["dns"])
    return render("cell_nat", "pf-anchor.conf.j2", cell_nat_slots=slots, __cell_nat_pf_rules=rules,
                  __cell_nat_door_uids=doors, cell_nat_door_dir="/etc/chv-fleet/nft/door.d",
                  __cell_nat_pf_anchor=dvars["__cell_nat_pf_anchor"], __cell_nat_pf_label=dvars["__cell_nat_pf_label"])


def rules_of(text):
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def check_anchor(text, expected):
    rules = rules_of(text)
    for rule in rules:
        assert RULE.match(rule), "not a rule the anchor may hold: %r" % rule
        assert rule.startswith("pass") == rule.endswith("keep state"), rule
    assert rules == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_anchor_has_exactly_the_rules_the_policy_implies(variant):
    check_anchor(rendered(variant), VARIANTS[variant]["expected"])


BREAKAGES = {
    "a rule dropped": lambda rules: rules[:2] + rules[3:],
    "a rule added": lambda rules: rules + ["pass out quick inet proto tcp to 192.0.2.1 port 80 user { 524288 } keep state"],
    "two rules swapped": lambda rules: [rules[1], rules[0]] + rules[2:],
    "a user missing": lambda rules: [r.replace(" 589824", "") for r in rules],
    "not quick": lambda rules: [rules[0].replace(" quick", "")] + rules[1:],
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_check_rejects_a_broken_anchor(breakage):
    variant = "allow list with a carve-out, ports and a range"
    text = rendered(variant)
    check_anchor(text, VARIANTS[variant]["expected"])  # control
    header = [line for line in text.splitlines() if line.startswith("#")]
    broken = "\n".join(header + BREAKAGES[breakage](rules_of(text))) + "\n"
    with pytest.raises(AssertionError):
        check_anchor(broken, VARIANTS[variant]["expected"])


def test_the_header_names_the_anchor_and_its_loader_and_never_pf_conf_as_edited():
    text = rendered("open egress, two slots")
    assert "pf anchor com.apple/chv.fleet" in text and "org.chv-fleet.cell-pf" in text
    assert "/etc/pf.conf is never edited" in text
    assert "uids none yet" in text
    assert "uids 410: the drop-ins of /etc/chv-fleet/nft/door.d" in rendered("a door's uid beside two slots, a deny list")


@pytest.mark.parametrize("allow, deny, dns, message", [
    ([{"cidr": "203.0.113.0/24"}], [{"cidr": "203.0.0.0/16"}], [], "overlaps"),
    (["example.com"], [], [], "neither an IPv4 CIDR"),
    ([], [], ["::1"], "dns_resolvers"),
    ([{"cidr": "10.0.0.0/8", "ports": [70000]}], [], [], "1-65535"),
])
def test_the_egress_variables_are_checked_as_on_linux(allow, deny, dns, message):
    with pytest.raises(CellNatError, match=message):
        anchor_rules([524288], allow, deny, dns)


def test_no_slot_user_means_no_anchor():
    with pytest.raises(CellNatError):
        anchor_rules([], [], [], [])
    # the filter with no slots yet (site.yml's validation) only checks the lists
    assert pf_anchor_rules([], [{"cidr": "192.0.2.0/24"}]) == []
