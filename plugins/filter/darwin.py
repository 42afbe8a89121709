# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""macOS hosts (docs/macos.md): the slot users, the Seatbelt profile of a
slot and the pf anchor's rules, each computed by the one pure function the
tests import too: the slot users from the identity rules of
module_utils/cell_identity.py, the profile from the launcher's
``chv_guest.cell.seatbelt`` (the collection's src/, imported as
chv.fleet.cell_policy_errors imports the launcher's validator), the pf
rules from module_utils/pf_anchor.py.

Documentation lives beside this file (darwin_slots.yml,
seatbelt_profile.yml, pf_anchor_rules.yml), as ansible-core 2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import re

from ansible.errors import AnsibleFilterError
# The modules below are imported where a filter runs (see the note in pools.py).
# pylint: disable=import-outside-toplevel

_USER_RE = re.compile(r'^_[a-z0-9_-]{1,31}$')


def darwin_slots(slots, machine_prefix='chv-'):
    """The slot records of a macOS host: one unprivileged user per slot,
    named _<machine_prefix><slot> with the uid the cell_identity module
    gives the slot's range on a fresh Linux host (UID_PER_SLOT_MIN + index
    * UID_RANGE_SIZE), uid_size 1."""
    from ansible_collections.chv.fleet.plugins.module_utils.cell_identity import (
        UID_PER_SLOT_MIN, UID_RANGE_SIZE, AllocationError, normalize_slot_names)
    try:
        names = normalize_slot_names(slots)
    except AllocationError as exc:
        raise AnsibleFilterError('chv.fleet.darwin_slots: %s' % exc)
    if not names:
        raise AnsibleFilterError('chv.fleet.darwin_slots: chv_cell_slots names no slot')
    out = []
    for index, name in enumerate(names):
        user = '_%s%s' % (machine_prefix, name)
        if not _USER_RE.match(user):
            raise AnsibleFilterError('chv.fleet.darwin_slots: %r (chv_cell_machine_prefix + slot name) is not a '
                                     'macOS user name of at most 32 characters' % user)
        out.append({'name': name, 'index': index, 'user': user,
                    'uid_base': UID_PER_SLOT_MIN + index * UID_RANGE_SIZE, 'uid_size': 1})
    return out


def seatbelt_profile(policy, slot):
    """The Seatbelt profile of ``slot`` (a slot record or its name) under ``policy``."""
    from ansible_collections.chv.fleet.src.chv_guest.cell import seatbelt
    if not isinstance(policy, dict):
        raise AnsibleFilterError('chv.fleet.seatbelt_profile: expected the cell policy as a dict')
    if isinstance(slot, str):
        found = [s for s in policy.get('slots') or [] if s.get('name') == slot]
        if not found:
            raise AnsibleFilterError('chv.fleet.seatbelt_profile: no slot %r in the policy' % slot)
        slot = found[0]
    try:
        return seatbelt.profile(policy, slot)
    except (KeyError, ValueError) as exc:
        raise AnsibleFilterError('chv.fleet.seatbelt_profile: %s' % exc)


def pf_anchor_rules(uids, allow=(), deny=(), dns_resolvers=()):
    """The pf anchor's rules for the slot users ``uids``; with no uids (no
    slots yet) the lists are only checked, and the result is empty."""
    from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import CellNatError
    from ansible_collections.chv.fleet.plugins.module_utils.pf_anchor import anchor_rules, check_egress
    try:
        if not uids:
            check_egress(allow, deny, dns_resolvers)
            return []
        return anchor_rules([int(u) for u in uids], allow, deny, dns_resolvers)
    except (CellNatError, TypeError, ValueError) as exc:
        raise AnsibleFilterError('chv.fleet.pf_anchor_rules: %s' % exc)


class FilterModule(object):
    """chv.fleet macOS filters."""

    def filters(self):
        return {'darwin_slots': darwin_slots, 'seatbelt_profile': seatbelt_profile,
                'pf_anchor_rules': pf_anchor_rules}
