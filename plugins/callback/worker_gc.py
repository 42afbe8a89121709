# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The worker_gc callback: lighter task workers on the controller."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

DOCUMENTATION = r'''
name: worker_gc
type: aggregate
short_description: Lighter task workers on the controller (Python's garbage collector)
description:
  - C(ansible-playbook) forks one worker process per task and host, from a
    process that holds the whole run (inventory, playbooks, variables).
    Python's cyclic garbage collector, run in a worker, walks that inherited
    heap and writes to its pages, which the kernel then copies for the
    worker; on chv.fleet's no-change runs this was a fifth (every task run)
    to a third (the fast path) of the controller's CPU time
    (docs/performance.md).
  - This callback switches the collector off in every process forked from
    C(ansible-playbook) (a worker runs one task on one host and exits, and its
    memory goes with it), and at the start of each play (each batch of a
    serial play) moves every object the controller holds then into the
    collector's permanent generation (Python's C(gc.freeze)), which neither
    the controller nor its workers walk again. The controller keeps
    collecting what it creates after that.
  - What it costs is memory in a worker that runs long, such as one task
    looping over many items, whose reference cycles stay until it exits
    (measured with a local loop of 1,500 items, each templating a list of
    300 strings, the worker's peak was 65 MB, against 48 MB with the
    collector).
  - It prints nothing and changes no task or result. Enable it in
    C(ansible.cfg) with C(callbacks_enabled = chv.fleet.fleet_summary,
    chv.fleet.worker_gc) (docs/examples/ansible.cfg does); without it a run
    does the same, with more CPU time.
requirements:
  - enabled in the callbacks_enabled setting
'''

import gc
import os

from ansible.plugins.callback import CallbackBase

# os.register_at_fork has no way back: registered once per process, however
# many times Ansible loads the callback
_AT_FORK = []


def register_at_fork():
    """Switch the garbage collector off in every child forked from now on (once per process)."""
    if not _AT_FORK:
        os.register_at_fork(after_in_child=gc.disable)
        _AT_FORK.append(True)


class CallbackModule(CallbackBase):
    """No collector in the workers; the controller's heap frozen at each play's start."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'chv.fleet.worker_gc'
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super(CallbackModule, self).__init__()
        register_at_fork()

    def v2_playbook_on_play_start(self, play):
        # before the play's first worker is forked
        gc.freeze()
