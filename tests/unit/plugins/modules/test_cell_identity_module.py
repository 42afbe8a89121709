"""chv.fleet.cell_identity module: arguments, changed/ok, check mode, diff,
failures (run in-process with fake host facts)."""

import json

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci
from ansible_collections.chv.fleet.plugins.modules import cell_identity as module
from module_run import run_module

FACTS = ci.HostFacts(ifnames=['lo', 'eth0', 'chvh0'], networks=[('10.200.0.0/24', 'eth0')],
                     ids=[0, 1000])


PROBES = []


@pytest.fixture(autouse=True)
def fake_host(monkeypatch, tmp_path):
    monkeypatch.setattr(module, 'gather_host_facts', lambda run: FACTS)
    monkeypatch.setattr(module.AnsibleModule, 'get_bin_path', lambda self, *a, **k: '/sbin/ip')
    # The running-cell probe reads the state_dir given to the module, but
    # interfaces from an empty fake /sys/class/net, and the default
    # state_dir (/run/chv-fleet) is redirected into tmp_path.
    net = tmp_path / 'sys-class-net'
    net.mkdir()
    del PROBES[:]

    def probe(state_dir):
        PROBES.append(state_dir)
        if state_dir == '/run/chv-fleet':
            state_dir = str(tmp_path / 'default-state')
        return ci.CellProbe(state_dir, sys_class_net=str(net))

    monkeypatch.setattr(module, 'CellProbe', probe)


def run(capsys, **args):
    return run_module(module, capsys, **args)


def test_changed_then_ok(tmp_path, capsys):
    ledger = str(tmp_path / 'identities.json')
    first = run(capsys, slots=2, ledger=ledger)
    assert first['changed'] and first['added'] == ['slot0', 'slot1']
    assert [r['host_ifname'] for r in first['identities']] == ['chvh1', 'chvh2']
    assert first['identities'][0]['subnet'] == '10.200.1.0/24'
    second = run(capsys, slots=2, ledger=ledger)
    assert not second['changed'] and second['identities'] == first['identities']
    assert 'diff' not in second


def test_check_mode_and_diff(tmp_path, capsys):
    ledger = str(tmp_path / 'state' / 'identities.json')
    result = run(capsys, check=True, diff=True, slots='a,b', ledger=ledger)
    assert result['changed']
    assert result['diff']['before'] == '' and '"a": {"name": "a"' in result['diff']['after']
    assert not (tmp_path / 'state').exists()
    run(capsys, slots='a,b', ledger=ledger)
    result = run(capsys, diff=True, slots=['a'], ledger=ledger)
    assert result['removed'] == ['b']
    assert '"b": {' in result['diff']['before'] and '"b": {' not in result['diff']['after']
    assert result['diff']['before_header'] == ledger


def test_state_absent(tmp_path, capsys):
    ledger = str(tmp_path / 'identities.json')
    run(capsys, slots=3, ledger=ledger)
    result = run(capsys, state='absent', ledger=ledger)
    assert result['changed'] and result['removed'] == ['slot0', 'slot1', 'slot2']
    assert result['identities'] == []


def test_bad_prefix_fails_naming_it(tmp_path, capsys):
    ledger = str(tmp_path / 'identities.json')
    result = run(capsys, slots=1, prefix=31, ledger=ledger)
    assert result['failed'] and result['param'] == 'prefix' and 'prefix 31' in result['msg']
    assert not (tmp_path / 'identities.json').exists()


def test_present_requires_slots(tmp_path, capsys):
    result = run(capsys, ledger=str(tmp_path / 'identities.json'))
    assert result['failed'] and 'slots' in result['msg']


def test_corrupt_ledger_fails_naming_file_then_recover(tmp_path, capsys):
    ledger = tmp_path / 'identities.json'
    ledger.write_text('{"version": 1, "pool": "10.200.0.0/16", "prefix": 24, "uid_m')
    result = run(capsys, slots=1, ledger=str(ledger))
    assert result['failed'] and str(ledger) in result['msg'] and 'recover: true' in result['msg']
    assert ledger.read_text().endswith('"uid_m')
    result = run(capsys, slots=1, ledger=str(ledger), recover=True)
    assert result['changed'] and result['backup_file'].startswith(str(ledger) + '.corrupt-')
    ci.parse_ledger(ci.read_ledger_bytes(str(ledger)), str(ledger))


def test_settings_change_fails_without_reassign(tmp_path, capsys):
    ledger = str(tmp_path / 'identities.json')
    run(capsys, slots=1, ledger=ledger)
    result = run(capsys, slots=1, ledger=ledger, uid_mode='shared')
    assert result['failed'] and result['param'] == 'reassign' and 'uid_mode' in result['msg']
    result = run(capsys, slots=1, ledger=ledger, uid_mode='shared', reassign=True)
    assert result['changed'] and result['reassigned'] == ['slot0']
    assert result['identities'][0]['uid_base'] == 1000


def test_conflicts_become_warnings(tmp_path, capsys, monkeypatch):
    ledger = str(tmp_path / 'identities.json')
    run(capsys, slots=1, ledger=ledger)
    moved = ci.HostFacts(networks=[('10.200.1.0/24', 'wg0')])
    monkeypatch.setattr(module, 'gather_host_facts', lambda run: moved)
    warned = []
    monkeypatch.setattr(module.AnsibleModule, 'warn', lambda self, msg: warned.append(msg))
    result = run(capsys, slots=1, ledger=ledger)
    assert not result['changed'] and result['conflicts']
    assert warned == ['slot identity collides with the live host: slot0: subnet 10.200.1.0/24 '
                      'overlaps 10.200.1.0/24 on wg0 (set reassign: true to move it)']


def test_running_cell_is_not_released_without_force(tmp_path, capsys, monkeypatch, hold_lock):
    ledger = tmp_path / 'identities.json'
    state = tmp_path / 'state'
    run(capsys, slots=3, ledger=str(ledger), state_dir=str(state))
    before = ledger.read_bytes()
    lock = state / 'locks' / 'slot2.lock'
    holder = hold_lock(lock, how='launcher')
    (state / 'cells').mkdir()
    (state / 'cells' / 'slot2.json').write_text(json.dumps({'pid': 4242, 'slot': 'slot2'}))
    refusal = ('slot slot2 has a running cell (pid 4242, lock %s): refusing to release it; stop '
               'the cell or set force: true (role variable chv_cell_identity_force). Nothing was '
               'written.' % lock)
    for check in (True, False):
        result = run(capsys, check=check, slots=2, ledger=str(ledger), state_dir=str(state))
        assert result['failed'] and result['msg'] == refusal and result['param'] == 'force'
        assert result['running'] == [{'slot': 'slot2', 'action': 'release', 'pid': 4242,
                                      'lock': str(lock), 'ifname': None, 'error': None}]
        assert ledger.read_bytes() == before
    # Other slots are still free to go; the running one stays.
    result = run(capsys, slots=['slot0', 'slot2'], ledger=str(ledger), state_dir=str(state))
    assert result['changed'] and result['removed'] == ['slot1'] and result['running'] == []

    warned = []
    monkeypatch.setattr(module.AnsibleModule, 'warn', lambda self, msg: warned.append(msg))
    result = run(capsys, slots=['slot0'], ledger=str(ledger), state_dir=str(state), force=True)
    assert result['changed'] and result['removed'] == ['slot2']
    assert [c['slot'] for c in result['running']] == ['slot2']
    assert len(warned) == 1 and warned[0].startswith(
        'slot slot2 has a running cell (pid 4242, lock %s): released anyway (force: true)' % lock)
    assert [r['name'] for r in ci.parse_ledger(ci.read_ledger_bytes(str(ledger)))['slots'].values()] == ['slot0']
    holder.stop()


def test_running_cell_is_not_reassigned_without_force(tmp_path, capsys, hold_lock):
    ledger = str(tmp_path / 'identities.json')
    state = tmp_path / 'state'
    run(capsys, slots=2, ledger=ledger, state_dir=str(state))
    hold_lock(state / 'locks' / 'slot0.lock')
    result = run(capsys, slots=2, ledger=ledger, state_dir=str(state), pool='10.210.0.0/16',
                 reassign=True)
    assert result['failed'] and result['msg'].startswith(
        'slot slot0 has a running cell (pid unknown, lock %s): refusing to reassign it;'
        % (state / 'locks' / 'slot0.lock'))
    result = run(capsys, slots=2, ledger=ledger, state_dir=str(state), pool='10.210.0.0/16',
                 reassign=True, force=True)
    assert result['changed'] and result['reassigned'] == ['slot0', 'slot1']
    assert [c['action'] for c in result['running']] == ['reassign']


def test_state_dir_defaults_to_the_launchers(tmp_path, capsys):
    ledger = str(tmp_path / 'identities.json')
    result = run(capsys, slots=1, ledger=ledger)
    assert result['running'] == [] and PROBES == ['/run/chv-fleet']
