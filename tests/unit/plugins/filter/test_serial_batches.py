"""chv.fleet.serial_batches against ansible-core's own batching of a real play."""
import json
import os
import subprocess
import sys

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.chv.fleet.plugins.filter.serial_batches import serial_batches


@pytest.mark.parametrize("count, serial, sizes", [
    (1, [1, "10%", "100%"], [1]),
    (3, [1, "10%", "100%"], [1, 1, 1]),          # 10% of 3 is 0: at least one host
    (25, [1, "10%", "100%"], [1, 2, 22]),
    (5, 2, [2, 2, 1]),
    (5, "40%", [2, 2, 1]),
    (4, [], [4]),
    (4, 0, [4]),
    (0, [1], []),
])
def test_batches(count, serial, sizes):
    hosts = ["h%d" % i for i in range(count)]
    batches = serial_batches(hosts, serial)
    assert [len(b) for b in batches] == sizes
    assert sum(batches, []) == hosts


@pytest.mark.parametrize("serial", [True, "ten", "10.5%", -1, [1, None], {"a": 1}])
def test_bad_serial_is_refused(serial):
    with pytest.raises(AnsibleFilterError, match="serial"):
        serial_batches(["a"], serial)


# (host count, serial): ansible-playbook runs one play per case, in one process.
_CASES = [(n, serial) for n in (1, 3, 12) for serial in
          ([1, "10%", "100%"], [2], ["30%"], [1, 3], ["50%", 1], [5, "10%"])]


def test_same_batches_as_ansible_playbook(tmp_path):
    groups = {"n%d" % n: {"hosts": {"h%02d" % i: {"ansible_connection": "local"} for i in range(n)}}
              for n in sorted({n for n, dummy in _CASES})}
    (tmp_path / "inv.yml").write_text(json.dumps({"all": {"children": groups}}))
    plays = [{"hosts": "n%d" % n, "gather_facts": False, "serial": serial,
              "tasks": [{"ansible.builtin.debug": {"msg": "CASE %d {{ ansible_play_batch | to_json }}" % k},
                         "run_once": True}]}
             for k, (n, serial) in enumerate(_CASES)]
    (tmp_path / "play.yml").write_text(json.dumps(plays))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i",
                           str(tmp_path / "inv.yml"), str(tmp_path / "play.yml")], capture_output=True, text=True,
                          check=False, env=dict(os.environ, ANSIBLE_NOCOLOR="1",
                                                ANSIBLE_PYTHON_INTERPRETER=sys.executable))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = {}
    for line in proc.stdout.splitlines():
        if '"msg": "CASE ' in line:
            k, batch = line.split('"msg": "CASE ', 1)[1].rstrip('"').split(" ", 1)
            ran.setdefault(int(k), []).append(json.loads(batch.replace('\\"', '"')))
    for k, (n, serial) in enumerate(_CASES):
        hosts = sorted(groups["n%d" % n]["hosts"])
        assert ran[k] == serial_batches(hosts, serial), (n, serial)
