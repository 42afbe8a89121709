# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The resolvers the chv-cell launcher hands cells when the cell policy
names none (``chv_cell_dns_servers`` empty), from the guest's files, by the
launcher's own rule (``chv_guest.cell.resolver.effective_upstream``, in
the collection's src/): the cell_nat role puts them in the
ruleset's ``dns_resolvers`` set, so that a resolver on a private address
(10.x or 192.168.x from DHCP) still answers cells, on tcp/udp 53 only,
while the rest of its range stays denied.

Documentation lives beside this file (cell_resolvers.yml), as ansible-core
2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import ipaddress

from ansible.errors import AnsibleFilterError
from ansible_collections.chv.fleet.src.chv_guest.cell import resolver


def cell_resolvers(resolv_conf, resolved_conf=''):
    """IPv4 resolvers a cell gets from ``resolv_conf`` (the guest's
    /etc/resolv.conf) and ``resolved_conf`` (systemd-resolved's upstream
    list, read when resolv.conf names only loopback resolvers).  IPv6 ones
    are left out (cells have no IPv6 path); none usable gives [] (the
    launcher then refuses every cell)."""
    for name, value in (('resolv_conf', resolv_conf), ('resolved_conf', resolved_conf)):
        if value is not None and not isinstance(value, str):
            raise AnsibleFilterError('chv.fleet.cell_resolvers: %s must be the text of a resolv.conf, got %s'
                                     % (name, type(value).__name__))
    try:
        servers, _search = resolver.effective_upstream(resolv_conf or '', resolved_conf or None)
    except resolver.ResolverError:
        return []
    return [s for s in servers if ipaddress.ip_address(s).version == 4]


class FilterModule(object):
    """chv.fleet resolver filter."""

    def filters(self):
        return {'cell_resolvers': cell_resolvers}
