"""docs/examples/inventory, read by ansible-playbook as ops would use it.

Every host of the example is this machine here (a second inventory source
sets ansible_connection local): the roles' own checks run on each host's
values (the validate entry points of cell_runtime, broker and browser; the
cell_nat one probes the host's interfaces and the example's uplink is not
this machine's), and the values the roles would use are written out per
host: the group and host layers in effect on top of the fleet's, the odd
host's own values, the vaulted credentials decrypted."""

import ipaddress
import json
import os
import subprocess
import sys

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
EXAMPLE = os.path.join(ROOT, "docs", "examples", "inventory")

PLAYBOOK = """
- hosts: chv_fleet
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: chv.fleet.cell_runtime, tasks_from: validate, public: true}
    - ansible.builtin.include_role: {name: chv.fleet.broker, tasks_from: validate, public: true}
    - ansible.builtin.include_role: {name: chv.fleet.browser, tasks_from: validate, public: true}
    - ansible.builtin.include_role: {name: chv.fleet.cell_nat, tasks_from: owned, public: true}
    - ansible.builtin.copy:
        dest: "%s/{{ inventory_hostname }}.json"
        mode: "0600"
        content: "{{ {'slots': chv_cell_slots, 'pool': chv_cell_pool, 'uplink': cell_nat_uplink,
                       'deny': __cell_nat_egress_deny, 'properties': __cell_runtime_properties,
                       'credentials': chv_broker_sync_credentials, 'sync_hosts': chv_broker_sync_hosts} | to_json }}"
      delegate_to: localhost
"""


def render(tmp_path):
    (tmp_path / "local.yml").write_text(json.dumps({"all": {"vars": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    (tmp_path / "render.yml").write_text(PLAYBOOK % tmp_path)
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", EXAMPLE, "-i", str(tmp_path / "local.yml"),
                           "--vault-password-file", os.path.join(EXAMPLE, "example-vault-password"),
                           str(tmp_path / "render.yml")],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout, dict((h, json.loads((tmp_path / ("%s.json" % h)).read_text()))
                             for h in ("guest-a", "guest-b", "guest-c"))


def test_the_example_inventory_layers_per_group_and_host_and_passes_the_roles_checks(tmp_path):
    out, hosts = render(tmp_path)
    a, b, c = hosts["guest-a"], hosts["guest-b"], hosts["guest-c"]
    assert "build-1" not in out  # outside chv_fleet
    # pools from chv.fleet.host_pool by each guest's index: disjoint /16s of the fleet supernet
    assert (a["pool"], b["pool"], c["pool"]) == ("10.192.0.0/16", "10.193.0.0/16", "10.194.0.0/16")
    assert all(ipaddress.ip_network(h["pool"]).subnet_of(ipaddress.ip_network("10.192.0.0/12")) for h in (a, b, c))
    # the odd host: its own slot count and uplink; the others the fleet's and the role's default
    assert (a["slots"], c["slots"]) == (2, 3) and c["uplink"] == "ens5" and a["uplink"] != "ens5"
    # deny lists extended per group and host, never replaced: the fleet's entries stay everywhere
    cidrs = dict((name, [e["cidr"] for e in h["deny"]]) for name, h in hosts.items())
    fleet = ["172.16.0.0/12", "192.168.0.0/16"]
    assert cidrs["guest-a"] == cidrs["guest-b"] == fleet
    assert cidrs["guest-c"] == fleet + ["100.64.0.0/10", "198.51.100.128/25"]
    # unit properties layered key by key: the role's defaults, the fleet's CPUQuota, the group's and host's memory
    assert a["properties"]["CPUQuota"] == c["properties"]["CPUQuota"] == "150%"
    assert a["properties"]["TasksMax"] == c["properties"]["TasksMax"]  # the role's default, kept
    assert c["properties"]["MemoryMax"] == "6G"  # the host's over the group's 5G
    assert a["properties"]["MemoryMax"] == b["properties"]["MemoryMax"]  # the role's default
    assert a["properties"]["MemoryMax"] not in ("5G", "6G")
    # the vaulted credentials, decrypted with the example's vault password
    assert a["credentials"] == "https://chv-sync:example-token@git.example.com" and a["sync_hosts"] == ["git.example.com"]
