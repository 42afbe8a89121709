"""chv.fleet pool filters (controller side, netaddr)."""

import ipaddress

import pytest
from ansible.errors import AnsibleFilterError
from hypothesis import given, settings, strategies as st

from ansible_collections.chv.fleet.plugins.filter import pools


def test_filters_are_registered():
    assert set(pools.FilterModule().filters()) == {'host_pool', 'cell_subnets', 'pool_overlaps'}


@pytest.mark.parametrize('args, expected', [
    (('10.192.0.0/12', 3, 16), '10.195.0.0/16'),
    (('10.192.0.0/12', 0, 16), '10.192.0.0/16'),
    (('10.192.0.0/12', 15, 16), '10.207.0.0/16'),
    (('10.192.0.0/12', 5, 20), '10.192.80.0/20'),
    (('10.200.0.0/16', 0, 16), '10.200.0.0/16'),
    (('fd00::/48', 2, 64), 'fd00:0:0:2::/64'),
    (('10.192.0.0/12', '3', '16'), '10.195.0.0/16'),
])
def test_host_pool(args, expected):
    assert pools.host_pool(*args) == expected


@pytest.mark.parametrize('args, text', [
    (('10.192.0.0/12', 16, 16), 'index 16 is out of range'),
    (('10.192.0.0/12', -1, 16), 'index -1'),
    (('10.192.0.0/12', 0, 8), 'prefix 8 does not fit 10.192.0.0/12'),
    (('10.200.1.0/12', 0, 16), 'did you mean 10.192.0.0/12'),
    (('bogus', 0, 16), "'bogus'"),
    (('10.0.0.1', 0, 16), 'no /prefix'),
    (('10.192.0.0/12', 'x', 16), "index 'x'"),
])
def test_host_pool_errors(args, text):
    with pytest.raises(AnsibleFilterError) as err:
        pools.host_pool(*args)
    assert text in str(err.value)


def test_cell_subnets():
    assert pools.cell_subnets('10.200.0.0/28', 30) == [
        '10.200.0.0/30', '10.200.0.4/30', '10.200.0.8/30', '10.200.0.12/30']
    assert len(pools.cell_subnets('10.200.0.0/16')) == 256
    assert pools.cell_subnets('10.200.0.0/16', 24, 2) == ['10.200.0.0/24', '10.200.1.0/24']
    with pytest.raises(AnsibleFilterError, match='count 5 is out of range'):
        pools.cell_subnets('10.200.0.0/28', 30, 5)
    with pytest.raises(AnsibleFilterError, match='prefix 33'):
        pools.cell_subnets('10.200.0.0/28', 33)
    with pytest.raises(AnsibleFilterError, match='too many to list'):
        pools.cell_subnets('10.0.0.0/8', 30)


def test_pool_overlaps_dict_and_list():
    hosts = {'h1': '10.200.0.0/16', 'h2': '10.201.0.0/16', 'h3': '10.200.128.0/17',
             'h4': '10.0.0.0/8', 'v6': 'fd00::/48'}
    found = pools.pool_overlaps(hosts)
    pairs = {frozenset((f['a'], f['b'])) for f in found}
    assert pairs == {frozenset(p) for p in (('h4', 'h1'), ('h4', 'h2'), ('h4', 'h3'), ('h1', 'h3'))}
    assert {'a': 'h1', 'a_pool': '10.200.0.0/16', 'b': 'h3', 'b_pool': '10.200.128.0/17'} in found
    assert pools.pool_overlaps(['10.200.0.0/16', '10.201.0.0/16']) == []
    assert pools.pool_overlaps([]) == []
    with pytest.raises(AnsibleFilterError, match='pool of h1'):
        pools.pool_overlaps({'h1': '10.200.0.1/16'})
    with pytest.raises(AnsibleFilterError, match='expected a dict'):
        pools.pool_overlaps('10.0.0.0/8')


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2 ** 16 - 1), st.integers(8, 24)), max_size=12))
def test_property_pool_overlaps_matches_brute_force(spec):
    nets = [str(ipaddress.ip_network(((10 << 24) + (base << 8), plen), strict=False)) for base, plen in spec]
    found = {frozenset((int(f['a']), int(f['b']))) for f in pools.pool_overlaps(nets)}
    expected = {frozenset((i, j)) for i in range(len(nets)) for j in range(i + 1, len(nets))
                if ipaddress.ip_network(nets[i]).overlaps(ipaddress.ip_network(nets[j]))}
    assert found == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(8, 20), st.integers(0, 8), st.data())
def test_property_host_pools_are_disjoint_and_inside(super_plen, extra, data):
    prefix = super_plen + extra
    supernet = ipaddress.ip_network('10.0.0.0/%d' % super_plen)
    indexes = data.draw(st.lists(st.integers(0, 2 ** extra - 1), unique=True, max_size=6))
    got = [pools.host_pool(str(supernet), i, prefix) for i in indexes]
    nets = [ipaddress.ip_network(g) for g in got]
    assert all(n.subnet_of(supernet) and n.prefixlen == prefix for n in nets)
    assert pools.pool_overlaps(got) == []
    for g in got:
        assert pools.cell_subnets(g, prefix)[0] == g
