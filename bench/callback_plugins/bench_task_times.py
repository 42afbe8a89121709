# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark helper (bench/bench_rollout.py), not part of the collection.

Records the wall time of every task of a playbook run, as profile_tasks
does (from a task's start to the next task's start, the next play's start
or the end of the run; with several hosts in the batch that is the task's
time across all of them), and the per-host stats of the PLAY RECAP, to the
JSON file named by CHV_BENCH_TASK_TIMES. Enabled for the benchmark's runs
only:
  ANSIBLE_CALLBACK_PLUGINS=bench/callback_plugins ANSIBLE_CALLBACKS_ENABLED=bench_task_times
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: bench_task_times
type: aggregate
short_description: write each task's wall time to a JSON file (bench/bench_rollout.py)
description:
  - "Writes each task's name, role, path and seconds, and the per-host stats of the PLAY RECAP, as JSON
    to the file named by the environment variable C(CHV_BENCH_TASK_TIMES)."
requirements:
  - enabled with ANSIBLE_CALLBACKS_ENABLED
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'bench_task_times'
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super(CallbackModule, self).__init__(*args, **kwargs)
        self._tasks = []
        self._current = None
        self._started = time.monotonic()

    def _close(self):
        if self._current is not None:
            self._current['seconds'] = round(time.monotonic() - self._current.pop('start'), 3)
            self._tasks.append(self._current)
            self._current = None

    def _open(self, task, handler=False):
        self._close()
        role = task._role.get_name() if getattr(task, '_role', None) else ''
        self._current = {'name': task.get_name(), 'role': role, 'path': task.get_path() or '',
                         'handler': handler, 'start': time.monotonic()}

    def v2_playbook_on_play_start(self, play):
        self._close()

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._open(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._open(task, handler=True)

    def v2_playbook_on_stats(self, stats):
        self._close()
        hosts = sorted(stats.processed.keys())
        out = {
            'wall_seconds': round(time.monotonic() - self._started, 3),
            'tasks': self._tasks,
            'stats': dict((h, stats.summarize(h)) for h in hosts),
        }
        path = os.environ.get('CHV_BENCH_TASK_TIMES')
        if path:
            with open(path, 'w') as handle:
                json.dump(out, handle, indent=1)
