"""Slots with a running cell are neither released nor changed without
force: the probe (launcher lock, veth, record), the pure selection of the
slots a new ledger touches, and the refusal in update_ledger."""

import errno
import fcntl
import json
import os

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci

EXAMPLE = ('slot slot1 has a running cell (pid 1234, lock /run/chv-fleet/locks/slot1.lock): '
           'refusing to release it; stop the cell or set force: true (role variable '
           'chv_cell_identity_force)')


def facts():
    return ci.HostFacts(ifnames=['lo', 'eth0'], ids=[0])


class FakeProbe:
    """probe(name, record) from a dict name -> RunningCell; records calls."""

    def __init__(self, live=None):
        self.live = live or {}
        self.calls = []

    def __call__(self, name, record):
        self.calls.append((name, record['host_ifname']))
        cell = self.live.get(name)
        return None if cell is None else ci.RunningCell(name, **cell)


def write_record(state_dir, slot, pid):
    cells = state_dir / 'cells'
    cells.mkdir(parents=True, exist_ok=True)
    (cells / (slot + '.json')).write_text(json.dumps({'pid': pid, 'slot': slot}))


def ledger_files(path):
    return sorted(os.listdir(os.path.dirname(path)))


# ---------------------------------------------------------------------------
# lock_is_held against a real process holding the flock

def test_lock_held_by_another_process_and_free_after_it_exits(tmp_path, hold_lock):
    lock = tmp_path / 'locks' / 'slot1.lock'
    holder = hold_lock(lock)
    assert ci.lock_is_held(str(lock)) is True
    assert ci.lock_is_held(str(lock)) is True  # probing does not steal or break it
    holder.stop()
    assert ci.lock_is_held(str(lock)) is False
    assert lock.exists()  # never unlinked


def test_free_lock_is_released_at_once(tmp_path):
    lock = tmp_path / 'slot0.lock'
    lock.write_text('')
    assert ci.lock_is_held(str(lock)) is False
    fd = os.open(str(lock), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the probe kept it
    finally:
        os.close(fd)


def test_lock_held_by_the_launchers_own_claim(tmp_path, hold_lock):
    # The launcher's claim.try_claim (roles/cell_runtime/files/chv_cell)
    # takes the lock; the module must see it.  On release it unlinks it.
    lock = tmp_path / 'locks' / 'slot0.lock'
    holder = hold_lock(lock, how='launcher')
    assert ci.lock_is_held(str(lock)) is True
    assert lock.read_text() == '%d\n' % holder.pid
    holder.stop()
    assert not lock.exists()
    assert ci.lock_is_held(str(lock)) is False


def test_missing_lock_is_not_held_and_not_created(tmp_path):
    assert ci.lock_is_held(str(tmp_path / 'locks' / 'slot0.lock')) is False
    assert not (tmp_path / 'locks').exists()
    (tmp_path / 'locks').mkdir()
    assert ci.lock_is_held(str(tmp_path / 'locks' / 'slot0.lock')) is False
    assert os.listdir(str(tmp_path / 'locks')) == []


def test_symlinked_lock_is_not_followed(tmp_path, hold_lock):
    target = tmp_path / 'elsewhere.lock'
    hold_lock(target)
    link = tmp_path / 'slot0.lock'
    link.symlink_to(target)
    with pytest.raises(OSError) as info:
        ci.lock_is_held(str(link))
    assert info.value.errno == errno.ELOOP


# ---------------------------------------------------------------------------
# read_cell_pid

@pytest.mark.parametrize('content, pid', [
    ('{"pid": 4321, "slot": "slot0", "uid_base": 524288}', 4321),
    ('{"pid": "4321"}', None),
    ('{"pid": true}', None),
    ('{"pid": 0}', None),
    ('{"pid": -5}', None),
    ('{"slot": "slot0"}', None),
    ('[4321]', None),
    ('{"pid": 43', None),
    (b'\xff\xfe', None),
])
def test_read_cell_pid(tmp_path, content, pid):
    path = tmp_path / 'slot0.json'
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert ci.read_cell_pid(str(path)) == pid


def test_read_cell_pid_missing_symlink_or_directory(tmp_path):
    assert ci.read_cell_pid(str(tmp_path / 'none.json')) is None
    real = tmp_path / 'real.json'
    real.write_text('{"pid": 7}')
    (tmp_path / 'link.json').symlink_to(real)
    assert ci.read_cell_pid(str(tmp_path / 'link.json')) is None
    (tmp_path / 'dir.json').mkdir()
    assert ci.read_cell_pid(str(tmp_path / 'dir.json')) is None


# ---------------------------------------------------------------------------
# CellProbe: lock, veth and record together

def probe_in(tmp_path):
    net = tmp_path / 'sys-class-net'
    net.mkdir(exist_ok=True)
    return ci.CellProbe(str(tmp_path / 'state'), sys_class_net=str(net)), net


def test_probe_defaults_are_the_launchers_paths():
    probe = ci.CellProbe()
    assert probe.lock_path('slot1') == '/run/chv-fleet/locks/slot1.lock'
    assert probe.record_path('slot1') == '/run/chv-fleet/cells/slot1.json'
    assert probe.sys_class_net == '/sys/class/net'


def test_probe_finds_a_held_lock_and_the_record_pid(tmp_path, hold_lock):
    probe, _net = probe_in(tmp_path)
    state = tmp_path / 'state'
    holder = hold_lock(state / 'locks' / 'slot1.lock')
    write_record(state, 'slot1', 1234)
    cell = probe('slot1', {'host_ifname': 'chvh1'})
    assert (cell.slot, cell.pid, cell.lock, cell.ifname, cell.error) == (
        'slot1', 1234, str(state / 'locks' / 'slot1.lock'), None, None)
    assert probe('slot0', {'host_ifname': 'chvh0'}) is None
    holder.stop()
    assert probe('slot1', {'host_ifname': 'chvh1'}) is None  # stale record alone is no cell


def test_probe_finds_the_veth_without_a_lock(tmp_path):
    probe, net = probe_in(tmp_path)
    (net / 'chvh3').symlink_to('../../devices/virtual/net/chvh3')  # dangling, as in a fake tree
    cell = probe('slot3', {'host_ifname': 'chvh3'})
    assert (cell.pid, cell.lock, cell.ifname) == (None, None, 'chvh3')
    assert cell.evidence() == 'slot slot3 has a running cell (pid unknown, interface chvh3)'
    assert probe('slot3', {'host_ifname': '../chvh3'}) is None  # not an interface name


def test_probe_treats_an_uncheckable_lock_as_running(tmp_path, hold_lock):
    probe, _net = probe_in(tmp_path)
    locks = tmp_path / 'state' / 'locks'
    locks.mkdir(parents=True)
    hold_lock(tmp_path / 'other.lock')
    (locks / 'slot0.lock').symlink_to(tmp_path / 'other.lock')
    cell = probe('slot0', {'host_ifname': 'chvh0'})
    assert cell.lock is None and cell.error
    assert cell.evidence() == ('slot slot0 may have a running cell (pid unknown, cannot check '
                               'lock %s: it is a symlink)' % (locks / 'slot0.lock'))


def test_probe_creates_nothing(tmp_path):
    probe, _net = probe_in(tmp_path)
    assert probe('slot0', {'host_ifname': 'chvh0'}) is None
    assert not (tmp_path / 'state').exists()


# ---------------------------------------------------------------------------
# Pure selection and messages

def test_changed_slots_lists_releases_and_changes_by_old_index():
    before = ci.allocate(None, 4, ci.Settings(), facts()).ledger
    after = ci.allocate(before, ['slot0', 'slot2'], ci.Settings(), facts()).ledger
    assert [(n, a) for n, a, _r in ci.changed_slots(before, after)] == [
        ('slot1', 'release'), ('slot3', 'release')]
    moved = ci.allocate(before, 4, ci.Settings(pool='10.210.0.0/16'), facts(),
                        reassign=True).ledger
    changed = ci.changed_slots(before, moved)
    assert [(n, a) for n, a, _r in changed] == [('slot%d' % i, 'reassign') for i in range(4)]
    assert changed[0][2] == before['slots']['slot0']  # the old record: the live veth
    assert ci.changed_slots(before, before) == []


def test_find_running_probes_only_touched_slots_with_their_old_record():
    before = ci.allocate(None, 3, ci.Settings(), facts()).ledger
    after = ci.allocate(before, ['slot0', 'slot1'], ci.Settings(ifname_prefix='cv'), facts(),
                        reassign=True).ledger
    probe = FakeProbe({'slot1': dict(pid=99, ifname='chvh1'), 'slot2': dict(pid=7)})
    found = ci.find_running(before, after, probe)
    assert probe.calls == [('slot0', 'chvh0'), ('slot1', 'chvh1'), ('slot2', 'chvh2')]
    assert [(c.slot, c.action, c.pid) for c in found] == [('slot1', 'reassign', 99),
                                                          ('slot2', 'release', 7)]
    assert ci.find_running(None, after, probe) == []


def test_refusal_message_matches_the_documented_text():
    cell = ci.RunningCell('slot1', pid=1234, lock='/run/chv-fleet/locks/slot1.lock',
                          ifname='chvh1', action='release')
    assert ci.running_message([cell]) == EXAMPLE
    other = ci.RunningCell('slot2', ifname='chvh2', action='reassign')
    assert ci.running_message([cell, other]) == (
        'slot slot1 has a running cell (pid 1234, lock /run/chv-fleet/locks/slot1.lock): '
        'refusing to release it; slot slot2 has a running cell (pid unknown, interface chvh2): '
        'refusing to reassign it; stop the cells or set force: true (role variable '
        'chv_cell_identity_force)')
    assert ci.running_warning(cell).startswith(
        'slot slot1 has a running cell (pid 1234, lock /run/chv-fleet/locks/slot1.lock): '
        'released anyway (force: true)')
    assert 'restart it' in ci.running_warning(other)


# ---------------------------------------------------------------------------
# update_ledger: refuse before writing, in check mode too; force proceeds

def seeded(tmp_path, count=3):
    path = str(tmp_path / 'identities.json')
    ci.update_ledger(path, count, ci.Settings(), facts(), probe=FakeProbe())
    with open(path, 'rb') as handle:
        return path, handle.read()


@pytest.mark.parametrize('check_mode', [False, True])
@pytest.mark.parametrize('kwargs, action', [
    (dict(slots=1), 'release'),
    (dict(slots=None, state='absent'), 'release'),
    (dict(slots=3, reassign=True, settings=ci.Settings(pool='10.210.0.0/16')), 'reassign'),
])
def test_running_cell_refuses_and_writes_nothing(tmp_path, check_mode, kwargs, action):
    path, raw = seeded(tmp_path)
    files = ledger_files(path)
    kwargs = dict(kwargs)
    settings = kwargs.pop('settings', ci.Settings())
    slots = kwargs.pop('slots')
    probe = FakeProbe({'slot2': dict(pid=1234, lock='/run/chv-fleet/locks/slot2.lock')})
    with pytest.raises(ci.RunningCellError) as info:
        ci.update_ledger(path, slots, settings, facts(), probe=probe, check_mode=check_mode,
                         **kwargs)
    assert str(info.value) == (
        'slot slot2 has a running cell (pid 1234, lock /run/chv-fleet/locks/slot2.lock): '
        'refusing to %s it; stop the cell or set force: true (role variable '
        'chv_cell_identity_force)' % action)
    assert info.value.param == 'force' and [c.slot for c in info.value.cells] == ['slot2']
    with open(path, 'rb') as handle:
        assert handle.read() == raw
    assert ledger_files(path) == files


def test_force_proceeds_and_reports_the_running_slots(tmp_path):
    path, _raw = seeded(tmp_path)
    probe = FakeProbe({'slot2': dict(pid=1234, lock='/x/locks/slot2.lock')})
    result = ci.update_ledger(path, 1, ci.Settings(), facts(), probe=probe, force=True)
    assert result['changed'] and result['removed'] == ['slot1', 'slot2']
    assert [(c.slot, c.action, c.pid) for c in result['running']] == [('slot2', 'release', 1234)]
    assert sorted(ci.parse_ledger(ci.read_ledger_bytes(path), path)['slots']) == ['slot0']


def test_untouched_running_slots_and_additions_are_fine(tmp_path):
    path, _raw = seeded(tmp_path, 2)
    probe = FakeProbe({'slot0': dict(pid=1), 'slot1': dict(pid=2)})
    result = ci.update_ledger(path, 4, ci.Settings(), facts(), probe=probe)
    assert result['added'] == ['slot2', 'slot3'] and result['running'] == []
    assert probe.calls == []  # nothing released or changed: nothing probed
    result = ci.update_ledger(path, 4, ci.Settings(), facts(), probe=probe)
    assert not result['changed'] and probe.calls == []


def test_release_of_an_idle_slot_next_to_a_running_one(tmp_path):
    path, _raw = seeded(tmp_path)
    probe = FakeProbe({'slot0': dict(pid=1)})
    result = ci.update_ledger(path, ['slot0', 'slot1'], ci.Settings(), facts(), probe=probe)
    assert result['removed'] == ['slot2'] and result['running'] == []
    assert probe.calls == [('slot2', 'chvh2')]


def test_recovering_a_corrupt_ledger_has_no_old_identities_to_protect(tmp_path):
    path = tmp_path / 'identities.json'
    path.write_text('{"version": 1, "pool": "10.2')
    probe = FakeProbe({'slot0': dict(pid=1)})
    result = ci.update_ledger(str(path), 1, ci.Settings(), facts(), probe=probe, recover=True)
    assert result['changed'] and probe.calls == []


def test_real_probe_with_a_process_holding_the_slot_lock(tmp_path, hold_lock):
    path, raw = seeded(tmp_path)
    state = tmp_path / 'state'
    net = tmp_path / 'net'
    net.mkdir()
    probe = ci.CellProbe(str(state), sys_class_net=str(net))
    holder = hold_lock(state / 'locks' / 'slot1.lock', how='launcher')
    write_record(state, 'slot1', holder.pid)
    lock = state / 'locks' / 'slot1.lock'
    for check_mode in (True, False):
        with pytest.raises(ci.RunningCellError) as info:
            ci.update_ledger(path, ['slot0', 'slot2'], ci.Settings(), facts(), probe=probe,
                             check_mode=check_mode)
        assert str(info.value) == (
            'slot slot1 has a running cell (pid %d, lock %s): refusing to release it; stop the '
            'cell or set force: true (role variable chv_cell_identity_force)' % (holder.pid, lock))
    with open(path, 'rb') as handle:
        assert handle.read() == raw
    holder.stop()
    os.unlink(str(state / 'cells' / 'slot1.json'))  # as the launcher does on exit
    result = ci.update_ledger(path, ['slot0', 'slot2'], ci.Settings(), facts(), probe=probe)
    assert result['removed'] == ['slot1'] and result['running'] == []


def test_default_probe_is_the_launchers_state_dir(tmp_path, monkeypatch):
    path, _raw = seeded(tmp_path)
    seen = []

    class Recording(ci.CellProbe):
        def __call__(self, name, record):
            seen.append((self.state_dir, self.sys_class_net, name))
            return None

    monkeypatch.setattr(ci, 'CellProbe', Recording)
    ci.update_ledger(path, 2, ci.Settings(), facts())
    assert seen == [('/run/chv-fleet', '/sys/class/net', 'slot2')]
