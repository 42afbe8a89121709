"""The cell_nat_info module and the role's template run through ansible-playbook in a namespace.

* the template Ansible renders is byte-identical to the rendering the netns
  tests load (so those tests exercise what the role writes);
* the module discovers the uplink and reports a foreign drop chain as a warning;
* invalid variables fail at the role's first task, naming the variable,
  before anything is changed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cellnat_lab
from cellnat_lab import lab, run  # noqa: F401  # pylint: disable=unused-import

from ansible_collections.chv.fleet.plugins.module_utils import cell_nat

_SKIP = cellnat_lab.lab_available()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
COLLECTIONS = Path(cell_nat.__file__).parents[5]     # .../<root>/ansible_collections/chv/fleet/plugins/module_utils


def playbook(lab, tmp_path, text, *args, wrap=()):
    """ansible-playbook on ``text`` in the lab's guest namespace (under the ``wrap`` command, if any)."""
    path = tmp_path / "play.yml"
    path.write_text(text)
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(COLLECTIONS), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "local"), ANSIBLE_REMOTE_TEMP=str(tmp_path / "remote"),
               ANSIBLE_RETRY_FILES_ENABLED="0", ANSIBLE_STDOUT_CALLBACK="default")
    cmd = ["ip", "netns", "exec", lab.guest] + list(wrap) + [str(PLAYBOOK), "-i", "localhost,", "-c", "local",
           "-e", "ansible_python_interpreter=%s" % sys.executable, str(path)] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


RENDER = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Validate and discover
      chv.fleet.cell_nat_info:
        slots: {slots}
        egress_allow: [{{cidr: 198.20.1.0/24}}, {{cidr: 198.20.3.1, proto: tcp, ports: [8080, "9000-9100"]}}]
        egress_deny: [{{cidr: 198.20.1.200}}]
        dns_via_gateway: true
        ratelimit: 20
        var_prefix: cell_nat_
      register: facts
    - name: Keep what the module returned
      ansible.builtin.copy:
        content: "{{{{ facts | to_json }}}}"
        dest: {tmp}/facts.json
        mode: "0600"
    - name: Render with the role's template, checked by nft -c as the role does
      ansible.builtin.template:
        src: {template}
        dest: {tmp}/cell-nat.nft
        mode: "0644"
        validate: nft -c -f %s
      vars:
        __cell_nat_ruleset: "{{{{ facts.ruleset }}}}"
"""


def test_ansible_renders_what_the_netns_tests_load(lab, tmp_path):
    lab.nft("add table ip cnt_foreign; add chain ip cnt_foreign FORWARD "
            "{ type filter hook forward priority 0; policy drop; }")
    try:
        proc = playbook(lab, tmp_path, RENDER.format(slots=json.dumps(lab.slots), tmp=tmp_path,
                                                     template=cellnat_lab.TEMPLATE))
    finally:
        run("nft", "delete", "table", "ip", "cnt_foreign", ns=lab.guest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert (facts["uplink"], facts["uplink_source"], facts["slots_source"]) == ("upA", "default_route", "variable")
    assert [(c["table"], c["chain"]) for c in facts["conflicts"]] == [("cnt_foreign", "FORWARD")]
    assert "table ip cnt_foreign, chain FORWARD (hook forward, priority 0): policy drop" in proc.stdout + proc.stderr
    rendered = (tmp_path / "cell-nat.nft").read_text()
    assert rendered == cellnat_lab.render(facts["ruleset"])
    lab.load_text(rendered)
    assert lab.probe(lab.cell_a, "198.20.1.1", 8080) == "198.20.0.2"     # allowed
    assert lab.probe(lab.cell_a, "198.20.0.1", 8080) is None             # not on the allow list


OLD_NAME = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Call the module by its old name
      chv.fleet.{name}:
        slots: {slots}
      register: info
    - name: Keep what it returned
      ansible.builtin.copy:
        content: "{{{{ info | to_json }}}}"
        dest: {tmp}/info.json
        mode: "0600"
"""


@pytest.mark.parametrize("name", ["cell_nat_info", "cell_nat_facts"])
def test_the_old_name_redirects_to_cell_nat_info(lab, tmp_path, name):
    """meta/runtime.yml routes cell_nat_facts (the module's first name) to cell_nat_info."""
    proc = playbook(lab, tmp_path, OLD_NAME.format(name=name, slots=json.dumps(lab.slots), tmp=tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((tmp_path / "info.json").read_text())
    assert (info["uplink"], info["slots_source"]) == ("upA", "variable")
    assert "ansible_facts" not in info


CASES = """
- hosts: localhost
  gather_facts: false
  vars:
    outcomes: []
  tasks:
{cases}
    - name: Report
      ansible.builtin.copy:
        content: "{{{{ outcomes | to_json }}}}"
        dest: {tmp}/outcomes.json
        mode: "0600"
      check_mode: false
"""
CASE = """
    - name: Case {n}
      block:
        - name: Run the role
          ansible.builtin.include_role:
            name: chv.fleet.cell_nat
          vars: {vars}
      rescue:
        - name: Record where and why case {n} failed
          ansible.builtin.set_fact:
            outcomes: "{{{{ outcomes + [{{'task': ansible_failed_task.name, 'msg': ansible_failed_result.msg,
                                          'errors': ansible_failed_result.argument_errors | default([])}}] }}}}"
"""


def test_invalid_variables_fail_before_any_change(lab, tmp_path):
    base = {"cell_nat_slots": lab.slots, "cell_nat_config_dir": str(tmp_path / "etc"),
            "cell_nat_sysctl_file": str(tmp_path / "sysctl.conf")}
    cases = [
        dict(base, cell_nat_egress_allow=[{"cidr": "198.20.1.0/33"}]),
        dict(base, cell_nat_uplink="eth9"),
        dict(base, cell_nat_egress_allow=[{"cidr": "198.20.0.0/16"}],
             cell_nat_egress_deny=[{"cidr": "198.20.0.0/15"}]),
        dict(base, cell_nat_ratelimit="many"),
        dict(base, cell_nat_slots=[dict(lab.slots[0], host_ifname="chvh0-far-too-long")]),
    ]
    text = CASES.format(tmp=tmp_path, cases="".join(CASE.format(n=i, vars=json.dumps(c)) for i, c in enumerate(cases)))
    # --check as a second safety net: these runs must stop before changing anything anyway.
    proc = playbook(lab, tmp_path, text, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())
    print("\n".join("%s: %s" % (o["task"], o["msg"]) for o in outcomes))
    assert len(outcomes) == len(cases)
    validate = "Validate the policy, discover the uplink and list foreign firewall chains"
    assert outcomes[0]["msg"].startswith("cell_nat_egress_allow[0].cidr: '198.20.1.0/33' is not a valid IPv4 CIDR")
    assert outcomes[1]["msg"].startswith("cell_nat_uplink: 'eth9' is not an interface on this host")
    assert outcomes[2]["msg"].startswith("cell_nat_egress_allow[0]: 198.20.0.0/16 overlaps cell_nat_egress_deny[0]")
    assert outcomes[3]["task"].startswith("Validating arguments against arg spec 'main'")   # at role start
    assert any("cell_nat_ratelimit" in e for e in outcomes[3]["errors"]), outcomes[3]
    assert outcomes[4]["msg"].startswith("cell_nat_slots[0].host_ifname: 'chvh0-far-too-long'")
    for i in (0, 1, 2, 4):
        assert outcomes[i]["task"] == validate
    # Nothing but the report file changed.
    assert proc.stdout.count("changed: [localhost]") == 1 and "changed=1 " in proc.stdout
    before = proc.stdout.split("changed: [localhost]")[0]
    assert before.rsplit("TASK [", 1)[1].startswith("Report]")
    assert not (tmp_path / "etc").exists() and not (tmp_path / "sysctl.conf").exists()


def test_bad_names_and_modes_fail_before_any_change(lab, tmp_path):
    """Egress by name: each layer of cell_nat_egress_names is checked on its own, naming the layer's
    variable, the entry and the value; the mode by the argument spec; a good list passes (control)."""
    base = {"cell_nat_slots": lab.slots, "cell_nat_config_dir": str(tmp_path / "etc"),
            "cell_nat_sysctl_file": str(tmp_path / "sysctl.conf"), "cell_nat_egress_mode": "proxy",
            "cell_nat_dns_resolvers": ["198.20.0.1"], "cell_nat_slot_groups": {"second": ["slot1"]}}
    cases = [
        dict(base, cell_nat_egress_names_default=["pypi.org", "203.0.113.7"]),
        dict(base, cell_nat_egress_names_host=[{"name": "https://pypi.org/simple"}]),
        dict(base, cell_nat_egress_names_group=[{"name": "ghcr.io", "slot_group": "builders"}]),
        dict(base, cell_nat_egress_mode="squid"),
        dict(base, cell_nat_slot_groups={"second": ["slot7"]}),
        dict(base, cell_nat_proxy_log_dir="/srv/proxy-logs"),
        # control: a good list passes the checks; cell_nat_strict beside a foreign drop chain stops it next
        dict(base, cell_nat_egress_names=["pypi.org", {"name": "*.pythonhosted.org"},
                                          {"name": "ghcr.io", "slot_group": "second", "port": 443}],
             cell_nat_strict=True),
    ]
    text = CASES.format(tmp=tmp_path, cases="".join(CASE.format(n=i, vars=json.dumps(c)) for i, c in enumerate(cases)))
    lab.nft("add table ip te_foreign; add chain ip te_foreign FORWARD "
            "{ type filter hook forward priority 0; policy drop; }")
    try:
        proc = playbook(lab, tmp_path, text, "--check")
    finally:
        run("nft", "delete", "table", "ip", "te_foreign", ns=lab.guest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())
    print("\n".join("%s: %s" % (o["task"], o["msg"]) for o in outcomes))
    assert len(outcomes) == len(cases)
    validate = "Validate the policy, discover the uplink and list foreign firewall chains"
    assert outcomes[0]["msg"] == ("cell_nat_egress_names_default[1]: '203.0.113.7' is an IP address, not a name: "
                                  "addresses go in cell_nat_egress_allow (a CIDR), names here")
    assert outcomes[1]["msg"].startswith("cell_nat_egress_names_host[0].name: 'https://pypi.org/simple' is not a "
                                         "host name")
    assert outcomes[2]["msg"].startswith("cell_nat_egress_names_group[0].slot_group: 'builders' is not a group of "
                                         "cell_nat_slot_groups (has: second)")
    assert outcomes[3]["task"].startswith("Validating arguments against arg spec 'main'")
    assert any("cell_nat_egress_mode" in e for e in outcomes[3]["errors"]), outcomes[3]
    assert outcomes[4]["msg"].startswith("cell_nat_slot_groups.second: slot7 is no slot of this host")
    for i in (0, 1, 2, 4):
        assert outcomes[i]["task"] == validate
    assert outcomes[5]["task"] == "Check the egress proxy's log directory"
    assert outcomes[5]["msg"].startswith('cell_nat_proxy_log_dir: "/srv/proxy-logs" must be a directory under /var/log')
    assert outcomes[6]["task"] == "Refuse to continue beside firewall chains that may drop cell traffic (cell_nat_strict)"
    assert not (tmp_path / "etc").exists() and not (tmp_path / "sysctl.conf").exists()


RESOLVERS = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Gather the facts the checks read
      ansible.builtin.setup:
        gather_subset: [min]
    - name: The role's checks (they read the guest's resolvers)
      ansible.builtin.include_role:
        name: chv.fleet.cell_nat
        tasks_from: checks
        public: true  # the role's variables (__cell_nat_dns_resolvers) for the next task
      vars:
        cell_nat_slots: {slots}
    - name: Keep what they found
      ansible.builtin.copy:
        content: "{{{{ {{'resolvers': __cell_nat_dns_resolvers, 'ruleset': __cell_nat_info.ruleset.dns_resolvers,
                       'second_read': __cell_nat_resolved_read is not skipped}} | to_json }}}}"
        dest: {tmp}/resolvers.json
        mode: "0600"
"""


@pytest.mark.parametrize("etc,found,second", [
    # a systemd-resolved stub: the upstream list is read as well, and is what cells get (the launcher's rule)
    ("nameserver 127.0.0.53\noptions edns0\n", ["198.20.9.7"], True),
    # control: a usable resolver in /etc/resolv.conf: that one, and the upstream file is not read at all
    ("nameserver 198.20.9.6 # the guest's own\n", ["198.20.9.6"], False),
])
def test_the_resolvers_cells_get_are_read_as_the_launcher_reads_them(lab, tmp_path, etc, found, second):
    """The role's checks read /etc/resolv.conf, and systemd-resolved's
    upstream list only when it names no resolver a cell can use (one module
    run instead of two on most guests); the ruleset's DNS resolvers are the
    launcher's choice either way. Both files are this test's own, bound over
    the machine's in a mount namespace of the playbook's (unshare)."""
    (tmp_path / "etc.conf").write_text(etc)
    (tmp_path / "upstream.conf").write_text("nameserver 198.20.9.7\n")
    text = RESOLVERS.format(slots=json.dumps(lab.slots), tmp=tmp_path)
    binds = ("mkdir -p /run/systemd/resolve && touch /run/systemd/resolve/resolv.conf && "
             "mount --bind {t}/etc.conf /etc/resolv.conf && mount --bind {t}/upstream.conf "
             "/run/systemd/resolve/resolv.conf && exec \"$@\"").format(t=tmp_path)
    proc = playbook(lab, tmp_path, text, wrap=["unshare", "--mount", "--propagation", "private", "sh", "-c", binds,
                                               "sh"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads((tmp_path / "resolvers.json").read_text())
    assert got == {"resolvers": found, "ruleset": found, "second_read": second}, got
