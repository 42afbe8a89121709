# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The batches Ansible's ``serial`` keyword makes of a play's hosts.

site.yml compares them with the batch it really runs: a ``chv_fleet_batches``
set in the inventory (which Ansible ignores for play keywords) that would
batch differently is refused instead of ignored. Documentation lives beside
this file (serial_batches.yml), as ansible-core 2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

from collections.abc import Sequence

from ansible.errors import AnsibleFilterError
from ansible.utils.helpers import pct_to_int


def _check(serial):
    if isinstance(serial, (str, int)) and not isinstance(serial, bool):
        serial = [serial]
    if isinstance(serial, (bytes, dict)) or not isinstance(serial, Sequence):
        raise AnsibleFilterError('chv.fleet.serial_batches: serial must be a number, a percentage '
                                 'or a list of them, got %r' % (serial,))
    for value in serial:
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
            isinstance(value, str) and (value.isdigit() or (value.endswith('%') and value[:-1].isdigit())))
        if not ok:
            raise AnsibleFilterError('chv.fleet.serial_batches: %r is not a host count or a percentage '
                                     '(for example 1, 10%%, 100%%)' % (value,))
    return list(serial)


def serial_batches(hosts, serial):
    """The batches of ``hosts`` (in play order) under ``serial``, computed
    as ansible-core's PlaybookExecutor does (percentages of all the play's
    hosts, at least one host; the last value repeats; 0 or none: one batch)."""
    serial = _check(serial) or [0]
    remaining, total, batches, index = list(hosts), len(hosts), [], 0
    while remaining:
        size = pct_to_int(serial[index], total)
        if size <= 0:
            batches.append(remaining)
            break
        batches.append(remaining[:size])
        remaining = remaining[size:]
        index = min(index + 1, len(serial) - 1)
    return batches


class FilterModule(object):
    def filters(self):
        return {'serial_batches': serial_batches}
