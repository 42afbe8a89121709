#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function
__metaclass__ = type

DOCUMENTATION = r'''
---
module: cell_identity
short_description: Allocate and release permanent identities for cell slots
version_added: 0.1.0
description:
  - Gives each cell slot of a host a permanent identity, made of slot index, machine name, host-side
    veth name (at most 15 bytes), cell-side interface name, subnet with gateway and cell address
    from the host's pool, and a UID range for the cell's user namespace.
  - Identities are kept in a JSON ledger on the target (by default
    C(/var/lib/chv-fleet/identities.json)), read, changed and replaced atomically under an
    exclusive C(flock) on a lock file beside it, so parallel runs never hand out one identity twice.
  - Idempotent. Existing slots keep their identity; slots no longer listed are released; new slots
    get the lowest free index, subnet and UID range.
  - New identities never collide with the live host. Interface names in use, IPv4 addresses and routes
    of every routing table (including the uplink network and the default gateway), UIDs and GIDs of
    C(/etc/passwd) and C(/etc/group), C(/etc/subuid) and C(/etc/subgid) ranges, and UID ranges
    of running user namespaces are all avoided.
  - A change of O(pool), O(prefix), O(uid_mode), O(shared_uid), O(ifname_prefix),
    O(cell_ifname) or O(machine_prefix) that would alter existing identities fails unless
    O(reassign=true). Collisions that appear later between an existing slot and the host are
    reported in RV(conflicts) and as warnings, and are only moved with O(reassign=true).
  - A corrupt or truncated ledger makes the module fail with a message naming the file, and nothing
    is written. O(recover=true) rebuilds it from the live host instead.
  - A run that would release a slot, or change the identity of one (O(reassign=true)), while a cell
    of that slot is running fails, names the slot and the cell's pid, and writes nothing, unless
    O(force=true). Such a cell would keep its old veth and subnet, outside the firewall's set of
    cell interfaces. A cell is running when the C(chv-cell) launcher holds the slot's lock
    C(<state_dir>/locks/<slot>.lock) or when the slot's host-side veth exists.
  - Runs with the Python standard library only (no netaddr on targets).
author:
  - chv.fleet maintainers (@chv-fleet)
attributes:
  check_mode:
    support: full
    description:
      - Computes the new ledger and reports it without writing anything, not even the lock file.
      - Refuses to release or change slots with running cells exactly as a real run would.
  diff_mode:
    support: full
    description: Shows the ledger before and after, one line per slot.
  platform:
    support: full
    platforms: posix
    description: Needs Linux for the live-host checks (C(ip -j), C(/sys/class/net), C(/proc)).
options:
  slots:
    description:
      - The slots this host has, as a list of names or as a count V(N), which names them
        V(slot0) to V(slotN-1). A comma-separated string is split into names.
      - Names are lowercase letters, digits and C(-), start with a letter, at most 31 characters.
      - Required with O(state=present). With O(state=absent), omitting it releases every slot.
    type: raw
  pool:
    description:
      - IPv4 network the cell subnets are taken from.
      - It must not overlap the loopback (127.0.0.0/8), link-local (169.254.0.0/16) or multicast
        (224.0.0.0/4) ranges, where C(chv-cell) refuses a cell subnet.
    type: str
    default: 10.200.0.0/16
  prefix:
    description:
      - Prefix length of each cell subnet. Between the pool's prefix length and 30.
      - The subnet's first host address is the gateway (host side of the veth), the second the cell address.
    type: int
    default: 24
  uid_mode:
    description:
      - V(per_slot) gives each slot its own 65536-UID range, 65536-aligned, in systemd's container
        range (base from 524288 (0x80000) to 1879015424 (0x6FFF0000)).
      - V(shared) maps every cell's root to O(shared_uid), as C(--private-users=1000:65536) does.
    type: str
    choices: [per_slot, shared]
    default: per_slot
  shared_uid:
    description:
      - First host UID of the range every cell uses with O(uid_mode=shared).
      - With O(uid_mode=shared) it must not be 0 (cell root would be host root).
    type: int
    default: 1000
  ifname_prefix:
    description:
      - Host-side veth name prefix; the name is the prefix followed by the slot index and must fit
        in 15 bytes.
      - At most 12 characters (lowercase letters, digits, C(_) and C(-), starting with a letter), so
        that slot indexes up to 999 fit. The roles C(chv.fleet.cell_runtime) and C(chv.fleet.cell_nat)
        have the same limit.
    type: str
    default: chvh
  cell_ifname:
    description:
      - Interface name inside the cell (letters, digits, C(_), C(.) and C(-), starting with a
        letter, at most 15 bytes).
      - V(lo) is refused, it is the cell's loopback interface.
    type: str
    default: eth0
  machine_prefix:
    description:
      - Prefix of the systemd machine name; the machine name is the prefix followed by the slot name.
      - Empty or lowercase letters, digits and C(-), starting with a letter. A machine name longer
        than 64 characters (systemd's limit) is refused.
    type: str
    default: chv-
  ledger:
    description:
      - Path of the ledger. Its directory is created with mode C(0700) when missing; the ledger is
        written with mode C(0600), the lock file is O(ledger) followed by C(.lock).
    type: path
    default: /var/lib/chv-fleet/identities.json
  state:
    description:
      - V(present) makes the ledger hold exactly O(slots) (see O(purge)).
      - V(absent) releases O(slots), or every slot when O(slots) is omitted.
    type: str
    choices: [present, absent]
    default: present
  purge:
    description:
      - With O(state=present), release the slots of the ledger that are not in O(slots).
      - V(false) only adds the listed slots, leaving the others in place.
    type: bool
    default: true
  reassign:
    description:
      - Allow existing identities to change. Parts that no longer match the settings, or that
        collide with the live host, get the lowest free value; everything else is kept.
      - Without it such a settings change fails and names the slots it would move.
    type: bool
    default: false
  recover:
    description:
      - When the ledger is missing, corrupt or truncated, rebuild it from the live host instead of failing.
      - Interfaces named O(ifname_prefix) followed by a number N and carrying an address in a
        O(prefix)-long subnet of O(pool) keep index N and that subnet, given to the N-th listed slot
        (or the next unassigned one). Everything else is allocated afresh.
      - A corrupt ledger is kept as O(ledger) followed by C(.corrupt-<timestamp>), see RV(backup_file).
      - Has no effect while the ledger is valid.
    type: bool
    default: false
  lock_timeout:
    description: Seconds to wait for the ledger lock before failing.
    type: float
    default: 60
  force:
    description:
      - Release or change the identity of slots whose cells are running instead of failing.
      - Each such slot is named in a warning and in RV(running). Its cell keeps running with the
        old identity, outside the firewall's set of cell interfaces, until it is stopped.
      - The role C(chv.fleet.cell_runtime) sets it from C(chv_cell_identity_force).
    type: bool
    default: false
  state_dir:
    description:
      - Runtime state directory of the C(chv-cell) launcher (C(state_dir) of the cell policy).
      - A slot's cell is running when another process holds C(flock) on
        C(<state_dir>/locks/<slot>.lock) (the file is opened read-only and never created or
        removed) or when the slot's host-side interface exists in C(/sys/class/net). The pid is
        read from C(<state_dir>/cells/<slot>.json).
    type: path
    default: /run/chv-fleet
seealso:
  - name: Slot identities
    description: Ledger format, locking, recovery and the choices that change identities.
    link: https://github.com/chv-fleet/chv.fleet/blob/main/docs/identities.md
notes:
  - The C(chv-cell) launcher does not read the ledger. The role C(chv.fleet.cell_runtime) copies
    RV(identities) into the slot table of the cell policy, which is what the launcher reads.
  - The running-cell check happens once, under the ledger lock, before writing. A cell started
    later from the previous cell policy is not seen; stop the cells, then converge.
'''

EXAMPLES = r'''
- name: Four slots named slot0..slot3 from the default pool
  chv.fleet.cell_identity:
    slots: 4
  register: cell_slots

- name: Named slots, /28 subnets from a per-host pool, one UID range per slot
  chv.fleet.cell_identity:
    slots: [build, review, browse]
    pool: "{{ chv_fleet_supernet | chv.fleet.host_pool(chv_host_index, 20) }}"
    prefix: 28

- name: Add one slot without touching the others
  chv.fleet.cell_identity:
    slots: [scratch]
    purge: false

- name: Move every slot to a new pool on purpose
  chv.fleet.cell_identity:
    slots: 4
    pool: 10.210.0.0/16
    reassign: true

- name: Rebuild a lost or corrupt ledger from the running cells
  chv.fleet.cell_identity:
    slots: 4
    recover: true

- name: Release every slot (fails while a cell of any slot is running)
  chv.fleet.cell_identity:
    state: absent

- name: Go down to two slots even though cells of slot2 and slot3 may be running
  chv.fleet.cell_identity:
    slots: 2
    force: true
  register: cell_slots

- name: Launcher state in a non-default place (state_dir of the cell policy)
  chv.fleet.cell_identity:
    slots: 4
    state_dir: /run/chv-fleet-test
'''

RETURN = r'''
identities:
  description: Every slot identity in the ledger after the run, ordered by index.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Slot name.
      type: str
      sample: slot0
    index:
      description: Slot index, unique on the host; part of the host interface name.
      type: int
      sample: 0
    machine:
      description: systemd machine name (O(machine_prefix) + name).
      type: str
      sample: chv-slot0
    host_ifname:
      description: Host-side veth name (O(ifname_prefix) + index, at most 15 bytes).
      type: str
      sample: chvh0
    cell_ifname:
      description: Interface name inside the cell.
      type: str
      sample: eth0
    subnet:
      description: The slot's subnet.
      type: str
      sample: 10.200.0.0/24
    gateway:
      description: First host address of the subnet, on the host side of the veth.
      type: str
      sample: 10.200.0.1
    address:
      description: Second host address of the subnet, the cell's address.
      type: str
      sample: 10.200.0.2
    prefixlen:
      description: Prefix length of the subnet.
      type: int
      sample: 24
    uid_base:
      description: First host UID of the cell's user namespace range.
      type: int
      sample: 524288
    uid_size:
      description: Number of UIDs in the range.
      type: int
      sample: 65536
added:
  description: Slots that got a new identity in this run.
  returned: always
  type: list
  elements: str
  sample: [slot3]
removed:
  description: Slots whose identity was released.
  returned: always
  type: list
  elements: str
  sample: [old]
reassigned:
  description: Existing slots whose identity changed (only with O(reassign=true)).
  returned: always
  type: list
  elements: str
  sample: []
conflicts:
  description: Collisions between existing identities and the live host, left in place because O(reassign=false).
  returned: always
  type: list
  elements: str
  sample: ["slot0: subnet 10.200.0.0/24 overlaps 10.200.0.0/16 on wg0"]
recovered:
  description: Slots whose index and subnet were rebuilt from live interfaces (O(recover=true)).
  returned: always
  type: list
  elements: str
  sample: [slot0, slot1]
backup_file:
  description: Where the corrupt ledger was kept when O(recover=true) replaced it.
  returned: when a corrupt ledger was replaced
  type: str
  sample: /var/lib/chv-fleet/identities.json.corrupt-20250101T120000
ledger:
  description: Path of the ledger.
  returned: always
  type: str
  sample: /var/lib/chv-fleet/identities.json
running:
  description:
    - Slots released or changed although their cell was running (only with O(force=true); a run
      without it fails instead). Also returned with the failure.
  returned: always
  type: list
  elements: dict
  sample: [{slot: slot3, action: release, pid: 1234, lock: /run/chv-fleet/locks/slot3.lock,
            ifname: null, error: null}]
  contains:
    slot:
      description: Slot name.
      type: str
    action:
      description: V(release) or V(reassign).
      type: str
    pid:
      description: Leader pid of the cell from the launcher's record, null when it is unreadable.
      type: int
    lock:
      description: The slot lock held by the launcher, null when it is not held.
      type: str
    ifname:
      description: The slot's host-side interface when it exists, else null.
      type: str
    error:
      description: Why the slot lock could not be checked (the cell is then assumed to run), else null.
      type: str
'''

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.chv.fleet.plugins.module_utils.cell_identity import (
    AllocationError,
    CellIdentityError,
    CellProbe,
    DEFAULT_LEDGER,
    DEFAULT_STATE_DIR,
    LedgerError,
    RunningCellError,
    Settings,
    gather_host_facts,
    running_warning,
    update_ledger,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            slots=dict(type='raw'),
            pool=dict(type='str', default='10.200.0.0/16'),
            prefix=dict(type='int', default=24),
            uid_mode=dict(type='str', default='per_slot', choices=['per_slot', 'shared']),
            shared_uid=dict(type='int', default=1000),
            ifname_prefix=dict(type='str', default='chvh'),
            cell_ifname=dict(type='str', default='eth0'),
            machine_prefix=dict(type='str', default='chv-'),
            ledger=dict(type='path', default=DEFAULT_LEDGER),
            state=dict(type='str', default='present', choices=['present', 'absent']),
            purge=dict(type='bool', default=True),
            reassign=dict(type='bool', default=False),
            recover=dict(type='bool', default=False),
            lock_timeout=dict(type='float', default=60.0),
            force=dict(type='bool', default=False),
            state_dir=dict(type='path', default=DEFAULT_STATE_DIR),
        ),
        required_if=[('state', 'present', ('slots',))],
        supports_check_mode=True,
    )
    p = module.params
    try:
        settings = Settings(pool=p['pool'], prefix=p['prefix'], uid_mode=p['uid_mode'],
                            shared_uid=p['shared_uid'], ifname_prefix=p['ifname_prefix'],
                            cell_ifname=p['cell_ifname'], machine_prefix=p['machine_prefix'])
    except AllocationError as exc:
        module.fail_json(msg=str(exc), param=exc.param)

    ip_bin = module.get_bin_path('ip', required=True)

    def run(argv):
        rc, out, err = module.run_command([ip_bin] + list(argv[1:]))
        if rc != 0:
            module.fail_json(msg='%s failed (rc=%d): %s' % (' '.join(argv), rc, err.strip()))
        return out

    host = gather_host_facts(run)
    try:
        result = update_ledger(p['ledger'], p['slots'], settings, host, state=p['state'],
                               purge=p['purge'], reassign=p['reassign'], recover=p['recover'],
                               check_mode=module.check_mode, lock_timeout=p['lock_timeout'],
                               force=p['force'], probe=CellProbe(p['state_dir']))
    except RunningCellError as exc:
        module.fail_json(msg='%s. Nothing was written.' % exc, param=exc.param, ledger=p['ledger'],
                         running=[cell.as_dict() for cell in exc.cells])
    except LedgerError as exc:
        hint = '' if 'recover: true' in str(exc) else (
            '; restore the file or run again with recover: true to rebuild it from the live host')
        module.fail_json(msg='%s%s. Nothing was written.' % (exc, hint), ledger=p['ledger'])
    except AllocationError as exc:
        module.fail_json(msg='%s. Nothing was written.' % exc, param=exc.param, ledger=p['ledger'])
    except (CellIdentityError, OSError) as exc:
        module.fail_json(msg='%s. Nothing was written.' % exc, ledger=p['ledger'])

    for cell in result['running']:
        module.warn(running_warning(cell))
    for conflict in result['conflicts']:
        module.warn('slot identity collides with the live host: %s (set reassign: true to move it)'
                    % conflict)
    out = dict(
        changed=result['changed'],
        ledger=p['ledger'],
        identities=result['identities'],
        added=result['added'],
        removed=result['removed'],
        reassigned=result['reassigned'],
        conflicts=result['conflicts'],
        recovered=result['recovered'],
        running=[cell.as_dict() for cell in result['running']],
    )
    if result['backup_file']:
        out['backup_file'] = result['backup_file']
    if module._diff:
        out['diff'] = dict(before=result['before'], after=result['after'],
                           before_header=p['ledger'], after_header=p['ledger'])
    module.exit_json(**out)


if __name__ == '__main__':
    main()
