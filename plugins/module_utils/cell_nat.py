# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Pure logic of the chv.fleet.cell_nat role (standard library only).

Everything the role decides before it touches a host lives here, so that
it is unit-tested and shared by the ``cell_nat_info`` module and the tests
that load the rendered ruleset into network namespaces:

* validation of the role's variables, with the variable's name in every
  error (``CellNatError``);
* the slot list, from the role variable or from the identity ledger;
* uplink discovery from ``ip -j route show default``;
* coexistence: foreign base chains on the forward/input hooks that may drop
  cell traffic, from ``nft -j list ruleset``;
* ``build_ruleset``: the data the nft template renders.  Per-slot data are
  set and map elements only, so the rule count does not depend on the
  number of slots;
* the doors: the socket owner UIDs whose traffic on the guest itself gets
  the cells' egress policy (the slots' UID ranges, which sync workers run
  as; chv-browser's UID is added by the browser role's drop-in);
* the private and special-purpose ranges (``SPECIAL_PURPOSE``) denied to
  cells and doors by default, and the allow entries that open one of them
  (carve-outs, ``split_allow``).
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import ipaddress
import json
import re

TABLE_FAMILY = "inet"
TABLE_NAME = "chv_cell"

# Interface names: at most IFNAMSIZ-1 = 15 bytes, no '/', no whitespace,
# no quote (they are rendered inside double quotes in the ruleset).
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:@+-]{1,15}\Z")
# Slot names become part of nft object names (<slot>_accepted/_dropped).
_SLOT_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,47}\Z")
# Prefix of the slots' host-side interfaces: a wildcard ("chvh*") in the
# ruleset drops traffic of interfaces that carry it but are no current slot.
_IFNAME_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,12}\Z")
UID_MAX = 2 ** 32 - 2
# What an IPv4 CIDR with a typo looks like (as opposed to a name, URL or host:port).
_IPV4ISH_RE = re.compile(r"^[0-9./\s]*\Z")
_PORT_RANGE_RE = re.compile(r"^\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?\Z")

PROTOCOLS = ("tcp", "udp")
LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")

# The private and special-purpose IPv4 ranges (RFC 6890 and the registries it
# started: RFC 1918, 6598, 5737, 7526, 2544, 5771...), the one home of the
# list: denied to cells and doors by default (counter drop_special_range),
# in the Linux ruleset and the macOS pf anchor alike. Not a role variable, so
# that no override can empty it: an operator opens one range with an allow
# entry that lies inside it (a carve-out, split_allow). IPv6 needs no list:
# cells and doors have no IPv6 path at all (drop_ipv6).
SPECIAL_PURPOSE = (
    ("0.0.0.0/8", "this network (RFC 791, RFC 6890)"),
    ("10.0.0.0/8", "private use (RFC 1918)"),
    ("100.64.0.0/10", "shared address space, carrier-grade NAT (RFC 6598)"),
    ("127.0.0.0/8", "loopback (RFC 1122)"),
    ("169.254.0.0/16", "link-local, the metadata address (RFC 3927); never opened"),
    ("172.16.0.0/12", "private use (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments (RFC 6890)"),
    ("192.0.2.0/24", "documentation, TEST-NET-1 (RFC 5737)"),
    ("192.88.99.0/24", "6to4 relay anycast, deprecated (RFC 7526)"),
    ("192.168.0.0/16", "private use (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking (RFC 2544)"),
    ("198.51.100.0/24", "documentation, TEST-NET-2 (RFC 5737)"),
    ("203.0.113.0/24", "documentation, TEST-NET-3 (RFC 5737)"),
    ("224.0.0.0/4", "multicast (RFC 5771)"),
    ("240.0.0.0/4", "reserved (RFC 1112)"),
    ("255.255.255.255/32", "limited broadcast (RFC 919)"),
)
SPECIAL_PURPOSE_NETS = tuple(ipaddress.IPv4Network(cidr) for cidr, _comment in SPECIAL_PURPOSE)
# Hooks and families on which a foreign chain can drop cell traffic.
# ip6 chains are ignored: cells have no IPv6 path at all.
CONFLICT_HOOKS = ("forward", "input")
CONFLICT_FAMILIES = ("ip", "inet")

# Named counters, one per verdict and reason (see docs/network.md).
VERDICT_COUNTERS = (
    ("accept_egress", "cell egress accepted (new and established)"),
    ("accept_reply", "replies forwarded back into cells"),
    ("accept_guest_established", "cell packets to the guest in guest-initiated or established flows"),
    ("accept_dns", "cell DNS queries to allowed resolvers"),
    ("drop_ipv6", "IPv6 from cells (cells have no IPv6 path)"),
    ("drop_spoofed", "source address outside the slot's own subnet"),
    ("drop_cell_to_cell", "cell to another cell"),
    ("drop_cell_to_guest", "cell to the guest's own addresses and services"),
    ("drop_link_local", "cell to 169.254.0.0/16 (metadata address included)"),
    ("drop_denied", "destination on the egress deny list"),
    ("drop_special_range", "destination in a private or special-purpose range no allow entry opens"),
    ("accept_carve_out", "new connections to a special-purpose range an allow entry opens (carve-out)"),
    ("drop_not_allowed", "destination not on the egress allow list (allow-list mode)"),
    ("drop_not_uplink", "egress through an interface other than the uplink"),
    ("drop_invalid", "conntrack state invalid"),
    ("drop_ratelimit", "new connections over the per-destination rate limit"),
    ("drop_inbound", "unsolicited traffic forwarded towards a cell"),
    ("drop_stale_cell", "an interface with the cell prefix that is no current slot (released or foreign)"),
    ("accept_door", "door traffic (sync, browser) accepted by the cells' egress policy"),
    ("drop_door_to_guest", "door traffic to the guest itself (loopback or any own address)"),
    ("drop_door_to_cell", "door traffic to a cell subnet"),
    ("nat_masquerade", "connections masqueraded out of the uplink"),
)


class CellNatError(ValueError):
    """A validation error; the message names the offending variable."""


# --------------------------------------------------------------- helpers

def _label(prefix, name):
    return "%s%s" % (prefix or "", name)


def parse_ipv4_network(value, label):
    """Return an IPv4Network for 'a.b.c.d' or 'a.b.c.d/n' (host bits must be zero)."""
    if not isinstance(value, str) or not value.strip():
        raise CellNatError("%s: %r is not an IPv4 CIDR" % (label, value))
    text = value.strip()
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise CellNatError("%s: %r is not a valid IPv4 CIDR (%s)" % (label, value, exc))
    if net.version != 4:
        raise CellNatError("%s: %r is IPv6; cells have no IPv6 path, only IPv4 CIDRs are accepted" % (label, value))
    return net


def _is_ip_network(text):
    try:
        ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return False
    return True


def parse_ipv4_address(value, label):
    if not isinstance(value, str):
        raise CellNatError("%s: %r is not an IPv4 address" % (label, value))
    try:
        addr = ipaddress.ip_address(value.strip())
    except ValueError:
        raise CellNatError("%s: %r is not a valid IPv4 address" % (label, value))
    if addr.version != 4:
        raise CellNatError("%s: %r is IPv6; only IPv4 addresses are accepted" % (label, value))
    return addr


def validate_ifname(value, label):
    if not isinstance(value, str) or not _IFNAME_RE.match(value) or len(value.encode("utf-8")) > 15:
        raise CellNatError(
            "%s: %r is not a valid interface name (1-15 bytes of letters, digits, '_.:@+-')" % (label, value))
    return value


def parse_ports(value, label):
    """Ports as a sorted, merged tuple of (low, high) ranges, or None for all ports."""
    if value is None:
        return None
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise CellNatError("%s: %r is not a list of ports or port ranges" % (label, value))
    ranges = []
    for item in value:
        if isinstance(item, bool):
            raise CellNatError("%s: %r is not a port" % (label, item))
        if isinstance(item, int):
            low = high = item
        else:
            match = _PORT_RANGE_RE.match(str(item))
            if not match:
                raise CellNatError("%s: %r is not a port or a 'low-high' range" % (label, item))
            low = int(match.group(1))
            high = int(match.group(2)) if match.group(2) else low
        if not (1 <= low <= high <= 65535):
            raise CellNatError("%s: %r is not a port range within 1-65535" % (label, item))
        ranges.append((low, high))
    ranges.sort()
    merged = [ranges[0]]
    for low, high in ranges[1:]:
        if low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


# ---------------------------------------------------------- egress lists

class EgressEntry(object):
    """One allow/deny entry: a network and optionally protocols and ports.

    ``protos is None`` means every protocol (and every port); otherwise
    ``protos`` is a tuple of 'tcp'/'udp' and ``ports`` a tuple of ranges.
    """

    __slots__ = ("net", "protos", "ports", "label", "comment")

    def __init__(self, net, protos=None, ports=None, label="", comment=""):
        self.net = net
        self.protos = protos
        self.ports = ports if protos is not None else None
        if protos is not None and self.ports is None:
            self.ports = ((1, 65535),)
        self.label = label
        self.comment = comment

    def describe(self):
        text = str(self.net)
        if self.protos is not None:
            text += " %s/%s" % ("+".join(self.protos), ",".join(_fmt_range(r) for r in self.ports))
        return text

    def nft_port_elements(self):
        """Elements for an 'ipv4_addr . inet_proto . inet_service' set."""
        return ["%s . %s . %s" % (self.net, proto, _fmt_range(r)) for proto in self.protos for r in self.ports]


def _fmt_range(rng):
    return str(rng[0]) if rng[0] == rng[1] else "%d-%d" % rng


def _ranges_intersect(a, b):
    return any(x[0] <= y[1] and y[0] <= x[1] for x in a for y in b)


def _ranges_subset(a, b):
    """Every port of ranges a is inside ranges b (b is merged, so one range must hold it)."""
    return all(any(y[0] <= x[0] and x[1] <= y[1] for y in b) for x in a)


def entries_intersect(a, b):
    if not a.net.overlaps(b.net):
        return False
    if a.protos is None or b.protos is None:
        return True
    if not set(a.protos) & set(b.protos):
        return False
    return _ranges_intersect(a.ports, b.ports)


def entry_subset(a, b):
    """True when every packet matched by a is matched by b."""
    if not a.net.subnet_of(b.net):
        return False
    if b.protos is None:
        return True
    if a.protos is None:
        return False
    return set(a.protos) <= set(b.protos) and _ranges_subset(a.ports, b.ports)


def special_range_of(net):
    """The (cidr, comment) of SPECIAL_PURPOSE holding all of ``net``, or None."""
    for (cidr, comment), special in zip(SPECIAL_PURPOSE, SPECIAL_PURPOSE_NETS):
        if net.subnet_of(special):
            return cidr, comment
    return None


def special_purpose_nets():
    """SPECIAL_PURPOSE as the disjoint networks an nft interval set takes
    (240.0.0.0/4 holds 255.255.255.255/32), as strings."""
    return [str(n) for n in ipaddress.collapse_addresses(SPECIAL_PURPOSE_NETS)]


def _only_special(net):
    """Whether every address of ``net`` is in some special-purpose range."""
    covered = 0
    for special in ipaddress.collapse_addresses(SPECIAL_PURPOSE_NETS):
        if special.subnet_of(net):
            covered += special.num_addresses
        elif net.subnet_of(special):
            return True
    return covered == net.num_addresses


def split_allow(allow):
    """(carve-outs, the other allow entries).

    A carve-out is an allow entry lying inside one special-purpose range: it
    opens just that range, beating the default deny.  Every other allow entry
    reaches only addresses outside the special-purpose ranges (0.0.0.0/0
    means every public address), whatever it overlaps.
    """
    carve, general = [], []
    for entry in allow:
        (carve if special_range_of(entry.net) else general).append(entry)
    return carve, general


def iter_entries(entries, label, key, keys, shape):
    """(the entry's label, its ``key``'s label, the mapping) for each entry
    of a list of mappings with ``key`` (a string stands for ``{key: it}``),
    refusing a list that is none, an entry that is no mapping (``shape``
    says what it should be), unknown keys and a missing ``key``, naming the
    variable ``label`` and the entry's index."""
    if entries is None:
        return
    if not isinstance(entries, list):
        raise CellNatError("%s: must be a list of entries, got %r" % (label, entries))
    for idx, raw in enumerate(entries):
        item = "%s[%d]" % (label, idx)
        key_label = "%s.%s" % (item, key)
        if isinstance(raw, str):
            raw, key_label = {key: raw}, item
        if not isinstance(raw, dict):
            raise CellNatError("%s: %r is not %s" % (item, raw, shape))
        unknown = set(raw) - set(keys)
        if unknown:
            raise CellNatError("%s: unknown keys %s (allowed: %s)"
                               % (item, ", ".join(sorted(unknown)), ", ".join(keys)))
        if key not in raw:
            raise CellNatError("%s: '%s' is required" % (item, key))
        yield item, key_label, raw


def parse_egress_list(entries, label, allow=False):
    """Validate one allow/deny list; return a list of EgressEntry.

    ``allow``: the list is an allow list, whose carve-outs (entries inside a
    special-purpose range) may overlap its other entries: they open
    different addresses (split_allow), so they never compete.
    """
    result = []
    for item_label, cidr_label, raw in iter_entries(entries, label, "cidr", ("cidr", "proto", "ports", "comment"),
                                                    "a mapping with 'cidr' (and optional 'proto', 'ports')"):
        cidr = raw["cidr"]
        if isinstance(cidr, str) and not _IPV4ISH_RE.match(cidr) and not _is_ip_network(cidr):
            raise CellNatError("%s: %r is neither an IPv4 CIDR nor an address (host names, URLs and host:port are "
                               "not resolved; a port goes in ports)" % (cidr_label, cidr))
        net = parse_ipv4_network(cidr, cidr_label)
        proto = raw.get("proto")
        ports = parse_ports(raw.get("ports"), item_label + ".ports")
        if proto in (None, "", "any"):
            protos = PROTOCOLS if ports is not None else None
        elif proto in PROTOCOLS:
            protos = (proto,)
        else:
            raise CellNatError("%s.proto: %r is not one of tcp, udp, any" % (item_label, proto))
        comment = raw.get("comment") or ""
        if not isinstance(comment, str) or '"' in comment or "\n" in comment:
            raise CellNatError("%s.comment: must be a one-line string without double quotes" % item_label)
        entry = EgressEntry(net, protos, ports, item_label, comment)
        if allow:
            _check_allow_entry(entry, cidr_label)
        result.append(entry)
    for i, first in enumerate(result):
        for second in result[i + 1:]:
            if allow and bool(special_range_of(first.net)) != bool(special_range_of(second.net)):
                continue
            if entries_intersect(first, second):
                raise CellNatError("%s: %s overlaps %s: %s; merge or split them" % (
                    second.label, second.describe(), first.label, first.describe()))
    return result


def _check_allow_entry(entry, label):
    """An allow entry must open something: link-local is never opened (the
    metadata address; drop_link_local comes before every allow), and an
    entry made only of special-purpose addresses that is not inside one range
    would open none of them."""
    if entry.net.subnet_of(LINK_LOCAL):
        raise CellNatError("%s: %s is link-local (169.254.0.0/16, the metadata address): it is never opened, "
                           "an allow entry cannot carve it out" % (label, entry.net))
    if not special_range_of(entry.net) and _only_special(entry.net):
        ranges = [c for c, n in zip(SPECIAL_PURPOSE, SPECIAL_PURPOSE_NETS) if n.overlaps(entry.net)]
        raise CellNatError("%s: %s holds only special-purpose addresses (%s) but lies inside none of these "
                           "ranges, so it would open nothing: write one allow entry per range it should open"
                           % (label, entry.net, ", ".join(c for c, _n in ranges)))


def check_allow_deny(allow, deny):
    """Fail on ambiguous overlaps between allow and deny entries.

    The deny list always wins at run time (its rules come first).  The only
    overlap accepted here is a carve-out: a deny entry strictly inside one
    allow entry ("allow 203.0.113.0/24 but not 203.0.113.9").  Any other
    overlap (an allow entry partly or wholly shadowed by a deny entry) is a
    configuration error.
    """
    for d in deny:
        for a in allow:
            if not entries_intersect(a, d):
                continue
            if entry_subset(d, a) and not entry_subset(a, d):
                continue
            raise CellNatError(
                "%s: %s overlaps %s: %s; the deny list would silently override part of the allow "
                "entry. Make the allow entry exclude it, or make the deny entry a strict subset "
                "(carve-out) of one allow entry" % (a.label, a.describe(), d.label, d.describe()))


# ----------------------------------------------------------------- slots

def slots_from_ledger(data, label="ledger"):
    """Slot records from the cell_identity ledger, ordered by index."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise CellNatError("%s: not valid JSON (%s)" % (label, exc))
    if not isinstance(data, dict) or not isinstance(data.get("slots", {}), dict):
        raise CellNatError("%s: expected an object with a 'slots' mapping" % label)
    records = []
    for name, record in data.get("slots", {}).items():
        if not isinstance(record, dict):
            raise CellNatError("%s: slot %r is not an object" % (label, name))
        record = dict(record)
        record.setdefault("name", name)
        records.append(record)
    records.sort(key=lambda r: (r.get("index") if isinstance(r.get("index"), int) else 1 << 30, str(r["name"])))
    return records


def normalize_slot_records(slots, label):
    """Validate slot identity records; keep what the ruleset needs."""
    if slots is None:
        return []
    if not isinstance(slots, list):
        raise CellNatError("%s: must be a list of slot identity records, got %r" % (label, type(slots).__name__))
    result = []
    seen_names, seen_ifs = {}, {}
    for idx, rec in enumerate(slots):
        item = "%s[%d]" % (label, idx)
        if not isinstance(rec, dict):
            raise CellNatError("%s: %r is not a slot identity record" % (item, rec))
        for key in ("name", "host_ifname", "subnet"):
            if key not in rec:
                raise CellNatError("%s: missing '%s'" % (item, key))
        name = rec["name"]
        if not isinstance(name, str) or not _SLOT_NAME_RE.match(name):
            raise CellNatError("%s.name: %r must match %s" % (item, name, _SLOT_NAME_RE.pattern))
        ifname = validate_ifname(rec["host_ifname"], item + ".host_ifname")
        subnet = parse_ipv4_network(rec["subnet"], item + ".subnet")
        gateway = None
        if rec.get("gateway"):
            gateway = parse_ipv4_address(rec["gateway"], item + ".gateway")
            if gateway not in subnet:
                raise CellNatError("%s.gateway: %s is not inside subnet %s" % (item, gateway, subnet))
        if name in seen_names:
            raise CellNatError("%s.name: %r duplicates %s" % (item, name, seen_names[name]))
        if ifname in seen_ifs:
            raise CellNatError("%s.host_ifname: %r duplicates %s" % (item, ifname, seen_ifs[ifname]))
        for other in result:
            if subnet.overlaps(ipaddress.ip_network(other["subnet"])):
                raise CellNatError("%s.subnet: %s overlaps slot %s (%s)" % (item, subnet, other["name"], other["subnet"]))
        if subnet.overlaps(LINK_LOCAL):
            raise CellNatError("%s.subnet: %s is link-local" % (item, subnet))
        uid_range = None
        if rec.get("uid_base") is not None or rec.get("uid_size") is not None:
            base, size = rec.get("uid_base"), rec.get("uid_size")
            for key, value in (("uid_base", base), ("uid_size", size)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise CellNatError("%s.%s: %r is not an integer" % (item, key, value))
            if base < 1 or size < 1 or base + size - 1 > UID_MAX:
                raise CellNatError("%s: uid range %d+%d is out of bounds" % (item, base, size))
            uid_range = (base, base + size - 1)
        seen_names[name] = item
        seen_ifs[ifname] = item
        result.append({
            "name": name,
            "host_ifname": ifname,
            "subnet": str(subnet),
            "gateway": str(gateway) if gateway else None,
            "uid_range": uid_range,
        })
    return result


def validate_ifname_prefix(value, label):
    if not isinstance(value, str) or not _IFNAME_PREFIX_RE.match(value):
        raise CellNatError("%s: %r must be 1-12 characters of letters, digits, '_.-'" % (label, value))
    return value


def door_uid_ranges(slots):
    """Merged, sorted UID ranges of the slots ("a-b" or "a" strings for nft).

    Sync workers run as their slot's range (the workspace owner); in the
    shared UID mode several slots have the same range, listed once.
    """
    ranges = sorted(set(s["uid_range"] for s in slots if s.get("uid_range")))
    merged = []
    for low, high in ranges:
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return [str(a) if a == b else "%d-%d" % (a, b) for a, b in merged]


# ---------------------------------------------------------------- uplink

def default_route_dev(route_json):
    """The device of the preferred IPv4 default route in ``ip -j route show default``.

    Returns None when there is no default route with a device.  Among
    several default routes the lowest metric wins (absent metric = 0), as
    the kernel does; unreachable/blackhole routes have no 'dev' and are
    skipped.
    """
    if isinstance(route_json, (str, bytes)):
        text = route_json.strip()
        routes = json.loads(text) if text else []
    else:
        routes = route_json or []
    best = None
    for route in routes:
        if not isinstance(route, dict) or route.get("dst") not in ("default", "0.0.0.0/0"):
            continue
        if route.get("type", "unicast") != "unicast" or "linkdown" in (route.get("flags") or []):
            continue
        dev = route.get("dev")
        if not dev and route.get("nexthops"):
            dev = route["nexthops"][0].get("dev")
        if not dev:
            continue
        metric = route.get("metric", 0)
        if best is None or metric < best[0]:
            best = (metric, dev)
    return best[1] if best else None


def resolve_uplink(override, route_json, interfaces, label, cell_ifnames=()):
    """Return (uplink, source); fail naming the variable when it is unusable."""
    if override:
        validate_ifname(override, label)
        if interfaces is not None and override not in interfaces:
            raise CellNatError("%s: %r is not an interface on this host (have: %s)" % (
                label, override, ", ".join(sorted(interfaces)) or "none"))
        uplink, source = override, "override"
    else:
        uplink = default_route_dev(route_json)
        if not uplink:
            raise CellNatError(
                "%s: not set and this host has no IPv4 default route to discover the uplink from; "
                "set %s to the interface cells egress through" % (label, label))
        source = "default_route"
    if uplink in cell_ifnames:
        raise CellNatError("%s: uplink %r is one of the slots' host-side interfaces" % (label, uplink))
    return uplink, source


# ----------------------------------------------------------- coexistence

def _has_key(obj, keys):
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in keys or _has_key(value, keys):
                return True
    elif isinstance(obj, list):
        return any(_has_key(v, keys) for v in obj)
    return False


def _jump_targets(expr):
    targets = []
    if isinstance(expr, dict):
        for key, value in expr.items():
            if key in ("jump", "goto") and isinstance(value, dict) and "target" in value:
                targets.append(value["target"])
            else:
                targets.extend(_jump_targets(value))
    elif isinstance(expr, list):
        for value in expr:
            targets.extend(_jump_targets(value))
    return targets


def table_loaded(ruleset, own=(TABLE_FAMILY, TABLE_NAME)):
    """Whether the kernel has the collection's table: ``ruleset`` is the
    text or parsed output of ``nft -j list ruleset``."""
    if isinstance(ruleset, (str, bytes)):
        ruleset = json.loads(ruleset) if ruleset.strip() else {"nftables": []}
    items = ruleset.get("nftables", []) if isinstance(ruleset, dict) else []
    return any((item["table"].get("family"), item["table"].get("name")) == tuple(own)
               for item in items if isinstance(item.get("table"), dict))


def detect_conflicts(ruleset, own=(TABLE_FAMILY, TABLE_NAME)):
    """Foreign base chains on forward/input hooks that may drop cell traffic.

    ``ruleset`` is the text or parsed output of ``nft -j list ruleset``.
    A base chain is reported when its policy is drop, or when it (or a
    chain it jumps/gotos to in the same table) holds a rule with a drop or
    reject verdict.  Returns a list of dicts sorted by family/table/chain.
    """
    if isinstance(ruleset, (str, bytes)):
        ruleset = json.loads(ruleset) if ruleset.strip() else {"nftables": []}
    items = ruleset.get("nftables", []) if isinstance(ruleset, dict) else []
    chains, rules = {}, {}
    for item in items:
        if "chain" in item:
            c = item["chain"]
            chains[(c.get("family"), c.get("table"), c.get("name"))] = c
        elif "rule" in item:
            r = item["rule"]
            rules.setdefault((r.get("family"), r.get("table"), r.get("chain")), []).append(r)

    def dropping_rules(key, seen):
        if key in seen:
            return []
        seen.add(key)
        found = []
        for rule in rules.get(key, []):
            expr = rule.get("expr", [])
            if _has_key(expr, ("drop", "reject")):
                found.append("%s rule handle %s" % (key[2], rule.get("handle")))
            for target in _jump_targets(expr):
                found.extend(dropping_rules((key[0], key[1], target), seen))
        return found

    conflicts = []
    for key, chain in chains.items():
        family, table, name = key
        if (family, table) == tuple(own) or chain.get("hook") not in CONFLICT_HOOKS:
            continue
        if family not in CONFLICT_FAMILIES:
            continue
        reasons = []
        if chain.get("policy") == "drop":
            reasons.append("policy drop")
        drops = dropping_rules(key, set())
        if drops:
            reasons.append("drop/reject rules: %s" % ", ".join(drops))
        if reasons:
            conflicts.append({
                "family": family,
                "table": table,
                "chain": name,
                "hook": chain.get("hook"),
                "priority": chain.get("prio"),
                "policy": chain.get("policy", "accept"),
                "reasons": reasons,
            })
    conflicts.sort(key=lambda c: (c["family"], c["table"], c["chain"]))
    return conflicts


def conflict_message(conflict):
    return ("table %s %s, chain %s (hook %s, priority %s): %s; it may drop cell traffic that "
            "table %s %s accepts" % (conflict["family"], conflict["table"], conflict["chain"], conflict["hook"],
                                     conflict["priority"], "; ".join(conflict["reasons"]),
                                     TABLE_FAMILY, TABLE_NAME))


# --------------------------------------------------------------- ruleset

def build_ruleset(slots, uplink, allow=(), deny=(), dns_resolvers=(), dns_via_gateway=False,
                  ratelimit=0, ratelimit_burst=10, ifname_prefix="chvh", door_dir=""):
    """Data for templates/cell-nat.nft.j2 (already validated inputs).

    ``slots`` as returned by normalize_slot_records, ``allow``/``deny`` lists of
    EgressEntry, ``dns_resolvers`` list of address strings.
    """
    def nets(entries):
        return [str(e.net) for e in entries if e.protos is None]

    def ports(entries):
        return [el for e in entries if e.protos is not None for el in e.nft_port_elements()]

    carve, general = split_allow(allow)

    return {
        "family": TABLE_FAMILY,
        "table": TABLE_NAME,
        "uplink": uplink,
        "slots": [dict(s, counter_accepted=s["name"] + "_accepted", counter_dropped=s["name"] + "_dropped")
                  for s in slots],
        "counters": [{"name": n, "comment": c} for n, c in VERDICT_COUNTERS],
        "allow_mode": bool(allow),
        "allow_nets": nets(general),
        "allow_ports": ports(general),
        "special_ranges": [{"cidr": c, "comment": n} for c, n in SPECIAL_PURPOSE],
        "special_nets": special_purpose_nets(),
        "carve_nets": nets(carve),
        "carve_ports": ports(carve),
        "deny_nets": nets(deny),
        "deny_ports": ports(deny),
        "dns_resolvers": [str(a) for a in dns_resolvers],
        "dns_via_gateway": bool(dns_via_gateway),
        "ratelimit": int(ratelimit or 0),
        "ratelimit_burst": int(ratelimit_burst or 1),
        "ifname_prefix": ifname_prefix,
        "door_uids": door_uid_ranges(slots),
        "door_dir": door_dir,
    }


def plan(params, interfaces, route_json, prefix="cell_nat_"):
    """Validate everything the role was given and return the ruleset data.

    ``params`` keys: slots, uplink, egress_allow, egress_deny,
    dns_resolvers, dns_via_gateway, ratelimit, ratelimit_burst,
    ifname_prefix, door_dir.
    ``interfaces``: names present on the host (None = do not check).
    Raises CellNatError naming ``prefix + key`` on the first problem.
    """
    slots = normalize_slot_records(params.get("slots") or [], _label(prefix, "slots"))
    allow = parse_egress_list(params.get("egress_allow") or [], _label(prefix, "egress_allow"), allow=True)
    deny = parse_egress_list(params.get("egress_deny") or [], _label(prefix, "egress_deny"))
    check_allow_deny(allow, deny)
    resolvers = []
    for idx, value in enumerate(params.get("dns_resolvers") or []):
        addr = parse_ipv4_address(value, "%s[%d]" % (_label(prefix, "dns_resolvers"), idx))
        if addr in resolvers:
            raise CellNatError("%s[%d]: %s is listed twice" % (_label(prefix, "dns_resolvers"), idx, addr))
        if addr in LINK_LOCAL:
            raise CellNatError("%s[%d]: %s is link-local" % (_label(prefix, "dns_resolvers"), idx, addr))
        resolvers.append(addr)
    ratelimit = params.get("ratelimit") or 0
    burst = params.get("ratelimit_burst")
    burst = 10 if burst is None else burst
    for key, value in (("ratelimit", ratelimit), ("ratelimit_burst", burst)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CellNatError("%s: %r must be a non-negative integer" % (_label(prefix, key), value))
    if ratelimit and not burst:
        raise CellNatError("%s: must be at least 1 when %s is set" % (
            _label(prefix, "ratelimit_burst"), _label(prefix, "ratelimit")))
    ifname_prefix = validate_ifname_prefix(params.get("ifname_prefix", "chvh"), _label(prefix, "ifname_prefix"))
    for s in slots:
        if not s["host_ifname"].startswith(ifname_prefix):
            raise CellNatError("%s: slot %s's interface %s does not start with %r; stale-interface rules would "
                               "drop it" % (_label(prefix, "ifname_prefix"), s["name"], s["host_ifname"],
                                            ifname_prefix))
    door_dir = params.get("door_dir") or ""
    if door_dir and (not door_dir.startswith("/") or '"' in door_dir or "*" in door_dir or "\n" in door_dir):
        raise CellNatError("%s: %r must be an absolute path without quotes or wildcards" % (
            _label(prefix, "door_dir"), door_dir))
    uplink, source = resolve_uplink(params.get("uplink"), route_json, interfaces, _label(prefix, "uplink"),
                                    [s["host_ifname"] for s in slots])
    data = build_ruleset(slots, uplink, allow, deny, resolvers, params.get("dns_via_gateway"),
                         ratelimit, burst or 1, ifname_prefix, door_dir.rstrip("/"))
    data["uplink_source"] = source
    return data
