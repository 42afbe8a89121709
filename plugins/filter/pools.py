# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller-side address math for per-host cell pools (netaddr).

Documentation of each filter lives beside this file (host_pool.yml,
cell_subnets.yml, pool_overlaps.yml), as ansible-core 2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

from ansible.errors import AnsibleFilterError


# Imported where a filter runs, not at the top: to find one filter of the
# collection, ansible-core loads every filter file of it into each task's
# worker process, so an import here is paid by every task that uses any
# chv.fleet filter (docs/performance.md, "Controller CPU").


def _require_netaddr(name):
    """The netaddr module, or AnsibleFilterError naming filter ``name``."""
    try:
        import netaddr  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise AnsibleFilterError('chv.fleet.%s requires the netaddr Python library on the '
                                 'controller (pip install netaddr)' % name)
    return netaddr


def _network(value, what, name):
    """Parse a CIDR string strictly: host bits must be clear."""
    netaddr = _require_netaddr(name)
    try:
        net = netaddr.IPNetwork(str(value))
    except (netaddr.AddrFormatError, ValueError, TypeError) as exc:
        raise AnsibleFilterError('chv.fleet.%s: %s %r is not a network in address/prefix form: %s'
                                 % (name, what, value, exc))
    if '/' not in str(value):
        raise AnsibleFilterError('chv.fleet.%s: %s %r has no /prefix' % (name, what, value))
    if net.ip != net.network:
        raise AnsibleFilterError('chv.fleet.%s: %s %r has host bits set; did you mean %s?'
                                 % (name, what, value, net.cidr))
    return net


def _int_arg(value, what, name):
    if isinstance(value, bool):
        raise AnsibleFilterError('chv.fleet.%s: %s %r is not an integer' % (name, what, value))
    try:
        return int(value)
    except (TypeError, ValueError):
        raise AnsibleFilterError('chv.fleet.%s: %s %r is not an integer' % (name, what, value))


def _bits(net):
    return 32 if net.version == 4 else 128


def _check_prefix(net, prefix, name):
    if not net.prefixlen <= prefix <= _bits(net):
        raise AnsibleFilterError('chv.fleet.%s: prefix %d does not fit %s: it must be between %d '
                                 'and %d' % (name, prefix, net.cidr, net.prefixlen,
                                             _bits(net)))


def host_pool(supernet, index, prefix=16):
    """The ``index``-th /``prefix`` network of ``supernet`` (0-based)."""
    netaddr = _require_netaddr('host_pool')
    net = _network(supernet, 'supernet', 'host_pool')
    index = _int_arg(index, 'index', 'host_pool')
    prefix = _int_arg(prefix, 'prefix', 'host_pool')
    _check_prefix(net, prefix, 'host_pool')
    count = 1 << (prefix - net.prefixlen)
    if not 0 <= index < count:
        raise AnsibleFilterError('chv.fleet.host_pool: index %d is out of range: %s holds %d /%d '
                                 'pools (indexes 0 to %d)' % (index, net.cidr, count, prefix,
                                                              count - 1))
    size = 1 << (_bits(net) - prefix)
    start = int(net.network) + index * size
    return str(netaddr.IPNetwork('%s/%d' % (netaddr.IPAddress(start, net.version), prefix)))


def cell_subnets(pool, prefix=24, count=None):
    """All /``prefix`` subnets of ``pool`` in order, or the first ``count``."""
    netaddr = _require_netaddr('cell_subnets')
    net = _network(pool, 'pool', 'cell_subnets')
    prefix = _int_arg(prefix, 'prefix', 'cell_subnets')
    _check_prefix(net, prefix, 'cell_subnets')
    total = 1 << (prefix - net.prefixlen)
    if count is None:
        count = total
    count = _int_arg(count, 'count', 'cell_subnets')
    if not 0 <= count <= total:
        raise AnsibleFilterError('chv.fleet.cell_subnets: count %d is out of range: %s holds %d '
                                 '/%d subnets' % (count, net.cidr, total, prefix))
    if count > 1 << 20:
        raise AnsibleFilterError('chv.fleet.cell_subnets: %d subnets is too many to list; pass '
                                 'count' % count)
    size = 1 << (_bits(net) - prefix)
    base = int(net.network)
    return ['%s/%d' % (netaddr.IPAddress(base + i * size, net.version), prefix)
            for i in range(count)]


def pool_overlaps(pools, ignore_equal=False):
    """Pairs of overlapping pools.

    ``pools`` is a dict (name -> CIDR, e.g. inventory host -> pool) or a list
    of CIDRs (named by their position).  Returns a list of dicts
    ``{a, a_pool, b, b_pool}``, empty when all pools are disjoint.  With
    ``ignore_equal``, two equal pools are not a pair (one pool shared by
    NATed hosts); only different pools that overlap are."""
    _require_netaddr('pool_overlaps')
    if isinstance(pools, dict):
        items = [(str(k), v) for k, v in pools.items()]
    elif isinstance(pools, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(pools)]
    else:
        raise AnsibleFilterError('chv.fleet.pool_overlaps: expected a dict of name -> pool or a '
                                 'list of pools, got %s' % type(pools).__name__)
    spans = []
    for name, value in items:
        net = _network(value, 'pool of %s' % name, 'pool_overlaps')
        spans.append((net.version, int(net.first), int(net.last), name, str(net.cidr)))
    spans.sort()
    found, active = [], []
    for span in spans:
        version, first = span[0], span[1]
        active = [a for a in active if a[0] == version and a[2] >= first]
        for other in active:
            if ignore_equal and other[1:3] == span[1:3]:
                continue
            found.append({'a': other[3], 'a_pool': other[4], 'b': span[3], 'b_pool': span[4]})
        active.append(span)
    found.sort(key=lambda f: (f['a'], f['b']))
    return found


class FilterModule(object):
    """chv.fleet pool filters."""

    def filters(self):
        return {
            'host_pool': host_pool,
            'cell_subnets': cell_subnets,
            'pool_overlaps': pool_overlaps,
        }
