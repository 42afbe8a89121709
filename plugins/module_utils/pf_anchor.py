# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The pf rules of the chv.fleet.cell_nat role on macOS (standard library
only, pure): the slot users' outbound traffic, from the same egress
variables as the nftables ruleset on Linux (parsed and checked by
``cell_nat.parse_egress_list`` and ``cell_nat.check_allow_deny``, one home
for what an entry is).

pf matches a socket's owner (``user``) on TCP and UDP only, so every rule
names those two protocols; the rules are ``quick`` (the first match ends
the evaluation) and in this order, as the nftables egress chain:

1. IPv6: blocked (the Linux cells have no IPv6 route; nothing in the egress
   variables describes IPv6);
2. the host itself (``self``: every local address) and loopback: blocked,
   as the Linux ruleset refuses a cell the guest's services;
3. link-local (169.254.0.0/16): blocked;
4. each deny entry: blocked (the deny list always wins);
5. DNS (tcp and udp 53) to each resolver: passed;
6. each allow entry inside a special-purpose range (a carve-out): passed;
7. the private and special-purpose ranges (``cell_nat.SPECIAL_PURPOSE``):
   blocked;
8. allow-list mode (a non-empty allow list): each other allow entry passed,
   then everything else of the slot users blocked; otherwise everything
   else passed.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import ipaddress

from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import (
    LINK_LOCAL,
    CellNatError,
    check_allow_deny,
    parse_egress_list,
    special_purpose_nets,
    split_allow,
)

LOOPBACK = ipaddress.IPv4Network('127.0.0.0/8')


def _users(uids):
    uids = sorted(set(uids))
    if not uids:
        raise CellNatError('pf anchor: no slot users to filter')
    for uid in uids:
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 1:
            raise CellNatError('pf anchor: %r is not a slot user id' % (uid,))
    return 'user { %s }' % ' '.join(str(u) for u in uids)


def _protos(entry):
    return list(entry.protos) if entry.protos is not None else ['tcp', 'udp']


def _proto_text(protos):
    return 'proto %s' % protos[0] if len(protos) == 1 else 'proto { %s }' % ' '.join(protos)


def _ports(entry):
    """pf port terms of an entry: [''] for every port, else ' port N' / ' port N:M'."""
    if entry.protos is None:
        return ['']
    return [' port %d' % lo if lo == hi else ' port %d:%d' % (lo, hi) for lo, hi in entry.ports]


def _entry_rules(action, entry, users):
    rules = []
    for proto in _protos(entry) if entry.protos is not None else [None]:
        protos = _proto_text([proto] if proto else ['tcp', 'udp'])
        for port in _ports(entry):
            rules.append('%s out quick inet %s to %s%s %s%s' % (
                action, protos, entry.net, port, users, ' keep state' if action == 'pass' else ''))
    return rules


def check_egress(allow=(), deny=(), dns_resolvers=(), label='cell_nat_'):
    """The egress variables parsed and checked as on Linux: (allow entries,
    deny entries, resolver addresses); raises CellNatError naming the variable."""
    allow_entries = parse_egress_list(list(allow), label + 'egress_allow', allow=True)
    deny_entries = parse_egress_list(list(deny), label + 'egress_deny')
    check_allow_deny(allow_entries, deny_entries)
    resolvers = []
    for value in dns_resolvers:
        try:
            resolvers.append(ipaddress.IPv4Address(value))
        except ValueError:
            raise CellNatError('%sdns_resolvers: %r is not an IPv4 address' % (label, value))
    return allow_entries, deny_entries, resolvers


def anchor_rules(uids, allow=(), deny=(), dns_resolvers=(), label='cell_nat_'):
    """The anchor's rules, one string per rule, in evaluation order.

    ``uids``: the slot users' uids; ``allow``/``deny``: the egress lists as
    the role variables hold them; ``dns_resolvers``: IPv4 addresses.
    Raises CellNatError naming the variable."""
    users = _users(uids)
    allow_entries, deny_entries, resolvers = check_egress(allow, deny, dns_resolvers, label)
    both = 'proto { tcp udp }'
    rules = [
        'block drop out quick inet6 %s all %s' % (both, users),
        'block drop out quick inet %s to self %s' % (both, users),
        'block drop out quick inet %s to %s %s' % (both, LOOPBACK, users),
        'block drop out quick inet %s to %s %s' % (both, LINK_LOCAL, users),
    ]
    for entry in deny_entries:
        rules += _entry_rules('block drop', entry, users)
    for resolver in resolvers:
        rules.append('pass out quick inet %s to %s port 53 %s keep state' % (both, resolver, users))
    carve, general = split_allow(allow_entries)
    for entry in carve:
        rules += _entry_rules('pass', entry, users)
    for net in special_purpose_nets():
        rules.append('block drop out quick inet %s to %s %s' % (both, net, users))
    if allow_entries:
        for entry in general:
            rules += _entry_rules('pass', entry, users)
        rules.append('block drop out quick inet %s all %s' % (both, users))
    else:
        rules.append('pass out quick inet %s all %s keep state' % (both, users))
    return rules
