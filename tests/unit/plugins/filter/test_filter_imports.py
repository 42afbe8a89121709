"""The collection's filter files import nothing heavy at their top.

To find one filter of a collection, ansible-core loads every filter file of
it into each task's worker process (docs/performance.md, "Controller CPU"):
a module imported at the top of any filter file is imported again for every
task that uses any chv.fleet filter. The heavy ones (the launcher's and the
doors' modules, netaddr, the fleet report) are imported where the filter that
needs them runs. Checked in a fresh interpreter: loading every filter file
leaves them out; the control, calling one filter of each, brings them in."""

import json
import os
import subprocess
import sys

HEAVY = ["netaddr",
         "ansible_collections.chv.fleet.src.chv_guest.broker.config",
         "ansible_collections.chv.fleet.src.chv_guest.browser.config",
         "ansible_collections.chv.fleet.src.chv_guest.cell.policy",
         "ansible_collections.chv.fleet.src.chv_guest.cell.seatbelt",
         "ansible_collections.chv.fleet.plugins.module_utils.fleet_report",
         "ansible_collections.chv.fleet.plugins.module_utils.pf_anchor",
         "ansible_collections.chv.fleet.plugins.module_utils.cell_identity"]

PROGRAM = """
import importlib, json, pkgutil, sys
from ansible.utils.collection_loader._collection_finder import _AnsibleCollectionFinder
_AnsibleCollectionFinder(paths=[p for p in sys.path if p])._install()
pkg = importlib.import_module('ansible_collections.chv.fleet.plugins.filter')
mods = [importlib.import_module(name) for _, name, ispkg in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.')
        if not ispkg]
heavy = json.loads(sys.argv[1])
loaded = [h for h in heavy if h in sys.modules]
f = {}
for m in mods:
    f.update(m.FilterModule().filters())
if sys.argv[2] == 'call':
    f['door_default']('chv_broker_read_timeout', 'broker')
    f['door_default']('chv_browser_socket_path', 'browser')
    f['cell_policy_errors']({})
    f['host_pool']('10.200.0.0/16', 1, 24)
    f['audit_settings_errors']({})
    f['darwin_slots'](['slot0'])
    f['pf_anchor_rules']([], [{'cidr': '192.0.2.0/24'}])
    try:
        f['seatbelt_profile']({}, 'slot0')  # refused (no slots), after its import
    except Exception:
        pass
print(json.dumps({'files': len(mods), 'loaded': loaded if sys.argv[2] == 'load' else [h for h in heavy if h in sys.modules]}))
"""


def _run(mode):
    proc = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(HEAVY), mode], capture_output=True, text=True,
                          env=dict(os.environ), check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_loading_every_filter_file_imports_nothing_heavy():
    out = _run("load")
    assert out["files"] >= 10 and out["loaded"] == [], out


def test_control_each_filter_imports_what_it_needs_when_it_runs():
    out = _run("call")
    assert set(out["loaded"]) == set(HEAVY), out
