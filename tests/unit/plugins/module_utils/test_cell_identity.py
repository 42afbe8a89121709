"""Unit and property tests of the slot identity allocator (pure logic,
host-fact parsers, ledger format and locked ledger I/O)."""

import ipaddress
import json
import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci

POOL = '10.200.0.0/16'


def host(**kw):
    return ci.HostFacts(**kw)


def fresh(count, settings=None, host_facts=None):
    return ci.allocate(None, count, settings or ci.Settings(), host_facts or host()).ledger


# ---------------------------------------------------------------------------
# Records and the contract in docs/architecture.md

def test_first_slot_matches_the_documented_record():
    ledger = fresh(1)
    assert ledger == {
        'version': 1, 'pool': POOL, 'prefix': 24, 'uid_mode': 'per_slot',
        'slots': {'slot0': {
            'name': 'slot0', 'index': 0, 'machine': 'chv-slot0',
            'host_ifname': 'chvh0', 'cell_ifname': 'eth0',
            'subnet': '10.200.0.0/24', 'gateway': '10.200.0.1', 'address': '10.200.0.2',
            'prefixlen': 24, 'uid_base': 524288, 'uid_size': 65536}}}
    assert tuple(ledger['slots']['slot0']) == ci.RECORD_FIELDS


@pytest.mark.parametrize('prefix, subnets', [
    (30, ['10.200.0.0/30', '10.200.0.4/30', '10.200.0.8/30']),
    (29, ['10.200.0.0/29', '10.200.0.8/29', '10.200.0.16/29']),
    (28, ['10.200.0.0/28', '10.200.0.16/28', '10.200.0.32/28']),
])
def test_small_prefixes_give_gateway_and_address_inside_the_subnet(prefix, subnets):
    ledger = fresh(3, ci.Settings(prefix=prefix))
    recs = [ledger['slots']['slot%d' % i] for i in range(3)]
    assert [r['subnet'] for r in recs] == subnets
    for rec in recs:
        net = ipaddress.ip_network(rec['subnet'])
        hosts = list(net.hosts())
        assert rec['gateway'] == str(hosts[0]) and rec['address'] == str(hosts[1])
        assert rec['prefixlen'] == prefix


def test_uid_ranges_are_aligned_and_consecutive():
    ledger = fresh(3)
    assert [ledger['slots']['slot%d' % i]['uid_base'] for i in range(3)] == [
        0x80000, 0x90000, 0xA0000]


def test_shared_uid_mode_gives_every_slot_the_shared_range():
    ledger = fresh(3, ci.Settings(uid_mode='shared', shared_uid=1000))
    assert {(r['uid_base'], r['uid_size']) for r in ledger['slots'].values()} == {(1000, 65536)}
    assert ledger['uid_mode'] == 'shared'


def test_custom_names_prefixes_and_cell_ifname():
    s = ci.Settings(ifname_prefix='cv', cell_ifname='host0', machine_prefix='')
    ledger = ci.allocate(None, ['build', 'review'], s, host()).ledger
    assert ledger['slots']['review']['machine'] == 'review'
    assert ledger['slots']['review']['host_ifname'] == 'cv1'
    assert ledger['slots']['build']['cell_ifname'] == 'host0'


# ---------------------------------------------------------------------------
# Idempotence, add, remove, purge, absent

def test_same_request_twice_changes_nothing():
    first = fresh(4)
    second = ci.allocate(first, 4, ci.Settings(), host())
    assert second.ledger == first
    assert (second.added, second.removed, second.reassigned) == ([], [], [])
    assert ci.dump_ledger(second.ledger) == ci.dump_ledger(first)


def test_removed_slot_is_released_and_its_identity_reused_lowest_first():
    ledger = fresh(3)
    smaller = ci.allocate(ledger, ['slot0', 'slot2'], ci.Settings(), host())
    assert smaller.removed == ['slot1']
    assert smaller.ledger['slots']['slot2'] == ledger['slots']['slot2']
    again = ci.allocate(smaller.ledger, ['slot0', 'slot2', 'new'], ci.Settings(), host())
    new = again.ledger['slots']['new']
    old1 = ledger['slots']['slot1']
    assert (new['index'], new['subnet'], new['uid_base']) == (
        old1['index'], old1['subnet'], old1['uid_base'])
    assert again.added == ['new']


def test_input_ledger_is_not_modified():
    ledger = fresh(2)
    snapshot = json.dumps(ledger, sort_keys=True)
    ci.allocate(ledger, ['slot1', 'x'], ci.Settings(pool='10.9.0.0/16'), host(), reassign=True)
    ci.allocate(ledger, None, ci.Settings(), host(), state='absent')
    assert json.dumps(ledger, sort_keys=True) == snapshot


def test_purge_false_only_adds():
    ledger = fresh(2)
    result = ci.allocate(ledger, ['extra'], ci.Settings(), host(), purge=False)
    assert sorted(result.ledger['slots']) == ['extra', 'slot0', 'slot1']
    assert result.removed == []


def test_absent_releases_listed_or_all():
    ledger = fresh(3)
    one = ci.allocate(ledger, ['slot1'], ci.Settings(), host(), state='absent')
    assert sorted(one.ledger['slots']) == ['slot0', 'slot2'] and one.removed == ['slot1']
    every = ci.allocate(ledger, None, ci.Settings(), host(), state='absent')
    assert every.ledger['slots'] == {} and every.removed == ['slot0', 'slot1', 'slot2']


def test_present_without_slots_is_an_error():
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(None, None, ci.Settings(), host())
    assert err.value.param == 'slots'


# ---------------------------------------------------------------------------
# Collisions with the live host

def test_interface_names_in_use_are_skipped():
    ledger = fresh(2, host_facts=host(ifnames=['lo', 'eth0', 'chvh0', 'chvh01']))
    assert [ledger['slots'][n]['host_ifname'] for n in ('slot0', 'slot1')] == ['chvh1', 'chvh2']


def test_addresses_and_routes_of_any_table_are_skipped():
    facts = host(networks=[('10.200.0.0/24', 'eth0'),        # uplink network
                           ('10.200.1.77/32', None),          # blackhole, no device
                           ('10.200.2.0/23', 'wg0')])         # route in a policy table
    ledger = fresh(2, host_facts=facts)
    assert [ledger['slots'][n]['subnet'] for n in ('slot0', 'slot1')] == [
        '10.200.4.0/24', '10.200.5.0/24']


def test_default_route_is_ignored_but_its_gateway_is_reserved():
    routes = ci.parse_ip_route_json(json.dumps([
        {'dst': 'default', 'gateway': '10.200.0.1', 'dev': 'eth0'}]))
    ledger = fresh(1, host_facts=host(networks=routes))
    assert ledger['slots']['slot0']['subnet'] == '10.200.1.0/24'


def test_existing_slot_keeps_subnet_routed_on_its_own_veth():
    ledger = fresh(1)
    live = host(ifnames=['chvh0'], networks=[('10.200.0.1/24', 'chvh0'), ('10.200.0.0/24', 'chvh0')])
    result = ci.allocate(ledger, 2, ci.Settings(), live)
    assert result.ledger['slots']['slot0'] == ledger['slots']['slot0']
    assert result.conflicts == []
    assert result.ledger['slots']['slot1']['subnet'] == '10.200.1.0/24'


def test_foreign_route_over_existing_slot_is_reported_then_moved_on_request():
    ledger = fresh(2)
    live = host(networks=[('10.200.1.0/24', 'wg0')])
    kept = ci.allocate(ledger, 2, ci.Settings(), live)
    assert kept.ledger == ledger
    assert kept.conflicts == ['slot1: subnet 10.200.1.0/24 overlaps 10.200.1.0/24 on wg0']
    moved = ci.allocate(ledger, 2, ci.Settings(), live, reassign=True)
    assert moved.reassigned == ['slot1']
    rec = moved.ledger['slots']['slot1']
    assert rec['subnet'] == '10.200.2.0/24'
    assert (rec['index'], rec['uid_base']) == (1, ledger['slots']['slot1']['uid_base'])


def test_passwd_subuid_and_running_user_namespaces_are_skipped():
    facts = host(ids=[0, 1000, 0x80000 + 5],                    # a passwd UID in range 0
                 id_ranges=[(0x90000, 0x10000 + 1)],           # subuid over ranges 1 and 2
                 userns_ranges=[(0xC0000, 65536)])              # a running container: range 4
    ledger = fresh(3, host_facts=facts)
    assert sorted(r['uid_base'] for r in ledger['slots'].values()) == [0xB0000, 0xD0000, 0xE0000]


def test_subuid_added_over_existing_range_is_a_conflict():
    ledger = fresh(1)
    live = host(id_ranges=[(0x80000 + 10, 100)])
    result = ci.allocate(ledger, 1, ci.Settings(), live)
    assert result.conflicts and 'subuid/subgid' in result.conflicts[0]
    moved = ci.allocate(ledger, 1, ci.Settings(), live, reassign=True)
    assert moved.ledger['slots']['slot0']['uid_base'] == 0x90000


# ---------------------------------------------------------------------------
# Settings changes

def test_settings_change_needs_reassign_and_names_what_changed():
    ledger = fresh(2)
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(ledger, 2, ci.Settings(pool='10.201.0.0/16'), host())
    assert err.value.param == 'reassign'
    assert "pool '10.200.0.0/16' -> '10.201.0.0/16'" in str(err.value)
    assert 'slot0' in str(err.value) and 'slot1' in str(err.value)


def test_reassign_moves_only_what_no_longer_fits():
    ledger = fresh(2)
    result = ci.allocate(ledger, 2, ci.Settings(pool='10.201.0.0/16'), host(), reassign=True)
    for name in ('slot0', 'slot1'):
        old, new = ledger['slots'][name], result.ledger['slots'][name]
        assert new['subnet'].startswith('10.201.')
        assert (new['index'], new['uid_base']) == (old['index'], old['uid_base'])
    assert result.ledger['pool'] == '10.201.0.0/16'
    assert result.reassigned == ['slot0', 'slot1']


def test_wider_pool_containing_the_old_one_moves_nothing():
    ledger = fresh(2)
    result = ci.allocate(ledger, 2, ci.Settings(pool='10.200.0.0/15'), host())
    assert result.ledger['slots'] == ledger['slots'] and result.ledger['pool'] == '10.200.0.0/15'


@pytest.mark.parametrize('kwargs, param', [
    ({'uid_mode': 'shared'}, 'uid_mode'),
    ({'ifname_prefix': 've'}, 'ifname_prefix'),
    ({'cell_ifname': 'host0'}, 'cell_ifname'),
    ({'machine_prefix': 'cell-'}, 'machine_prefix'),
    ({'prefix': 28}, 'prefix'),
])
def test_each_identity_changing_choice_is_refused_without_reassign(kwargs, param):
    ledger = fresh(1)
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(ledger, 1, ci.Settings(**kwargs), host())
    assert err.value.param == 'reassign'
    assert param in str(err.value)
    moved = ci.allocate(ledger, 1, ci.Settings(**kwargs), host(), reassign=True).ledger
    ci.validate_ledger(moved)
    assert moved['slots']['slot0'] != ledger['slots']['slot0']


def test_changed_settings_on_an_empty_ledger_are_simply_taken():
    empty = ci.allocate(fresh(1), None, ci.Settings(), host(), state='absent').ledger
    result = ci.allocate(empty, 1, ci.Settings(pool='10.9.0.0/16', prefix=28), host())
    assert result.ledger['slots']['slot0']['subnet'] == '10.9.0.0/28'


# ---------------------------------------------------------------------------
# Errors name the parameter and value

@pytest.mark.parametrize('kwargs, param, text', [
    ({'pool': '10.200.1.0/16'}, 'pool', "'10.200.1.0/16'"),
    ({'pool': 'nonsense'}, 'pool', "'nonsense'"),
    ({'prefix': 31}, 'prefix', 'prefix 31'),
    ({'prefix': 12}, 'prefix', 'prefix 12 does not fit pool 10.200.0.0/16'),
    ({'uid_mode': 'pick'}, 'uid_mode', "'pick'"),
    ({'shared_uid': -1}, 'shared_uid', '-1'),
    ({'shared_uid': 2 ** 32 - 10}, 'shared_uid', str(2 ** 32 - 10)),
    ({'uid_mode': 'shared', 'shared_uid': 0}, 'shared_uid', 'shared_uid 0 with uid_mode shared'),
    ({'ifname_prefix': 'averylongprefix'}, 'ifname_prefix', "'averylongprefix'"),
    ({'ifname_prefix': 'a' * 13}, 'ifname_prefix', "%r must match [a-z][a-z0-9_-]* and be at most 12 bytes" % ('a' * 13)),
    ({'ifname_prefix': 'a' * 14}, 'ifname_prefix', "'%s'" % ('a' * 14)),
    ({'ifname_prefix': 've/'}, 'ifname_prefix', "'ve/'"),
    ({'ifname_prefix': 'chvh\n'}, 'ifname_prefix', "'chvh\\n'"),
    ({'cell_ifname': 'eth0:1'}, 'cell_ifname', "'eth0:1'"),
    ({'cell_ifname': 'a' * 16}, 'cell_ifname', 'a' * 16),
    ({'cell_ifname': 'lo'}, 'cell_ifname', "cell_ifname 'lo' is the cell's loopback interface"),
    ({'cell_ifname': 'eth0\n'}, 'cell_ifname', "'eth0\\n'"),
    ({'machine_prefix': 'Chv_'}, 'machine_prefix', "'Chv_'"),
    ({'machine_prefix': 'chv-\n'}, 'machine_prefix', "'chv-\\n'"),
    ({'pool': '127.0.0.0/16'}, 'pool', "pool '127.0.0.0/16' overlaps 127.0.0.0/8, the loopback range"),
    ({'pool': '169.254.0.0/16'}, 'pool', "pool '169.254.0.0/16' overlaps 169.254.0.0/16, the link-local range"),
    ({'pool': '169.254.7.0/24', 'prefix': 28}, 'pool', "pool '169.254.7.0/24' overlaps 169.254.0.0/16"),
    ({'pool': '224.0.0.0/16'}, 'pool', "pool '224.0.0.0/16' overlaps 224.0.0.0/4, the multicast range"),
    ({'pool': '160.0.0.0/3'}, 'pool', "pool '160.0.0.0/3' overlaps 169.254.0.0/16"),
])
def test_invalid_settings(kwargs, param, text):
    with pytest.raises(ci.AllocationError) as err:
        ci.Settings(**kwargs)
    assert err.value.param == param
    assert text in str(err.value)


@pytest.mark.parametrize('kwargs', [
    {'uid_mode': 'shared', 'shared_uid': 1},
    {'uid_mode': 'per_slot', 'shared_uid': 0},   # shared_uid only counts in uid_mode shared
    {'ifname_prefix': 'a' * 12},
    {'cell_ifname': 'lo0'},
    {'pool': '126.255.0.0/16'},
    {'pool': '128.0.0.0/16'},
    {'pool': '169.253.0.0/16'},
    {'pool': '169.255.0.0/16'},
    {'pool': '223.255.0.0/16'},
    {'pool': '240.0.0.0/16'},
])
def test_valid_settings_next_to_the_refused_ones(kwargs):
    assert len(fresh(2, ci.Settings(**kwargs))['slots']) == 2


def test_a_trailing_newline_in_a_slot_name_is_refused():
    with pytest.raises(ci.AllocationError) as err:
        ci.normalize_slot_names(['slot\n'])
    assert err.value.param == 'slots' and "'slot\\n'" in str(err.value)


def test_pool_too_small():
    with pytest.raises(ci.AllocationError) as err:
        fresh(5, ci.Settings(pool='10.200.0.0/24', prefix=26))
    assert err.value.param == 'pool'
    assert '10.200.0.0/24' in str(err.value) and '4 /26 subnets' in str(err.value)


def test_pool_exhausted_by_host_routes():
    facts = host(networks=[('10.200.0.0/26', 'eth0')])
    with pytest.raises(ci.AllocationError) as err:
        fresh(4, ci.Settings(pool='10.200.0.0/24', prefix=26), facts)
    assert err.value.param == 'pool' and "slot 'slot3'" in str(err.value)


def test_uid_exhaustion():
    facts = host(id_ranges=[(0x80000 + 0x10000, 0x6FFF0000)])
    ledger = fresh(1, host_facts=facts)
    assert ledger['slots']['slot0']['uid_base'] == 0x80000
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(ledger, 2, ci.Settings(), facts)
    assert err.value.param == 'uid_mode' and "slot 'slot1'" in str(err.value)


def test_last_uid_range_is_systemds_highest_base():
    facts = host(id_ranges=[(0x80000, ci.UID_PER_SLOT_MAX_BASE - 0x80000)])
    ledger = fresh(1, host_facts=facts)
    assert ledger['slots']['slot0']['uid_base'] == 0x6FFF0000


def test_interface_name_space_exhaustion_names_ifname_prefix():
    s = ci.Settings(ifname_prefix='abcdefghijkl')   # 12 bytes, the longest: indexes 0..999 only
    facts = host(ifnames=['abcdefghijkl%d' % i for i in range(990)])  # the host holds 0..989
    ledger = fresh(10, s, facts)
    assert sorted(r['index'] for r in ledger['slots'].values()) == list(range(990, 1000))
    assert max(len(r['host_ifname']) for r in ledger['slots'].values()) == 15
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(ledger, 11, s, facts)
    assert err.value.param == 'ifname_prefix' and "'abcdefghijkl'" in str(err.value)
    assert 'indexes below 1000' in str(err.value)


def test_the_longest_ifname_prefix_fits_1000_slots():
    s = ci.Settings(pool='10.0.0.0/8', prefix=30, uid_mode='shared', ifname_prefix='a' * ci.IFNAME_PREFIX_MAX)
    ledger = fresh(1000, s)
    assert {len(r['host_ifname']) for r in ledger['slots'].values()} == {13, 14, 15}
    assert ledger['slots']['slot999']['host_ifname'] == 'a' * 12 + '999'


@pytest.mark.parametrize('slots, message', [
    (['ok', 'Bad'], "'Bad'"),
    (['a', 'a'], "'a' twice"),
    (['x' * 32], 'x' * 32),
    (['trailing-'], "'trailing-'"),
    (-1, '-1'),
    (True, 'True'),
    ({'a': 1}, "{'a': 1}"),
])
def test_invalid_slots(slots, message):
    with pytest.raises(ci.AllocationError) as err:
        ci.normalize_slot_names(slots)
    assert err.value.param == 'slots' and message in str(err.value)


def test_slots_forms():
    assert ci.normalize_slot_names(2) == ['slot0', 'slot1']
    assert ci.normalize_slot_names('3') == ['slot0', 'slot1', 'slot2']
    assert ci.normalize_slot_names('a, b') == ['a', 'b']
    assert ci.normalize_slot_names(['b', 'a']) == ['b', 'a']
    assert ci.normalize_slot_names(0) == []
    assert ci.normalize_slot_names(None) is None


# ---------------------------------------------------------------------------
# Ledger validation and loading

def _corrupt(mutate):
    ledger = json.loads(json.dumps(fresh(3)))
    mutate(ledger)
    return ledger


@pytest.mark.parametrize('mutate, text', [
    (lambda d: d.update(version=2), 'unsupported ledger version 2'),
    (lambda d: d.update(extra=1), 'unknown: extra'),
    (lambda d: d.pop('pool'), 'missing: pool'),
    (lambda d: d['slots']['slot1'].update(subnet='10.200.0.0/24', gateway='10.200.0.1',
                                          address='10.200.0.2'), 'also used by slot'),
    (lambda d: d['slots']['slot1'].update(index=0), 'index 0 is also used'),
    (lambda d: d['slots']['slot1'].update(uid_base=524288), 'uid_base 524288 is also used'),
    (lambda d: d['slots']['slot1'].update(gateway='10.200.1.9'), 'gateway'),
    (lambda d: d['slots']['slot1'].update(subnet='10.201.1.0/24', gateway='10.201.1.1',
                                          address='10.201.1.2'), 'outside the ledger pool'),
    (lambda d: d['slots']['slot1'].update(subnet='10.200.1.1/24'), 'not a canonical'),
    (lambda d: d['slots']['slot1'].update(host_ifname='x' * 16), 'host_ifname'),
    (lambda d: d['slots']['slot1'].update(uid_base=524289), 'aligned'),
    (lambda d: d['slots']['slot1'].pop('machine'), 'exactly the fields'),
    (lambda d: d['slots']['slot1'].update(name='other'), 'does not match its key'),
    (lambda d: d['slots']['slot1'].update(index=True), 'index True'),
    # a trailing newline passes `^...$` with re.match: the ledger's checks use fullmatch
    (lambda d: d['slots']['slot1'].update(machine='chv-slot1\n'), "machine 'chv-slot1\\n'"),
    (lambda d: d['slots']['slot1'].update(host_ifname='chvh1\n'), "host_ifname 'chvh1\\n'"),
    (lambda d: d['slots']['slot1'].update(cell_ifname='eth0\n'), "cell_ifname 'eth0\\n'"),
    (lambda d: d['slots'].update({'slot1\n': dict(d['slots'].pop('slot1'), name='slot1\n')}), "slot 'slot1\\n'"),
])
def test_corrupt_ledgers_are_rejected_naming_the_file(mutate, text):
    with pytest.raises(ci.LedgerError) as err:
        ci.validate_ledger(_corrupt(mutate), '/var/lib/chv-fleet/identities.json')
    assert str(err.value).startswith('/var/lib/chv-fleet/identities.json: ')
    assert text in str(err.value)


def test_dump_parse_round_trip_and_one_line_per_slot():
    ledger = fresh(5)
    text = ci.dump_ledger(ledger)
    assert ci.parse_ledger(text) == ledger
    assert ci.parse_ledger(text.encode()) == ledger
    assert sum(1 for line in text.splitlines() if '"uid_base"' in line) == 5


def test_reading_and_parsing_the_ledger_name_the_file(tmp_path):
    path = str(tmp_path / 'identities.json')
    assert ci.read_ledger_bytes(path) is None
    text = ci.dump_ledger(fresh(2))
    with pytest.raises(ci.LedgerError) as err:
        ci.parse_ledger(text[:len(text) // 2].encode(), path)
    assert str(err.value).startswith(path) and 'truncated' in str(err.value)
    with pytest.raises(ci.LedgerError, match='not UTF-8'):
        ci.parse_ledger(b'\xff\xfe', path)
    with open(path, 'w') as handle:
        handle.write(text)
    assert ci.parse_ledger(ci.read_ledger_bytes(path), path) == fresh(2)


# ---------------------------------------------------------------------------
# Host fact parsers

IP_ADDR = json.dumps([
    {'ifindex': 1, 'ifname': 'lo', 'addr_info': [
        {'family': 'inet', 'local': '127.0.0.1', 'prefixlen': 8},
        {'family': 'inet6', 'local': '::1', 'prefixlen': 128}]},
    {'ifindex': 2, 'ifname': 'eth0', 'addr_info': [
        {'family': 'inet', 'local': '192.0.2.2', 'prefixlen': 24}]},
    {'ifindex': 3, 'ifname': 'tun0', 'addr_info': [
        {'family': 'inet', 'local': '10.8.0.1', 'address': '10.8.0.2', 'prefixlen': 32}]},
    {'ifindex': 7, 'ifname': 'chvh1', 'addr_info': [
        {'family': 'inet', 'local': '10.200.5.1', 'prefixlen': 24}]},
])

IP_ROUTE = json.dumps([
    {'dst': 'default', 'gateway': '192.0.2.1', 'dev': 'eth0'},
    {'dst': '192.0.2.0/24', 'dev': 'eth0', 'prefsrc': '192.0.2.2'},
    {'type': 'blackhole', 'dst': '10.50.0.0/16', 'table': 'cells'},
    {'dst': '10.60.0.0/16', 'nexthops': [{'gateway': '192.0.2.5', 'dev': 'eth0'},
                                         {'gateway': '192.0.2.6', 'dev': 'eth1'}]},
    {'type': 'local', 'dst': '127.0.0.1', 'dev': 'lo', 'table': 'local'},
    {'dst': 'fe80::/64', 'dev': 'eth0'},
])


def test_parse_ip_addr():
    ifnames, networks, addresses = ci.parse_ip_addr_json(IP_ADDR)
    assert ifnames == ['lo', 'eth0', 'tun0', 'chvh1']
    assert ('192.0.2.2/24', 'eth0') in networks and ('10.8.0.2/32', 'tun0') in networks
    assert ('chvh1', '10.200.5.1/24') in addresses
    assert all(':' not in cidr for cidr, _dev in networks)


def test_parse_ip_route():
    networks = ci.parse_ip_route_json(IP_ROUTE)
    assert ('default', 'eth0') not in networks
    assert ('192.0.2.1/32', 'eth0') in networks          # default gateway reserved
    assert ('10.50.0.0/16', None) in networks             # blackhole: no device
    assert ('10.60.0.0/16', None) in networks             # multipath over two devices
    assert ('192.0.2.6/32', 'eth1') in networks
    assert ('127.0.0.1', 'lo') in networks
    assert not any('fe80' in n for n, _d in networks)
    facts = ci.HostFacts(networks=networks)
    assert (int(ipaddress.ip_address('10.50.0.0')), int(ipaddress.ip_address('10.50.255.255')),
            None) in facts.networks


def test_parse_id_files():
    passwd = 'root:x:0:0:root:/root:/bin/bash\n# comment\nalice:x:1000:1000::/home/alice:/bin/sh\n' \
             '+nis::::::\nbroken line\nsvc:x:600000:600000::/:/usr/sbin/nologin\n'
    assert ci.parse_passwd(passwd) == [0, 1000, 600000]
    assert ci.parse_group('root:x:0:\nstaff:x:50:alice\n') == [0, 50]
    assert ci.parse_subid('alice:100000:65536\nbob:165536:65536\n\n') == [
        (100000, 65536), (165536, 65536)]
    uid_map = '         0     524288      65536\n'
    assert ci.parse_id_map(uid_map) == [(524288, 65536)]
    assert ci.parse_id_map('         0          0 4294967295\n') == []


def test_gather_host_facts_reads_the_given_root(tmp_path):
    (tmp_path / 'etc').mkdir()
    (tmp_path / 'etc' / 'passwd').write_text('root:x:0:0::/:/bin/sh\nsvc:x:700000:1::/:/bin/sh\n')
    (tmp_path / 'etc' / 'group').write_text('root:x:0:\n')
    (tmp_path / 'etc' / 'subuid').write_text('alice:1000000:65536\n')
    (tmp_path / 'etc' / 'subgid').write_text('alice:2000000:65536\n')
    (tmp_path / 'sys' / 'class' / 'net' / 'chvh3').mkdir(parents=True)
    (tmp_path / 'proc' / '42').mkdir(parents=True)
    (tmp_path / 'proc' / '42' / 'uid_map').write_text('0 589824 65536\n')
    (tmp_path / 'proc' / '42' / 'gid_map').write_text('0 589824 65536\n')
    (tmp_path / 'proc' / 'self').mkdir()
    calls = []

    def run(argv):
        calls.append(argv)
        return IP_ADDR if 'addr' in argv else IP_ROUTE

    facts = ci.gather_host_facts(run, root=str(tmp_path))
    assert calls == [['ip', '-j', 'addr', 'show'], ['ip', '-j', 'route', 'show', 'table', 'all']]
    assert {'chvh3', 'chvh1', 'eth0'} <= facts.ifnames
    assert facts.ids == [0, 700000]
    assert facts.id_ranges == [(1000000, 65536), (2000000, 65536)]
    assert facts.userns_ranges == [(589824, 65536)]
    ledger = fresh(2, host_facts=facts)
    assert sorted(r['uid_base'] for r in ledger['slots'].values()) == [0x80000, 0xB0000]
    assert [ledger['slots'][n]['host_ifname'] for n in ('slot0', 'slot1')] == ['chvh0', 'chvh2']


# ---------------------------------------------------------------------------
# Recovery

def test_recover_rebuilds_from_live_veths_without_duplicates():
    facts = host(ifnames=['eth0', 'chvh0', 'chvh1', 'chvh7'],
                 networks=[('10.200.3.1/24', 'chvh0'), ('10.200.5.1/24', 'chvh1'),
                           ('10.200.0.0/24', 'eth0')],
                 addresses=[('chvh0', '10.200.3.1/24'), ('chvh1', '10.200.5.1/24'),
                            ('chvh7', '10.200.3.1/24'),     # duplicate subnet: ignored
                            ('eth0', '10.200.0.5/24')],
                 userns_ranges=[(0x80000, 65536)])
    result, recovered = ci.recover_ledger(3, ci.Settings(), facts)
    slots = result.ledger['slots']
    assert recovered == ['slot0', 'slot1']
    assert (slots['slot0']['index'], slots['slot0']['subnet']) == (0, '10.200.3.0/24')
    assert (slots['slot1']['index'], slots['slot1']['subnet']) == (1, '10.200.5.0/24')
    # slot2 avoids chvh7 (in use), the uplink network and both recovered subnets
    assert slots['slot2']['index'] == 2 and slots['slot2']['subnet'] == '10.200.1.0/24'
    assert 0x80000 not in [r['uid_base'] for r in slots.values()]   # running userns kept out
    ci.validate_ledger(result.ledger)


def test_recover_gives_out_of_range_indexes_to_remaining_slots():
    facts = host(ifnames=['chvh5'], addresses=[('chvh5', '10.200.9.1/24')],
                 networks=[('10.200.9.1/24', 'chvh5')])
    result, recovered = ci.recover_ledger(['a', 'b'], ci.Settings(), facts)
    assert recovered == ['a']
    assert result.ledger['slots']['a']['host_ifname'] == 'chvh5'
    assert result.ledger['slots']['b']['index'] == 0


# ---------------------------------------------------------------------------
# Ledger I/O: update_ledger, atomic writes, locking

def _settings():
    return ci.Settings()


def test_update_ledger_creates_private_files_and_is_idempotent(tmp_path):
    path = str(tmp_path / 'state' / 'identities.json')
    first = ci.update_ledger(path, 2, _settings(), host())
    assert first['changed'] and first['added'] == ['slot0', 'slot1']
    assert first['before'] == '' and first['after'] == open(path).read()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.path.exists(path + '.lock')
    second = ci.update_ledger(path, 2, _settings(), host())
    assert not second['changed'] and second['before'] == second['after']
    assert sorted(os.listdir(os.path.dirname(path))) == ['identities.json', 'identities.json.lock']


def test_check_mode_creates_and_changes_nothing(tmp_path):
    path = str(tmp_path / 'state' / 'identities.json')
    result = ci.update_ledger(path, 2, _settings(), host(), check_mode=True)
    assert result['changed'] and 'slot1' in result['after']
    assert not os.path.exists(os.path.dirname(path))
    ci.update_ledger(path, 2, _settings(), host())
    before = open(path, 'rb').read()
    result = ci.update_ledger(path, 3, _settings(), host(), check_mode=True)
    assert result['changed'] and result['added'] == ['slot2']
    assert open(path, 'rb').read() == before


def test_absent_on_missing_ledger_creates_nothing(tmp_path):
    path = str(tmp_path / 'identities.json')
    result = ci.update_ledger(path, None, _settings(), host(), state='absent')
    assert not result['changed'] and not os.path.exists(path)


@pytest.mark.parametrize('slots, kwargs, param', [
    (300, {}, 'pool'),
    (2, {'pool': '10.201.0.0/16'}, 'reassign'),
])
def test_errors_write_nothing(tmp_path, slots, kwargs, param):
    path = str(tmp_path / 'identities.json')
    ci.update_ledger(path, 2, _settings(), host())
    before = open(path, 'rb').read()
    with pytest.raises(ci.AllocationError) as err:
        ci.update_ledger(path, slots, ci.Settings(**kwargs), host())
    assert err.value.param == param
    assert open(path, 'rb').read() == before


def test_truncated_ledger_fails_naming_file_and_writes_nothing(tmp_path):
    path = str(tmp_path / 'identities.json')
    ci.update_ledger(path, 3, _settings(), host())
    good = open(path, 'rb').read()
    with open(path, 'wb') as handle:
        handle.write(good[:100])
    with pytest.raises(ci.LedgerError) as err:
        ci.update_ledger(path, 3, _settings(), host())
    assert path in str(err.value)
    assert open(path, 'rb').read() == good[:100]
    assert sorted(os.listdir(str(tmp_path))) == ['identities.json', 'identities.json.lock']


def test_recover_replaces_a_corrupt_ledger_and_keeps_a_backup(tmp_path):
    path = str(tmp_path / 'identities.json')
    with open(path, 'w') as handle:
        handle.write('{"version": 1, "slo')
    facts = host(ifnames=['chvh0'], addresses=[('chvh0', '10.200.7.1/24')],
                 networks=[('10.200.7.1/24', 'chvh0')])
    result = ci.update_ledger(path, 2, _settings(), facts, recover=True)
    assert result['changed'] and result['recovered'] == ['slot0']
    assert result['backup_file'].startswith(path + '.corrupt-')
    assert open(result['backup_file']).read() == '{"version": 1, "slo'
    ledger = ci.parse_ledger(ci.read_ledger_bytes(path), path)
    assert ledger['slots']['slot0']['subnet'] == '10.200.7.0/24'
    assert ledger['slots']['slot1']['subnet'] == '10.200.0.0/24'
    again = ci.update_ledger(path, 2, _settings(), facts, recover=True)
    assert not again['changed'] and again['recovered'] == []


def test_failed_write_leaves_the_old_ledger_and_no_temp_file(tmp_path, monkeypatch):
    path = str(tmp_path / 'identities.json')
    ci.update_ledger(path, 1, _settings(), host())
    before = open(path, 'rb').read()

    def broken_fsync(fd):
        raise OSError(5, 'Input/output error')

    monkeypatch.setattr(ci.os, 'fsync', broken_fsync)
    with pytest.raises(OSError):
        ci.update_ledger(path, 2, _settings(), host())
    assert open(path, 'rb').read() == before
    assert sorted(os.listdir(str(tmp_path))) == ['identities.json', 'identities.json.lock']


def test_lock_is_exclusive_and_times_out_naming_the_lock_file(tmp_path):
    path = str(tmp_path / 'identities.json')
    with ci.LedgerLock(path):
        with pytest.raises(ci.LockTimeout) as err:
            ci.update_ledger(path, 1, _settings(), host(), lock_timeout=0.2)
        assert path + '.lock' in str(err.value)
        with pytest.raises(ci.LockTimeout):
            with ci.LedgerLock(path, timeout=0.1, shared=True):
                pass
    assert ci.update_ledger(path, 1, _settings(), host(), lock_timeout=0.2)['changed']


# ---------------------------------------------------------------------------
# Properties

NAMES = ['s%d' % i for i in range(12)]
POOL_NET = ipaddress.ip_network('10.200.0.0/22')


@st.composite
def host_facts(draw):
    nets = []
    for dummy in range(draw(st.integers(0, 4))):
        base = draw(st.integers(int(POOL_NET.network_address) - 512,
                                int(POOL_NET.broadcast_address) + 512))
        plen = draw(st.integers(22, 32))
        net = ipaddress.ip_network('%s/%d' % (ipaddress.ip_address(base), plen), strict=False)
        nets.append((str(net), draw(st.sampled_from(['eth0', 'wg0', None]))))
    ifnames = ['chvh%d' % i for i in draw(st.sets(st.integers(0, 15), max_size=3))]
    ids = draw(st.lists(st.integers(0x80000, 0x80000 + 20 * 65536), max_size=3)) + [0, 1000]
    ranges = [(draw(st.integers(0x80000, 0x80000 + 20 * 65536)), draw(st.integers(1, 200000)))
              for dummy in range(draw(st.integers(0, 2)))]
    return ci.HostFacts(ifnames=ifnames, networks=nets, ids=ids, id_ranges=ranges)


operations = st.lists(st.tuples(st.sampled_from(['set', 'add', 'remove']),
                                st.lists(st.sampled_from(NAMES), unique=True, max_size=8)),
                      min_size=1, max_size=8)


def check_invariants(ledger, s, facts):
    ci.validate_ledger(ledger)
    recs = list(ledger['slots'].values())
    subnets = [ipaddress.ip_network(r['subnet']) for r in recs]
    host_nets = [(ipaddress.ip_network('%s/%d' % (ipaddress.ip_address(lo), 33 - (hi - lo + 1).bit_length())), dev)
                 for lo, hi, dev in facts.networks]
    for rec, net in zip(recs, subnets):
        assert len(rec['host_ifname'].encode()) <= 15
        assert net.subnet_of(ipaddress.ip_network(s.pool))
        assert not any(net.overlaps(h) for h, _dev in host_nets), (rec, host_nets)
        assert rec['host_ifname'] not in facts.ifnames
        lo, hi = rec['uid_base'], rec['uid_base'] + rec['uid_size'] - 1
        if s.uid_mode == 'per_slot':
            assert ci.UID_PER_SLOT_MIN <= lo and hi <= 0x6FFFFFFF
            assert not any(lo <= u <= hi for u in facts.ids)
            assert not any(a <= hi and lo <= a + c - 1 for a, c in facts.id_ranges)
    for i, a in enumerate(subnets):
        for b in subnets[i + 1:]:
            assert not a.overlaps(b)
    for field in ('index', 'host_ifname', 'machine', 'subnet'):
        values = [r[field] for r in recs]
        assert len(values) == len(set(values)), field
    if s.uid_mode == 'per_slot':
        spans = sorted((r['uid_base'], r['uid_base'] + r['uid_size']) for r in recs)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, facts=host_facts(), prefix=st.sampled_from([24, 26, 28, 29, 30]),
       uid_mode=st.sampled_from(['per_slot', 'per_slot', 'shared']))
def test_property_add_remove_sequences_keep_identities_sound(ops, facts, prefix, uid_mode):
    s = ci.Settings(pool=str(POOL_NET), prefix=prefix, uid_mode=uid_mode)
    ledger = None
    for op, names in ops:
        try:
            if op == 'set':
                result = ci.allocate(ledger, names, s, facts)
                expected = set(names)
            elif op == 'add':
                result = ci.allocate(ledger, names, s, facts, purge=False)
                expected = set(names) | set(ledger['slots'] if ledger else ())
            else:
                result = ci.allocate(ledger, names, s, facts, state='absent')
                expected = set(ledger['slots'] if ledger else ()) - set(names)
        except ci.AllocationError as exc:
            # Only exhaustion may fail here; the previous state stays valid.
            assert exc.param in ('pool', 'uid_mode'), exc
            continue
        new = result.ledger
        assert set(new['slots']) == expected
        check_invariants(new, s, facts)
        if ledger is not None:
            for name in set(ledger['slots']) & set(new['slots']):
                assert new['slots'][name] == ledger['slots'][name]
        assert ci.parse_ledger(ci.dump_ledger(new)) == new
        ledger = new


@hsettings(max_examples=60, deadline=None)
@given(before=host_facts(), after=host_facts(), count=st.integers(1, 6))
def test_property_reassign_resolves_every_conflict(before, after, count):
    s = ci.Settings(pool=str(POOL_NET), prefix=28)
    try:
        ledger = ci.allocate(None, count, s, before).ledger
        result = ci.allocate(ledger, count, s, after, reassign=True)
    except ci.AllocationError as exc:
        assert exc.param in ('pool', 'uid_mode')
        return
    check_invariants(result.ledger, s, ci.HostFacts(
        networks=[(str(ipaddress.ip_network('%s/%d' % (ipaddress.ip_address(lo), 33 - (hi - lo + 1).bit_length()))), d)
                  for lo, hi, d in after.networks],
        ids=after.ids, id_ranges=after.id_ranges))
    for name in set(result.ledger['slots']) - set(result.reassigned):
        assert result.ledger['slots'][name] == ledger['slots'][name]
