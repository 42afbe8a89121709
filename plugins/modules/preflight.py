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
  - site.yml runs it before the roles (docs/operations.md).
version_added: 0.1.0
author:
  - chv.fleet maintainers (@chv-fleet)
options:
  slots:
    description: The number of cell slots the host will have.
    type: int
    required: true
  memory_max:
    description: Each cell's C(MemoryMax=) (systemd syntax; a percentage or C(infinity) sets no amount to check).
    type: str
    default: infinity
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
            slots=dict(type="int", required=True),
            memory_max=dict(type="str", default="infinity"),
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
    try:
        checks = preflight.run_checks("/", os.uname().release, module.params["slots"], module.params["memory_max"],
                                      proven)
    except ValueError as e:
        module.fail_json(msg=str(e))
    result = dict(changed=False, checks=[dict(name=n, ok=ok, detail=d) for n, ok, d in checks])
    failed = ["%s: %s" % (n, d) for n, ok, d in checks if not ok]
    if failed:
        module.fail_json(msg="this host cannot run chv.fleet cells: " + "; ".join(failed), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
