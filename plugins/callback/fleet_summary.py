# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet_summary callback: one line per host at the end of a run."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

DOCUMENTATION = r'''
name: fleet_summary
type: aggregate
short_description: One line per host at the end of a chv.fleet run
description:
  - At the end of a run (after Ansible's recap), one line per host, in the
    order the run met them; what the run did there (C(ok), C(FAILED),
    C(UNREACHABLE), or what a playbook recorded, such as C(unreachable,
    skipped)), the number of changed tasks, the batch, the drain, the
    health gate's verdict, and for a failed host the task and message of its
    first failure.
  - chv.fleet's playbooks record the batch, the drain and the gate per host
    with M(ansible.builtin.set_stats) (C(chv_fleet_batch), C(chv_fleet_drain),
    C(chv_fleet_gate), C(chv_fleet_state)); other playbooks get the counts
    and failures only.
  - Works beside any stdout callback. Enable it in C(ansible.cfg) with
    C(callbacks_enabled = chv.fleet.fleet_summary) (docs/examples/ansible.cfg
    does).
requirements:
  - enabled in the callbacks_enabled setting
'''

from ansible.plugins.callback import CallbackBase
from ansible_collections.chv.fleet.plugins.module_utils.fleet_summary import summary_lines


class CallbackModule(CallbackBase):
    """One line per host at the end of the run (module_utils/fleet_summary.py)."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'chv.fleet.fleet_summary'
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super(CallbackModule, self).__init__()
        self._first_failure = {}

    def _remember(self, result):
        self._first_failure.setdefault(result._host.get_name(),
                                       (result._task.get_name(), result._result.get('msg', '')))

    def v2_runner_on_failed(self, result, ignore_errors=False):
        if not ignore_errors:
            self._remember(result)

    def v2_runner_on_unreachable(self, result):
        if not result._task.ignore_unreachable:
            self._remember(result)

    def v2_playbook_on_stats(self, stats):
        hosts = list(stats.processed)
        lines = summary_lines(hosts, dict((h, stats.summarize(h)) for h in hosts), stats.custom,
                              self._first_failure)
        if lines:
            self._display.banner('CHV.FLEET SUMMARY (one line per host)')
            for line in lines:
                self._display.display(line)
