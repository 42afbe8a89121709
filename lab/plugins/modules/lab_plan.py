#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: lab_plan
short_description: Validate a lab's parameters and plan its guests
version_added: 0.1.0
description:
  - Checks the parameters of a local test lab (names, count, distribution,
    address range) and returns the guests' names and /30 links.
  - Fails, naming the bad value, when a name is not a valid hostname or is too
    long for the host-side veth name, the count is out of range, the
    distribution is unknown, or the address range overlaps a route of the
    lab host that does not belong to this lab's own guests.
  - Changes nothing; the first step of C(chv.fleet_lab.lab_up).
extends_documentation_fragment: [ansible.builtin.action_common_attributes, chv.fleet_lab.lab]
options:
  lab_name:
    description: Name of the lab; generated guest names are C(<lab_name><n>).
    type: str
    required: true
  count:
    description: Number of guests (1-64), unless I(guests) names them.
    type: raw
    default: 1
  guests:
    description:
      - Explicit guests, each a name or a dict with C(name) and optionally its
        own C(distro) (the lab's I(distro) otherwise) and C(ifname), the
        guest-side name of its interface (C(host0) otherwise).
    type: list
    elements: raw
    default: []
  distro:
    description: Debian release of the guests whose entry names none.
    type: str
    required: true
  network:
    description: IPv4 range the guests' /30 links are cut from.
    type: str
    required: true
  lab_dir:
    description:
      - Directory of the lab; veths of guests found there count as the lab's
        own when routes are checked (a running lab does not clash with itself).
    type: path
  check_routes:
    description: Whether to check I(network) against the lab host's routes.
    type: bool
    default: true
  resolver_names:
    description:
      - The names the lab's resolver stand-in answers (DNS name to IPv4 address); fails naming a bad
        name or address.
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Plan a two-guest lab
  chv.fleet_lab.lab_plan:
    lab_name: demo
    count: 2
    distro: bookworm
    network: 10.99.0.0/24
  register: plan
"""

RETURN = r"""
guests:
  description: One entry per guest.
  returned: always
  type: list
  elements: dict
  sample:
    - name: demo1
      distro: bookworm
      ifname: host0
      link: 10.99.0.0/30
      host_ifname: ve-demo1
      host_address: 10.99.0.1
      address: 10.99.0.2
      prefixlen: 30
network:
  description: The normalized address range.
  returned: always
  type: str
distros:
  description: The distinct Debian releases of the guests (one image each).
  returned: always
  type: list
  elements: str
resolver_names:
  description: The resolver stand-in's names, checked and sorted.
  returned: always
  type: dict
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.chv.fleet_lab.plugins.module_utils import lab


def main():
    module = AnsibleModule(
        argument_spec=dict(
            lab_name=dict(type="str", required=True),
            count=dict(type="raw", default=1),
            guests=dict(type="list", elements="raw", default=[]),
            distro=dict(type="str", required=True),
            network=dict(type="str", required=True),
            lab_dir=dict(type="path"),
            check_routes=dict(type="bool", default=True),
            resolver_names=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    p = module.params
    count = p["count"]
    if isinstance(count, str) and count.strip().isdigit():
        count = int(count)
    try:
        result = lab.plan(p["lab_name"], p["distro"], p["network"], count=count, names=p["guests"],
                          resolver=p["resolver_names"])
    except lab.LabError as exc:
        module.fail_json(msg=str(exc))
    if not p["check_routes"]:
        module.exit_json(changed=False, **result)
    rc, out, err = module.run_command(["ip", "-j", "route", "show", "table", "all"])
    if rc != 0:
        module.fail_json(msg="cannot list the lab host's routes: %s" % err)
    own = set(g["host_ifname"] for g in result["guests"])
    if p["lab_dir"] and os.path.isdir(p["lab_dir"]):
        own.update("ve-" + d for d in os.listdir(p["lab_dir"]) if os.path.isdir(os.path.join(p["lab_dir"], d)))
    clash = lab.overlapping_routes(result["network"], json.loads(out or "[]"), own)
    if clash:
        module.fail_json(msg="lab_network %s overlaps routes of the lab host: %s"
                         % (result["network"], "; ".join(clash)))
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
