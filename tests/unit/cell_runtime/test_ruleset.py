"""The interpretation of `nft -j list table inet chv_cell` (chv_cell.ruleset).

The listings below are real nft 1.0.6 output (Debian 12), captured from a
table loaded in a throwaway network namespace.
"""

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chv_guest.cell import ruleset

FULL = json.loads(
    '{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, '
    '{"table": {"family": "inet", "name": "chv_cell", "handle": 1}}, '
    '{"set": {"family": "inet", "name": "cell_ifs", "table": "chv_cell", "type": "ifname", "handle": 4, '
    '"elem": ["lth20", "lth21"]}}, '
    '{"set": {"family": "inet", "name": "empty_ifs", "table": "chv_cell", "type": "ifname", "handle": 5}}, '
    '{"set": {"family": "inet", "name": "slot_src", "table": "chv_cell", "type": ["ifname", "ipv4_addr"], '
    '"handle": 6, "flags": ["interval"], "elem": [{"concat": ["lth20", {"prefix": {"addr": "10.231.20.0", '
    '"len": 24}}]}, {"concat": ["lth21", {"prefix": {"addr": "10.231.21.0", "len": 24}}]}]}}, '
    '{"chain": {"family": "inet", "table": "chv_cell", "name": "forward", "handle": 1, "type": "filter", '
    '"hook": "forward", "prio": 0, "policy": "accept"}}, '
    '{"chain": {"family": "inet", "table": "chv_cell", "name": "input", "handle": 2, "type": "filter", '
    '"hook": "input", "prio": 0, "policy": "accept"}}, '
    '{"chain": {"family": "inet", "table": "chv_cell", "name": "from_cell", "handle": 3}}]}'
)
# A set with counters and comments: nft writes each element as {"elem": {"val": ...}}.
COUNTED_SET = json.loads(
    '{"set": {"family": "inet", "name": "cell_ifs", "table": "chv_cell", "type": "ifname", "handle": 1, '
    '"elem": [{"elem": {"val": "lth20", "comment": "slot0", "counter": {"packets": 0, "bytes": 0}}}, '
    '{"elem": {"val": "lth21", "counter": {"packets": 0, "bytes": 0}}}], "stmt": [{"counter": null}]}}'
)


def text(doc):
    return json.dumps(doc)


def without(doc, pred):
    d = copy.deepcopy(doc)
    d["nftables"] = [o for o in d["nftables"] if not pred(o)]
    return d


def test_complete_table_covers_its_slots():
    assert ruleset.missing(text(FULL), "lth20") == []
    assert ruleset.missing(text(FULL), "lth21") == []


def test_absent_table():
    (item,) = ruleset.missing(None, "lth20")
    assert "nftables table inet chv_cell is not loaded" in item and "chv-cell-nat.service" in item
    line = ruleset.refusal([item])
    assert line == ("nftables table inet chv_cell is not loaded (is chv-cell-nat.service active?); "
                    "refusing to start the cell (policy require_ruleset)")


def test_listing_without_the_table_object_counts_as_absent():
    doc = without(FULL, lambda o: "table" in o)
    assert "is not loaded" in ruleset.missing(text(doc), "lth20")[0]


def test_slot_not_in_cell_ifs_names_the_interface():
    items = ruleset.missing(text(FULL), "lth29")
    assert items == ["interface lth29 in set cell_ifs of table inet chv_cell"]
    assert "lth29" in ruleset.refusal(items) and "require_ruleset" in ruleset.refusal(items)


def test_slot_src_membership_is_not_cell_ifs_membership():
    # lth20 appears in slot_src; removing it from cell_ifs alone must be caught.
    doc = copy.deepcopy(FULL)
    for o in doc["nftables"]:
        if o.get("set", {}).get("name") == "cell_ifs":
            o["set"]["elem"] = ["lth21"]
    assert ruleset.missing(text(doc), "lth20") == ["interface lth20 in set cell_ifs of table inet chv_cell"]
    assert ruleset.missing(text(doc), "lth21") == []


@pytest.mark.parametrize("chain, hook", [("forward", "forward"), ("input", "input")])
def test_missing_base_chain(chain, hook):
    doc = without(FULL, lambda o: o.get("chain", {}).get("name") == chain)
    assert ruleset.missing(text(doc), "lth20") == ["base chain %s (hook %s) in table inet chv_cell" % (chain, hook)]


def test_regular_chain_with_the_right_name_is_not_a_base_chain():
    doc = copy.deepcopy(FULL)
    for o in doc["nftables"]:
        if o.get("chain", {}).get("name") == "forward":
            for k in ("type", "hook", "prio", "policy"):
                o["chain"].pop(k)
    assert ruleset.missing(text(doc), "lth20") == ["base chain forward (hook forward) in table inet chv_cell"]


def test_missing_set_and_empty_set():
    doc = without(FULL, lambda o: o.get("set", {}).get("name") == "cell_ifs")
    assert ruleset.missing(text(doc), "lth20") == ["set cell_ifs in table inet chv_cell"]
    doc = copy.deepcopy(FULL)
    for o in doc["nftables"]:
        if o.get("set", {}).get("name") == "cell_ifs":
            del o["set"]["elem"]  # an empty set has no "elem" key at all
    assert ruleset.missing(text(doc), "lth20") == ["interface lth20 in set cell_ifs of table inet chv_cell"]


def test_everything_missing_is_listed_together():
    doc = without(FULL, lambda o: "chain" in o or "set" in o)
    items = ruleset.missing(text(doc), "lth20")
    assert len(items) == 3
    line = ruleset.refusal(items)
    assert line.startswith("the cell_nat ruleset lacks base chain forward")
    assert "set cell_ifs" in line and line.endswith("(policy require_ruleset)")


def test_elements_with_counters_and_comments():
    doc = copy.deepcopy(FULL)
    doc["nftables"] = [o for o in doc["nftables"] if o.get("set", {}).get("name") != "cell_ifs"] + [COUNTED_SET]
    assert ruleset.missing(text(doc), "lth20") == []
    assert ruleset.missing(text(doc), "lth22") == ["interface lth22 in set cell_ifs of table inet chv_cell"]
    assert ruleset.set_elements(COUNTED_SET["set"]) == ["lth20", "lth21"]


def test_objects_of_another_table_or_family_do_not_count():
    doc = copy.deepcopy(FULL)
    for o in doc["nftables"]:
        body = next(iter(o.values()))
        if "chain" in o or "set" in o:
            body["family"] = "ip"
    assert len(ruleset.missing(text(doc), "lth20")) == 3


@pytest.mark.parametrize("bad", ["", "not json", "[]", '{"nftables": 1}'])
def test_unreadable_output_raises(bad):
    with pytest.raises(ruleset.RulesetError):
        ruleset.missing(bad, "lth20")


def test_list_command():
    assert ruleset.list_command("/usr/sbin/nft") == ["/usr/sbin/nft", "-j", "list", "table", "inet", "chv_cell"]


IFNAMES = st.from_regex(r"\A[a-z][a-z0-9]{0,14}\Z")


@given(members=st.lists(IFNAMES, max_size=8, unique=True), probe=IFNAMES)
def test_membership_property(members, probe):
    doc = copy.deepcopy(FULL)
    for o in doc["nftables"]:
        if o.get("set", {}).get("name") == "cell_ifs":
            o["set"]["elem"] = members
    items = ruleset.missing(text(doc), probe)
    assert (items == []) == (probe in members)


PROXY_COUNTER = {"counter": {"family": "inet", "name": "drop_proxy_mode", "table": "chv_cell", "handle": 9,
                             "comment": "cell packets forwarded past the guest in proxy mode (every one)",
                             "packets": 0, "bytes": 0}}


def test_a_proxy_policy_needs_the_proxy_modes_table():
    """With the policy's egress_proxy, a cidr-mode table (a cell would get the proxy variables and still
    its own way out) is refused; the proxy mode's table (its counter drop_proxy_mode) covers the slot."""
    (item,) = ruleset.missing(text(FULL), "lth20", proxy=True)
    assert item.startswith("the proxy mode (counter drop_proxy_mode;") and "chv_cell_egress_mode" in item
    proxy_table = copy.deepcopy(FULL)
    proxy_table["nftables"].append(PROXY_COUNTER)
    assert ruleset.missing(text(proxy_table), "lth20", proxy=True) == []
    assert ruleset.missing(text(FULL), "lth20") == []                 # control: cidr policy, cidr table
