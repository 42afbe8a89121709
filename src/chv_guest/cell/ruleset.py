"""What the launcher needs from the cell_nat ruleset (standard library only).

The chv.fleet.cell_nat role owns the nftables table ``inet chv_cell``: base
chains ``forward`` (hook forward) and ``input`` (hook input), and the set
``cell_ifs`` of the slots' host-side veth names.  Without them a cell's
traffic is not filtered at all, so ``chv-cell run`` refuses to open the
start gate (policy ``require_ruleset``).

``missing(listing, host_ifname)`` interprets the output of
``nft -j list table inet chv_cell`` (None when the table does not exist) and
returns what is missing, as human-readable items; an empty list means the
slot is covered.  Pure: the runner runs nft and passes the text in.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

FAMILY = "inet"
TABLE = "chv_cell"
BASE_CHAINS = (("forward", "forward"), ("input", "input"))  # (chain name, hook)
IFNAME_SET = "cell_ifs"
SERVICE = "chv-cell-nat.service"


def list_command(nft: str) -> List[str]:
    """The command whose output ``missing`` interprets."""
    return [nft, "-j", "list", "table", FAMILY, TABLE]


class RulesetError(Exception):
    """nft's output cannot be interpreted."""


def _objects(listing: str) -> List[Tuple[str, Dict[str, Any]]]:
    try:
        doc = json.loads(listing)
    except ValueError as exc:
        raise RulesetError("nft -j output is not JSON: %s" % exc)
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise RulesetError("nft -j output has no 'nftables' list")
    out = []
    for item in doc["nftables"]:
        if isinstance(item, dict) and len(item) == 1:
            kind, body = next(iter(item.items()))
            if isinstance(body, dict):
                out.append((kind, body))
    return out


def _ours(body: Dict[str, Any]) -> bool:
    return body.get("family") == FAMILY and body.get("table", TABLE) == TABLE


def set_elements(body: Dict[str, Any]) -> List[Any]:
    """The plain values of a set's elements.  ``nft -j`` writes an element as
    a bare value, or as {"elem": {"val": value, ...}} when it carries a
    counter, timeout or comment."""
    elems = body.get("elem", [])
    if not isinstance(elems, list):
        elems = [elems]
    out = []
    for e in elems:
        if isinstance(e, dict) and isinstance(e.get("elem"), dict):
            e = e["elem"].get("val")
        out.append(e)
    return out


# The counter only a proxy-mode ruleset has (its from_cell chain drops every
# packet into it; docs/network.md "Egress by name").
PROXY_MODE_COUNTER = "drop_proxy_mode"


def missing(listing: Optional[str], host_ifname: str, proxy: bool = False) -> List[str]:
    """What the slot ``host_ifname`` needs and the listing lacks.

    ``listing`` is nft's JSON text, or None when nft said the table does not
    exist.  ``proxy``: the policy's egress_proxy is set, so the table must be
    the proxy mode's (a cell given the proxy variables under the cidr
    ruleset would still have its own way out).  Raises RulesetError when the
    text is not an nft JSON listing.
    """
    if listing is None:
        return ["nftables table %s %s is not loaded (is %s active?)" % (FAMILY, TABLE, SERVICE)]
    objs = _objects(listing)
    tables = [b for k, b in objs if k == "table" and b.get("family") == FAMILY and b.get("name") == TABLE]
    if not tables:
        return ["nftables table %s %s is not loaded (is %s active?)" % (FAMILY, TABLE, SERVICE)]
    out = []
    chains = [b for k, b in objs if k == "chain" and _ours(b)]
    for name, hook in BASE_CHAINS:
        if not any(c.get("name") == name and c.get("hook") == hook for c in chains):
            out.append("base chain %s (hook %s) in table %s %s" % (name, hook, FAMILY, TABLE))
    sets = [b for k, b in objs if k == "set" and _ours(b) and b.get("name") == IFNAME_SET]
    if not sets:
        out.append("set %s in table %s %s" % (IFNAME_SET, FAMILY, TABLE))
    elif host_ifname not in set_elements(sets[0]):
        out.append("interface %s in set %s of table %s %s" % (host_ifname, IFNAME_SET, FAMILY, TABLE))
    if proxy and not any(k == "counter" and _ours(b) and b.get("name") == PROXY_MODE_COUNTER for k, b in objs):
        out.append("the proxy mode (counter %s; the policy's egress_proxy is set but table %s %s is cidr mode's: "
                   "cell_nat_egress_mode and chv_cell_egress_mode differ)" % (PROXY_MODE_COUNTER, FAMILY, TABLE))
    return out


def refusal(items: List[str]) -> str:
    """The one stderr line of a refused run."""
    if len(items) == 1 and items[0].startswith("nftables table "):
        what = items[0]
    else:
        what = "the cell_nat ruleset lacks " + "; ".join(items)
    return "%s; refusing to start the cell (policy require_ruleset)" % what
