"""The worker_gc callback (plugins/callback/worker_gc.py): Python's garbage
collector off in the processes forked after it loads, on in the controller,
the controller's heap frozen at a play's start; in a real ansible-playbook
run, beside the same run without the callback."""
import json
import os
import subprocess
import sys

import pytest

# In a process of its own (os.register_at_fork cannot be undone): whether a
# child forked before and after the callback loads has the collector on.
_PROBE = r'''
import gc, json, os
from ansible_collections.chv.fleet.plugins.callback import worker_gc

def child_collects():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b'1' if gc.isenabled() else b'0')
        os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.waitpid(pid, 0)
    return answer == b'1'

out = {'child_before': child_collects()}
callback = worker_gc.CallbackModule()
worker_gc.CallbackModule()  # Ansible may load it again: one registration
out['registrations'] = len(worker_gc._AT_FORK)
out['child_after'] = child_collects()
out['parent_after'] = gc.isenabled()
held = [[n] for n in range(5000)]  # tracked objects the controller holds at the play's start
frozen = gc.get_freeze_count()
callback.v2_playbook_on_play_start(None)
out['frozen'] = gc.get_freeze_count() - frozen
print(json.dumps(out))
'''


def test_the_collector_is_off_in_forked_children_only_and_the_heap_frozen_at_a_play():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # the control: a child forked before the callback loaded collects
    assert out["child_before"] is True
    assert out["child_after"] is False
    assert out["parent_after"] is True
    assert out["registrations"] == 1
    assert out["frozen"] >= 5000


# A filter that reports, from the task worker that templates the task's
# arguments, whether it collects garbage and how many objects it inherited frozen.
_FILTER = '''
import gc


class FilterModule(object):
    def filters(self):
        return {'worker_gc_probe': lambda _: '%s %d' % (gc.isenabled(), gc.get_freeze_count())}
'''


@pytest.mark.parametrize("callbacks, collects", [("chv.fleet.fleet_summary,chv.fleet.worker_gc", False),
                                                 ("chv.fleet.fleet_summary", True)],
                         ids=["with_worker_gc", "without"])
def test_a_real_runs_task_workers(tmp_path, callbacks, collects):
    (tmp_path / "filter_plugins").mkdir()
    (tmp_path / "filter_plugins" / "probe.py").write_text(_FILTER)
    (tmp_path / "play.yml").write_text(json.dumps([{
        "hosts": "localhost", "gather_facts": False,
        "tasks": [{"ansible.builtin.debug": {"msg": "PROBE {{ 0 | worker_gc_probe }}"}}]}]))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "localhost,",
                           "-c", "local", str(tmp_path / "play.yml")], capture_output=True, text=True, check=False,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_CALLBACKS_ENABLED=callbacks,
                                   ANSIBLE_FILTER_PLUGINS=str(tmp_path / "filter_plugins"),
                                   ANSIBLE_PYTHON_INTERPRETER=sys.executable))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    enabled, frozen = proc.stdout.split('"msg": "PROBE ', 1)[1].split('"', 1)[0].split()
    assert enabled == str(collects)
    # frozen: the controller's heap at the play's start (hundreds of thousands of objects), inherited
    # by the worker; a fresh interpreter's own count is the baseline (Python 3.12 starts at a few hundred)
    fresh = int(subprocess.check_output([sys.executable, "-c", "import gc; print(gc.get_freeze_count())"]))
    assert (int(frozen) - fresh > 10000) is not collects, (frozen, fresh)
