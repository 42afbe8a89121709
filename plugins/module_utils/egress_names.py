# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Egress by name: the pure logic of the cell_nat role's proxy mode
(standard library only, issue 33, docs/network.md "Egress by name").

* ``parse_mode``: ``cidr`` (the CIDR policy, the default) or ``proxy``;
* ``parse_name`` / ``parse_name_layers``: the allow-list by name, exact
  (``api.example.com``) and wildcard (``*.example.com``: every name under
  it, not the name itself), a port per entry (443 unless given), optionally
  for one slot group; every layer (``_default``, plain, ``_group``,
  ``_host``) is checked on its own, so that an error names the very
  variable, the entry's index and the bad value;
* ``parse_slot_groups``: named sets of slots an entry may be limited to;
* ``build_proxy``: the data ``templates/egress-proxy.conf.j2`` renders into
  squid's configuration: one source ACL per slot (its subnet), the name
  and port ACLs, the addresses squid must never connect to (``dst``), the
  rules in order.

Nothing here resolves a name: squid does, after the name passed its ACLs,
and checks the address it got; the kernel (squid's UID is in the set
``door_uids``) checks the connection again with the cells' IP policy.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import ipaddress
import re
from collections import namedtuple

from ansible_collections.chv.fleet.plugins.module_utils import cell_nat
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import (
    CellNatError,
    LINK_LOCAL,
    SPECIAL_PURPOSE_NETS,
    iter_entries,
    parse_egress_list,
    split_allow,
)

MODES = ("cidr", "proxy")
DEFAULT_NAME_PORT = 443
DEFAULT_PROXY_PORT = 3128
# The layers of the name list, lowest first (debops: x_default + x + x_group + x_host).
NAME_LAYERS = ("_default", "", "_group", "_host")
# An entry of the name list: these keys only.
NAME_KEYS = ("name", "port", "slot_group", "comment")

# One label of a host name (RFC 1123: letters, digits, inner hyphens).
_LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
_GROUP_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}\Z")
# Squid's ACL names are ours (chv_...), built from slot and group names the
# checks below admit; a comment must stay on its line of squid.conf.
_COMMENT_BAD = re.compile(r"[\r\n\"\\]")
# Loopback, link-local and the guest's neighbours: squid never connects
# there, whatever a name resolves to (the special-purpose ranges, less the
# operator's carve-outs; never 127/8 or 169.254/16, which no carve-out opens).
# Counters the ruleset has in proxy mode (docs/network.md).
PROXY_COUNTERS = (
    ("accept_proxy", "cell connections to the egress proxy on the slot's own gateway"),
    ("accept_proxy_reply", "the egress proxy's packets back to cells, in connections the cells opened"),
    ("drop_proxy_mode", "cell packets forwarded past the guest in proxy mode (every one)"),
    ("drop_proxy_outside", "connections to the proxy's port that do not come from a cell or a door"),
    ("accept_door_proxy", "a door's (chv-browser, the sync worker) connections to the proxy on a slot's gateway"),
    ("drop_door_direct", "a door's packets anywhere but the proxy (proxy mode: doors go through the proxy)"),
)
# IPv6 addresses squid never connects to either (cells and doors have no
# IPv6 path at all, drop_ipv6; a name with such an AAAA record is refused
# by the proxy before the kernel would): loopback, unique local, link-local,
# site-local, multicast. Not :: nor ::ffff:0:0/96: squid keeps IPv4
# addresses as IPv4-mapped ones, so both would read as 0.0.0.0/0.
IPV6_DENIED_DST = ("::1/128", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8")
ALWAYS_DENIED_DST = (ipaddress.IPv4Network("127.0.0.0/8"), LINK_LOCAL, ipaddress.IPv4Network("0.0.0.0/8"))


def parse_mode(value, label):
    """``cidr`` or ``proxy``."""
    if value not in MODES:
        raise CellNatError("%s: %r is not one of %s" % (label, value, ", ".join(MODES)))
    return value


def _ip_literal(text):
    """Whether ``text`` reads as an IP address: IPv4 in any form the C
    resolver takes (``127.1``, ``0x7f.0.0.1``, ``2130706433``), IPv6, or
    either in brackets."""
    stripped = text.strip("[]")
    try:
        ipaddress.ip_address(stripped)
        return True
    except ValueError:
        pass
    if stripped.count(":") >= 2 and re.match(r"^[0-9a-fA-F:.]+\Z", stripped):
        return True  # IPv6 with a typo
    # inet_aton's forms: 1 to 4 parts, decimal, octal (0...) or hex (0x...)
    parts = stripped.split(".")
    return 1 <= len(parts) <= 4 and all(re.match(r"^(0[xX][0-9a-fA-F]*|[0-9]+)\Z", p) for p in parts)


def parse_name(value, label):
    """(name, wildcard): a host name, lower case, without a trailing dot.

    ``*.example.com`` is a wildcard: any name under example.com (not
    example.com itself). Refused, naming ``label`` and the value: IP
    literals (an address is an egress CIDR's business, ``cell_nat_egress_allow``),
    URLs and host:port (the port is the entry's ``port``), names of one
    label (``localhost``, a bare TLD: a resolver's search list would decide
    what they are), a wildcard anywhere but in front, and anything that is
    not letters, digits and inner hyphens (an internationalised name goes in
    its xn-- form)."""
    if not isinstance(value, str) or not value.strip():
        raise CellNatError("%s: %r is not a host name" % (label, value))
    text = value.strip().lower()
    if _ip_literal(text):
        raise CellNatError("%s: %r is an IP address, not a name: addresses go in cell_nat_egress_allow "
                           "(a CIDR), names here" % (label, value))
    if "://" in text or "/" in text or ":" in text:
        raise CellNatError("%s: %r is not a host name (a URL or host:port? give the name alone, the port in "
                           "'port')" % (label, value))
    wildcard = text.startswith("*.")
    base = text[2:] if wildcard else text
    if base.endswith("."):
        base = base[:-1]
    if "*" in base:
        raise CellNatError("%s: %r is not a name: a wildcard is only allowed as the whole first label ('*.example.com')"
                           % (label, value))
    labels = base.split(".")
    if len(base) > 253 or not all(_LABEL_RE.match(part) for part in labels):
        raise CellNatError("%s: %r is not a host name (labels of 1-63 letters, digits and inner hyphens, "
                           "253 characters in all; an internationalised name in its xn-- form)" % (label, value))
    if len(labels) < 2:
        raise CellNatError("%s: %r has one label: give a fully qualified name (%s)" % (
            label, value, "'*.example.com'" if wildcard else "'host.example.com'"))
    if labels[-1].isdigit():
        raise CellNatError("%s: %r ends in a numeric label, which no top-level domain is (an address?)"
                           % (label, value))
    return ("*." + base if wildcard else base), wildcard


def _parse_port(value, label):
    if isinstance(value, bool):
        raise CellNatError("%s: %r is not a port" % (label, value))
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise CellNatError("%s: %r is not a port (1-65535)" % (label, value))
    return value


class NameEntry(namedtuple("NameEntry", "name wildcard port slot_group label comment")):
    """One allowed name: ``name`` (``*.`` in front for a wildcard), its
    ``port``, the ``slot_group`` it is limited to (None: every slot), the
    ``label`` of its entry (variable and index) and its ``comment``."""

    __slots__ = ()

    def key(self):
        return (self.name, self.port, self.slot_group)

    def base(self):
        """The name a wildcard stands under (example.com for *.example.com)."""
        return self.name[2:] if self.wildcard else self.name


def parse_name_list(entries, label, slot_groups=None):
    """One layer of the name list: a list of names or of mappings with
    ``name``, ``port`` (443), ``slot_group`` and ``comment``."""
    result = []
    for item, name_label, raw in iter_entries(entries, label, "name", NAME_KEYS,
                                              "a name or a mapping with 'name' (and optional 'port', "
                                              "'slot_group', 'comment')"):
        name, wildcard = parse_name(raw["name"], name_label)
        port = _parse_port(raw.get("port", DEFAULT_NAME_PORT), item + ".port")
        group = raw.get("slot_group")
        if group is not None:
            if not isinstance(group, str) or not _GROUP_RE.match(group):
                raise CellNatError("%s.slot_group: %r is not a slot group name" % (item, group))
            if slot_groups is not None and group not in slot_groups:
                raise CellNatError("%s.slot_group: %r is not a group of cell_nat_slot_groups (has: %s)" % (
                    item, group, ", ".join(sorted(slot_groups)) or "none"))
        comment = raw.get("comment") or ""
        if not isinstance(comment, str) or _COMMENT_BAD.search(comment):
            raise CellNatError("%s.comment: must be a one-line string without quotes or backslashes" % item)
        result.append(NameEntry(name, wildcard, port, group, item, comment))
    return result


def parse_name_layers(layers, prefix="cell_nat_", slot_groups=None):
    """The layers of ``<prefix>egress_names`` joined, lowest first, each
    entry kept once (an entry of a higher layer that a lower one has, same
    name, port and slot group, adds nothing). ``layers`` maps a suffix of
    NAME_LAYERS (``_default``, ``""``, ``_group``, ``_host``) to its list;
    errors name ``<prefix>egress_names<suffix>[index]``."""
    if layers is None:
        layers = {}
    if not isinstance(layers, dict):
        raise CellNatError("%segress_names: the layers must be a mapping of %s to lists, got %r" % (
            prefix, ", ".join(repr(s) for s in NAME_LAYERS), layers))
    unknown = set(layers) - set(NAME_LAYERS)
    if unknown:
        raise CellNatError("%segress_names: unknown layers %s" % (prefix, ", ".join(sorted(map(repr, unknown)))))
    out, seen = [], set()
    for suffix in NAME_LAYERS:
        for entry in parse_name_list(layers.get(suffix) or [], "%segress_names%s" % (prefix, suffix), slot_groups):
            if entry.key() not in seen:
                seen.add(entry.key())
                out.append(entry)
    return out


def parse_slot_groups(groups, label, slot_names=None):
    """``{group: [slot name, ...]}``; with ``slot_names`` (the host's slots,
    when known), every member must be one of them."""
    if groups is None:
        return {}
    if not isinstance(groups, dict):
        raise CellNatError("%s: must be a mapping of group names to lists of slot names, got %r" % (label, groups))
    out = {}
    for group, members in groups.items():
        item = "%s.%s" % (label, group)
        if not isinstance(group, str) or not _GROUP_RE.match(group):
            raise CellNatError("%s: %r is not a group name (a letter, then letters, digits, '_'; 32 at most)"
                               % (label, group))
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise CellNatError("%s: %r must be a non-empty list of slot names" % (item, members))
        if slot_names is not None:
            missing = [m for m in members if m not in slot_names]
            if missing:
                raise CellNatError("%s: %s %s no slot of this host (slots: %s)" % (
                    item, ", ".join(missing), "is" if len(missing) == 1 else "are",
                    ", ".join(slot_names) or "none"))
        out[group] = sorted(set(members))
    return out


def _regex_of(entry):
    """A squid dstdom_regex (POSIX extended) for a wildcard: one label or
    more in front of the base name, never the base name itself."""
    return r"^([a-z0-9-]+\.)+%s$" % re.escape(entry.base()).replace(r"\-", "-")


def denied_destinations(carve, cell_nets):
    """The addresses squid refuses to connect to (``dst``), whatever name
    resolved to them: the special-purpose ranges less the carve-outs (the
    allow entries inside one of them), the cells' subnets, and always
    loopback, 0/8 and link-local; then IPV6_DENIED_DST. Sorted, collapsed
    networks as strings."""
    remaining = list(ipaddress.collapse_addresses(SPECIAL_PURPOSE_NETS))
    for entry in carve:
        net = entry.net
        if any(net.overlaps(a) for a in ALWAYS_DENIED_DST):
            continue
        nxt = []
        for r in remaining:
            if net.subnet_of(r):
                nxt.extend(r.address_exclude(net) if net != r else [])
            elif r.subnet_of(net):
                continue
            else:
                nxt.append(r)
        remaining = nxt
    remaining.extend(ALWAYS_DENIED_DST)
    remaining.extend(cell_nets)
    return [str(n) for n in ipaddress.collapse_addresses(remaining)] + list(IPV6_DENIED_DST)


def build_proxy(slots, names, slot_groups, allow=(), port=DEFAULT_PROXY_PORT, dns_resolvers=()):
    """Data for templates/egress-proxy.conf.j2 (validated inputs).

    ``slots`` as cell_nat.normalize_slot_records returns them, ``names``
    NameEntry objects, ``slot_groups`` from parse_slot_groups, ``allow``
    the parsed cell_nat_egress_allow (its carve-outs open special-purpose
    addresses to squid as to the kernel). The rules, in squid's order:
    refuse any client that is not a cell; refuse a name no entry allows
    (before anything is resolved: a denied name never reaches a resolver);
    refuse a name that resolved to a denied address; allow an entry's name
    and port from its slots; refuse the rest."""
    by_name = dict((s["name"], s) for s in slots)
    src = [{"acl": "chv_slot_%s" % s["name"].replace("-", "_"), "slot": s["name"], "nets": [s["subnet"]]}
           for s in slots]
    groups = []
    for group in sorted(slot_groups):
        nets = [by_name[m]["subnet"] for m in slot_groups[group] if m in by_name]
        groups.append({"acl": "chv_group_%s" % group, "group": group, "nets": nets})
    used_groups = set(e.slot_group for e in names if e.slot_group)
    # a group whose slots are not on this host yet (a fresh host) gets no ACL; its entries no rule
    group_acl = dict((g["group"], g["acl"]) for g in groups if g["nets"] and g["group"] in used_groups)
    name_acls, rules, ports = [], [], []
    for idx, entry in enumerate(names):
        acl = "chv_name_%d" % idx
        if entry.wildcard:
            name_acls.append({"acl": acl, "type": "dstdom_regex", "flags": "-n -i", "value": _regex_of(entry),
                              "name": entry.name, "label": entry.label, "comment": entry.comment})
        else:
            name_acls.append({"acl": acl, "type": "dstdomain", "flags": "-n", "value": entry.name,
                              "name": entry.name, "label": entry.label, "comment": entry.comment})
        if entry.port not in ports:
            ports.append(entry.port)
        if entry.slot_group is None:
            who = "chv_cells"
        elif entry.slot_group in group_acl:
            who = group_acl[entry.slot_group]
        else:
            continue
        rules.append({"acl": [who, acl, "chv_port_%d" % entry.port], "label": entry.label})
    carve, _general = split_allow(list(allow))
    cell_nets = [ipaddress.IPv4Network(s["subnet"]) for s in slots]
    return {
        "port": int(port),
        "slots": src,
        "groups": [g for g in groups if g["acl"] in group_acl.values()],
        "cells": [s["subnet"] for s in slots],
        "names": name_acls,
        "exact": [n["acl"] for n in name_acls if n["type"] == "dstdomain"],
        "wild": [n["acl"] for n in name_acls if n["type"] == "dstdom_regex"],
        "ports": sorted(ports),
        "rules": rules,
        "denied_dst": denied_destinations(carve, cell_nets),
        "dns_resolvers": [str(a) for a in dns_resolvers],
    }


def plan_proxy(params, ruleset, prefix="cell_nat_"):
    """Validate the proxy's variables (``egress_mode``, the ``egress_names``
    layers, ``slot_groups``, ``proxy_port``) beside the ruleset data
    ``ruleset`` (cell_nat.plan's) and return (mode, proxy data or None).
    Names and groups are checked in both modes (site.yml validates a host
    before its mode changes); the proxy's data exist only in proxy mode."""
    mode = parse_mode(params.get("egress_mode") or "cidr", prefix + "egress_mode")
    slots = ruleset.get("slots") or []
    names_known = [s["name"] for s in slots] if slots else None
    groups = parse_slot_groups(params.get("slot_groups") or {}, prefix + "slot_groups", names_known)
    names = parse_name_layers(params.get("egress_names") or {}, prefix, groups)
    port = _parse_port(params.get("proxy_port", DEFAULT_PROXY_PORT), prefix + "proxy_port")
    if mode != "proxy":
        return mode, None
    resolvers = ruleset.get("dns_resolvers") or []
    if not resolvers:
        raise CellNatError("%sdns_resolvers: the proxy (%segress_mode: proxy) resolves names through these "
                           "resolvers, and none is set or found on the guest" % (prefix, prefix))
    for addr in resolvers:
        if ipaddress.IPv4Address(addr) in ALWAYS_DENIED_DST[0]:
            raise CellNatError("%sdns_resolvers: %s is on loopback, which the proxy may not reach (its traffic "
                               "is a door's, and doors never reach the guest itself): name the upstream "
                               "resolvers" % (prefix, addr))
    allow = parse_egress_list(params.get("egress_allow") or [], prefix + "egress_allow", allow=True)
    return mode, build_proxy(slots, names, groups, allow, port, resolvers)


def plan(params, interfaces, route_json, prefix="cell_nat_"):
    """cell_nat.plan (the ruleset) and plan_proxy together: the ruleset
    data gain ``egress_mode`` and ``proxy_port`` (None in cidr mode), and
    ``proxy`` holds squid's data (None in cidr mode)."""
    data = cell_nat.plan(params, interfaces, route_json, prefix)
    mode, proxy = plan_proxy(params, data, prefix)
    data["egress_mode"] = mode
    data["proxy_port"] = proxy["port"] if proxy else None
    if proxy:
        data["counters"] = data["counters"] + [{"name": n, "comment": c} for n, c in PROXY_COUNTERS]
    return data, proxy
