#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: preflight
short_description: Check that a host can run chv.fleet cells, changing nothing
description:
  - Reads the host and checks what cells need before any role changes it, and fails naming every check
    that does not pass.
  - C(cgroup2), the unified cgroup hierarchy at C(/sys/fs/cgroup).
  - C(user namespaces), C(user.max_user_namespaces) above 0.
  - C(kernel modules), C(veth) and C(nf_tables). C(veth) works when a pair can be made in a network namespace
    of the probe's own (gone with it); otherwise, and for C(nf_tables), the module is loaded, built in, a module
    of the running kernel or set in its config. A kernel without module lists or config (some VMs) passes
    with a note; the health gate's real cell proves both after the roles.
  - C(iproute2), an C(ip) command.
  - C(memory), O(slots) cells at O(memory_max) each fit in the host's memory.
  - C(identities), with O(identity), the slots' identities as M(chv.fleet.cell_identity) would allocate them, in
    check mode (its ledger read, nothing written), fit on this host; for example a pool the host's routes
    leave too small, a shared UID range holding existing accounts, or a change of running cells' slots fails
    here, each message naming the role variable (O(var_prefix)).
  - site.yml runs it before the roles (docs/operations.md).
version_added: 0.1.0
author:
  - chv.fleet maintainers (@chv-fleet)
options:
  slots:
    description: The cell slots the host will have, a count or a list of slot names (as M(chv.fleet.cell_identity) takes them).
    type: raw
    required: true
  memory_max:
    description: Each cell's C(MemoryMax=) (systemd syntax; a percentage or C(infinity) sets no amount to check).
    type: str
    default: infinity
  identity:
    description:
      - The options of M(chv.fleet.cell_identity) the role passes, for the C(identities) check; without it
        that check is not made.
    type: dict
    suboptions:
      pool:
        description: The IPv4 pool of the slot subnets.
        type: str
        default: 10.200.0.0/16
      prefix:
        description: Prefix length of each slot subnet.
        type: int
        default: 24
      uid_mode:
        description: V(per_slot) or V(shared).
        type: str
        default: per_slot
      shared_uid:
        description: First host UID of the shared range; null means the uid of O(identity.agent_user).
        type: int
      agent_user:
        description: The user whose uid is the shared UID when O(identity.shared_uid) is null.
        type: str
        default: chv
      agent_uid:
        description: The shared UID when O(identity.shared_uid) is null and O(identity.agent_user) does not exist yet.
        type: int
        default: 1000
      ifname_prefix:
        description: Prefix of the slots' host-side interface names.
        type: str
        default: chvh
      cell_ifname:
        description: Interface name inside the cell.
        type: str
        default: eth0
      machine_prefix:
        description: Prefix of the nspawn machine names.
        type: str
        default: chv-
      ledger:
        description: The slot identity ledger (read, never written).
        type: path
        default: /var/lib/chv-fleet/identities.json
      reassign:
        description: Whether existing identities may change.
        type: bool
        default: false
      force:
        description: Whether slots with running cells may be released or changed.
        type: bool
        default: false
      state_dir:
        description: The launcher's runtime state (slot locks, cell records) the running-cell check reads.
        type: path
        default: /run/chv-fleet
  var_prefix:
    description: Prefix of the role variables that the C(identities) check's messages name (C(chv_cell_pool)).
    type: str
    default: chv_cell_
attributes:
  check_mode:
    support: full
    description:
      - It only reads the host; check mode runs the same checks.
  diff_mode:
    support: none
    description:
      - Nothing to show.
"""

EXAMPLES = r"""
- name: Check that the host can run cells
  chv.fleet.preflight:
    slots: 4
    memory_max: 4G

- name: Check that the host can run cells, and that the slots' identities fit on it
  chv.fleet.preflight:
    slots: [build, review]
    memory_max: 4G
    identity:
      pool: 10.200.0.0/16
      prefix: 24
"""

RETURN = r"""
checks:
  description: Every check, in order.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: The check.
      type: str
    ok:
      description: Whether it passed.
      type: bool
    detail:
      description: What was found.
      type: str
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.chv.fleet.plugins.module_utils import preflight


def main():
    module = AnsibleModule(
        argument_spec=dict(
            slots=dict(type="raw", required=True),
            memory_max=dict(type="str", default="infinity"),
            identity=dict(type="dict", options=dict(
                pool=dict(type="str", default="10.200.0.0/16"),
                prefix=dict(type="int", default=24),
                uid_mode=dict(type="str", default="per_slot"),
                shared_uid=dict(type="int"),
                agent_user=dict(type="str", default="chv"),
                agent_uid=dict(type="int", default=1000),
                ifname_prefix=dict(type="str", default="chvh"),
                cell_ifname=dict(type="str", default="eth0"),
                machine_prefix=dict(type="str", default="chv-"),
                ledger=dict(type="path", default="/var/lib/chv-fleet/identities.json"),
                reassign=dict(type="bool", default=False),
                force=dict(type="bool", default=False),
                state_dir=dict(type="path", default="/run/chv-fleet"),
            )),
            var_prefix=dict(type="str", default="chv_cell_"),
        ),
        supports_check_mode=True,
    )
    # veth, for real: a pair made in a network namespace of its own, which goes with the probe
    proven = []
    unshare, ip = module.get_bin_path("unshare"), module.get_bin_path("ip", opt_dirs=["/usr/sbin", "/sbin"])
    if unshare and ip:
        rc = module.run_command([unshare, "--net", "--", ip, "link", "add", "chvpf0", "type", "veth",
                                 "peer", "name", "chvpf1"])[0]
        if rc == 0:
            proven.append("veth")

    def run(argv):
        rc, out, err = module.run_command([ip] + list(argv[1:]))
        if rc != 0:
            raise OSError("%s failed (rc=%d): %s" % (" ".join(argv), rc, err.strip()))
        return out

    try:
        checks = preflight.run_checks("/", os.uname().release, module.params["slots"], module.params["memory_max"],
                                      proven, module.params["identity"], run if ip else None,
                                      module.params["var_prefix"])
    except ValueError as e:
        module.fail_json(msg=str(e))
    result = dict(changed=False, checks=[dict(name=n, ok=ok, detail=d) for n, ok, d in checks])
    failed = ["%s: %s" % (n, d) for n, ok, d in checks if not ok]
    if failed:
        module.fail_json(msg="this host cannot run chv.fleet cells: " + "; ".join(failed), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
