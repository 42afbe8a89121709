# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One line per host at the end of a chv.fleet run (the fleet_summary
callback): what the run did to the host, from Ansible's own counts, the
first failure, and what the playbooks recorded with set_stats (per host:
chv_fleet_state, chv_fleet_batch, chv_fleet_path, chv_fleet_drain,
chv_fleet_gate).

Pure: the callback hands in plain data, the tests call it directly."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

# what a playbook records per host (ansible.builtin.set_stats, per_host), in
# the order shown
RECORDED = (('chv_fleet_batch', 'batch'), ('chv_fleet_path', 'path'), ('chv_fleet_drain', 'drain'), ('chv_fleet_gate', 'gate'))
# a failure message is cut to this many characters (the full one is above in the log)
MESSAGE_MAX = 300


def _short(text, limit=MESSAGE_MAX):
    text = ' '.join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + '...'


def host_line(host, counts, custom, failure):
    """The summary line of ``host``.

    ``counts``: Ansible's recap counts of the host (ok, changed, failures,
    unreachable, skipped, ...); ``custom``: what the playbooks recorded for
    it (set_stats per host); ``failure``: (task name, message) of its first
    failure, or None."""
    custom = custom or {}
    if counts.get('unreachable'):
        state = 'UNREACHABLE'
    elif counts.get('failures'):  # a failure a block rescued is no failure of the host
        state = 'FAILED'
    elif custom.get('chv_fleet_state'):
        state = str(custom['chv_fleet_state'])
    else:
        state = 'ok'
    parts = [state, 'changed=%d' % int(counts.get('changed', 0))]
    parts += ['%s: %s' % (label, _short(custom[key])) for key, label in RECORDED if custom.get(key) not in (None, '')]
    if failure is not None and state in ('FAILED', 'UNREACHABLE'):
        task, msg = failure
        parts.append('at "%s": %s' % (task, _short(msg)))
    return '%s: %s' % (host, ', '.join(parts))


def summary_lines(hosts, counts, custom, failures):
    """One line per host of ``hosts`` (in the run's order); ``counts``,
    ``custom``, ``failures``: per host, as for host_line."""
    return [host_line(h, counts.get(h, {}), custom.get(h), failures.get(h)) for h in hosts]
