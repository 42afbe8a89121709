#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: cell_nat_info
short_description: Validate the cell NAT policy, discover the uplink and report conflicting firewalls
version_added: 0.1.0
description:
  - Read-only companion of the P(chv.fleet.cell_nat#role) role's ruleset template.
  - Validates the slot list and the egress policy and fails, naming the variable, on an invalid
    CIDR, an overlapping allow/deny entry or an uplink that is not an interface of the host.
  - Discovers the uplink from the IPv4 default route (C(ip -j route show default)) unless O(uplink) is given.
  - Takes the slots from O(slots) or, when that list is empty, from the slot identity ledger
    written by M(chv.fleet.cell_identity).
  - Lists foreign nftables base chains on the forward and input hooks (tables other than
    C(inet chv_cell)) whose policy is drop or which contain drop or reject rules, and returns one
    warning per chain. Such chains see cell traffic too and may drop it, whatever C(inet chv_cell) accepts.
  - Returns the data the role's C(cell-nat.nft.j2) template renders.
author:
  - chv.fleet maintainers (@chv-fleet)
attributes:
  check_mode:
    support: full
    description: The module never changes the host; it runs the same in check mode.
  diff_mode:
    support: none
    description: Nothing is changed, so there is nothing to diff.
  platform:
    support: full
    platforms: posix
    description: Needs Linux (C(ip -j route), C(/sys/class/net)) and, for the coexistence check, C(nft).
options:
  slots:
    description:
      - Slot identity records (see docs/architecture.md); only C(name), C(host_ifname), C(subnet),
        C(gateway), C(uid_base) and C(uid_size) are used.
      - The slots' UID ranges form the set C(door_uids) (sync workers run as their slot's range); traffic
        of those socket owners from the guest itself gets the cells' egress policy.
      - When empty, the slots are read from O(ledger_path).
    type: list
    elements: dict
    default: []
  ledger_path:
    description:
      - The cell_identity ledger, read when O(slots) is empty. A missing file means no slots.
    type: path
    default: /var/lib/chv-fleet/identities.json
  uplink:
    description:
      - Interface cells egress through. Empty means the device of the IPv4 default route with the lowest metric.
    type: str
    default: ''
  egress_allow:
    description:
      - Allow list. When not empty, cells reach only these destinations (allow-list mode).
      - Each entry has C(cidr) (IPv4 network or address), optionally C(proto) (tcp, udp or any) and
        C(ports) (list of ports or C(low-high) ranges; without C(proto) both tcp and udp), and C(comment).
    type: list
    elements: raw
    default: []
  egress_deny:
    description:
      - Deny list, same entry format as O(egress_allow); it always wins.
      - A deny entry may overlap an allow entry only as a strict subset of it (a carve-out).
    type: list
    elements: raw
    default: []
  dns_resolvers:
    description:
      - IPv4 addresses of the resolvers cells are given. DNS (tcp/udp 53) to them is accepted, on the
        guest (input hook) and beyond the uplink (also in allow-list mode).
    type: list
    elements: str
    default: []
  dns_via_gateway:
    description:
      - Accept DNS from each cell to its own slot's gateway address (a resolver listening on the guest).
    type: bool
    default: false
  ratelimit:
    description:
      - New connections per second to one destination address, over all cells; 0 disables the meter.
    type: int
    default: 0
  ratelimit_burst:
    description:
      - Burst (packets) of the per-destination meter.
    type: int
    default: 10
  ifname_prefix:
    description:
      - Prefix of the slots' host-side interface names. Forwarded and input traffic of an interface
        that carries it but is no current slot (a cell whose slot was released while it ran) is dropped.
      - Every slot's interface must start with it.
    type: str
    default: chvh
  door_dir:
    description:
      - Directory whose C(*.nft) files the ruleset includes after the table, for other roles to add
        socket owner UIDs to the set C(door_uids) (chv.fleet.browser adds chv-browser's); empty means no include.
    type: path
    default: ''
  var_prefix:
    description:
      - Prefix put in front of option names in error messages, so that they name the caller's
        variables (the role passes C(cell_nat_)).
    type: str
    default: ''
  ruleset_file:
    description: The ruleset file chv-cell-nat.service loads (see RV(ruleset_applied)).
    type: path
  applied_digests:
    description:
      - Where chv-cell-nat.service writes the sha256sum lines of the files it last loaded, O(ruleset_file)
        and the C(*.nft) drop-ins of O(door_dir) (see RV(ruleset_applied)).
    type: path
  egress_mode:
    description:
      - C(cidr), the IP policy of O(egress_allow) and O(egress_deny) for the cells' own packets; or C(proxy),
        in which the ruleset drops every packet a cell sends past the guest (DNS included) and admits only its
        connections to the egress proxy on its own gateway, port O(proxy_port); RV(proxy) is then squid's data.
    type: str
    choices: [cidr, proxy]
    default: cidr
  egress_names:
    description:
      - The names the proxy lets cells reach, by layer; keys C(_default), C(""), C(_group), C(_host) (the suffixes
        of the role's C(cell_nat_egress_names) variables), each a list of names or of mappings with C(name)
        (C(host.example.com), or C(*.example.com) for any name under example.com), C(port) (443),
        C(slot_group) (a key of O(slot_groups)) and C(comment). Checked in both modes; errors name the layer's
        variable, the entry's index and the value.
    type: dict
    default: {}
  slot_groups:
    description:
      - "Named sets of slots (C({builders: [slot0, slot1]})) an entry of O(egress_names) may be limited to."
    type: dict
    default: {}
  proxy_port:
    description: The port the egress proxy listens on (on every address; the ruleset admits only cells to it).
    type: int
    default: 3128
notes:
  - Uses C(ip) from iproute2 and, when installed, C(nft). Without C(nft) (fresh host in check
    mode) no conflicts can be listed and a warning says so.
seealso:
  - name: docs/network.md
    description: The ruleset, its counters, coexistence reports and the uplink.
    link: https://github.com/chv-fleet/chv.fleet/blob/main/docs/network.md
"""

EXAMPLES = r"""
- name: Validate the policy and discover the uplink
  chv.fleet.cell_nat_info:
    slots: "{{ chv_cell_identities }}"
    egress_allow:
      - cidr: 203.0.113.0/24
        proto: tcp
        ports: [443]
    egress_deny:
      - cidr: 203.0.113.9/32
    var_prefix: cell_nat_
  register: nat

- name: Fail when another firewall may drop cell traffic
  ansible.builtin.fail:
    msg: "{{ nat.conflict_messages }}"
  when: nat.conflicts | length > 0
"""

RETURN = r"""
uplink:
  description: The interface cells are masqueraded out of.
  returned: success
  type: str
  sample: eth0
uplink_source:
  description: C(override) when O(uplink) was given, C(default_route) when discovered.
  returned: success
  type: str
  sample: default_route
slots_source:
  description: Where the slots came from, C(variable), C(ledger) or C(none).
  returned: success
  type: str
  sample: variable
conflicts:
  description: Foreign base chains on the forward/input hooks that may drop cell traffic.
  returned: success
  type: list
  elements: dict
  sample:
    - family: ip
      table: filter
      chain: FORWARD
      hook: forward
      priority: 0
      policy: drop
      reasons: [policy drop]
conflict_messages:
  description: One human-readable line per conflict (also returned as warnings).
  returned: success
  type: list
  elements: str
table_loaded:
  description: Whether the kernel has table inet chv_cell (false when nft is not installed).
  returned: success
  type: bool
  sample: true
ruleset_applied:
  description:
    - Whether the table is loaded and O(ruleset_file) and the drop-ins of O(door_dir) are the files
      chv-cell-nat.service last loaded (O(applied_digests)). False when a run was interrupted after
      writing one of them and before loading it (the reload it would have notified was lost with
      it). True when O(ruleset_file) or O(applied_digests) is not given.
  returned: success
  type: bool
  sample: true
ip_forward:
  description: The host's net.ipv4.ip_forward now (C(/proc/sys/net/ipv4/ip_forward)), empty when unreadable.
  returned: success
  type: str
  sample: "1"
nft_available:
  description: Whether C(nft) was found (conflicts are only checked when it is).
  returned: success
  type: bool
ruleset:
  description: Data rendered by the role's C(cell-nat.nft.j2) template.
  returned: success
  type: dict
  contains:
    family:
      description: Table family.
      type: str
      sample: inet
    table:
      description: Table name.
      type: str
      sample: chv_cell
    uplink:
      description: Uplink interface.
      type: str
    slots:
      description: Normalized slots with their per-slot counter names.
      type: list
      elements: dict
    allow_mode:
      description: Whether the allow list is active.
      type: bool
    egress_mode:
      description: O(egress_mode).
      type: str
proxy:
  description: Data rendered by the role's C(egress-proxy.conf.j2) template (squid's configuration); null in cidr mode.
  returned: success
  type: dict
"""

import glob
import hashlib
import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.chv.fleet.plugins.module_utils.cell_nat import (
    CellNatError,
    conflict_message,
    detect_conflicts,
    table_loaded,
    slots_from_ledger,
)
from ansible_collections.chv.fleet.plugins.module_utils.egress_names import plan


def _interfaces():
    try:
        return set(os.listdir("/sys/class/net"))
    except OSError:
        return None


def _ip_forward():
    try:
        with open("/proc/sys/net/ipv4/ip_forward") as handle:
            return handle.read().strip()
    except (OSError, IOError):
        return ""


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(65536), b""):
            digest.update(block)
    return digest.hexdigest()


def ruleset_applied(ruleset_file, door_dir, digests_path):
    """Whether the files nft loads (the ruleset and the door drop-ins it
    includes) are those chv-cell-nat.service last loaded: it writes their
    sha256sum lines to digests_path when it has loaded them. Without the
    two paths, true."""
    if not ruleset_file or not digests_path:
        return True
    try:
        with open(digests_path, "r") as handle:
            loaded = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in handle if "  " in line)
        paths = [ruleset_file] + (sorted(glob.glob(os.path.join(door_dir, "*.nft"))) if door_dir else [])
        return loaded == dict((path, _sha256(path)) for path in paths)
    except (OSError, IOError, ValueError):
        return False


def main():
    module = AnsibleModule(
        argument_spec=dict(
            slots=dict(type="list", elements="dict", default=[]),
            ledger_path=dict(type="path", default="/var/lib/chv-fleet/identities.json"),
            uplink=dict(type="str", default=""),
            egress_allow=dict(type="list", elements="raw", default=[]),
            egress_deny=dict(type="list", elements="raw", default=[]),
            dns_resolvers=dict(type="list", elements="str", default=[]),
            dns_via_gateway=dict(type="bool", default=False),
            ratelimit=dict(type="int", default=0),
            ratelimit_burst=dict(type="int", default=10),
            ifname_prefix=dict(type="str", default="chvh"),
            door_dir=dict(type="path", default=""),
            var_prefix=dict(type="str", default=""),
            ruleset_file=dict(type="path"),
            applied_digests=dict(type="path"),
            egress_mode=dict(type="str", default="cidr", choices=["cidr", "proxy"]),
            egress_names=dict(type="dict", default={}),
            slot_groups=dict(type="dict", default={}),
            proxy_port=dict(type="int", default=3128),
        ),
        supports_check_mode=True,
    )
    p = module.params
    prefix = p["var_prefix"]

    slots, slots_source = p["slots"], "variable"
    if not slots:
        slots_source = "none"
        if os.path.exists(p["ledger_path"]):
            try:
                with open(p["ledger_path"], "r") as handle:
                    slots = slots_from_ledger(handle.read(), p["ledger_path"])
            except (OSError, IOError, CellNatError) as exc:
                module.fail_json(msg="%sledger_path: cannot read slots from %s: %s" % (prefix, p["ledger_path"], exc))
            slots_source = "ledger"

    route_json = None
    if not p["uplink"]:
        rc, out, err = module.run_command(["ip", "-j", "-4", "route", "show", "default"])
        if rc != 0:
            module.fail_json(msg="cannot read the default route: ip -j route show default: %s" % err.strip())
        route_json = out

    try:
        data, proxy = plan(dict(p, slots=slots), _interfaces(), route_json, prefix)
    except CellNatError as exc:
        module.fail_json(msg=str(exc))
    except ValueError as exc:
        module.fail_json(msg="cannot parse ip -j route output: %s" % exc)

    if data["egress_mode"] == "cidr" and any(p["egress_names"].values()):
        module.warn("%segress_names lists names but %segress_mode is cidr: names are enforced only by the "
                    "egress proxy (%segress_mode: proxy)" % (prefix, prefix, prefix))
    if data["allow_mode"] and not data["dns_resolvers"] and not data["dns_via_gateway"]:
        module.warn("%segress_allow is set but no DNS resolver is listed (%sdns_resolvers) and "
                    "%sdns_via_gateway is off: cells can resolve names only through an allow entry "
                    "that covers their resolvers" % (prefix, prefix, prefix))

    conflicts, messages, loaded = [], [], False
    nft = module.get_bin_path("nft")
    if nft:
        rc, out, err = module.run_command([nft, "-j", "list", "ruleset"])
        if rc != 0:
            module.fail_json(msg="nft -j list ruleset failed: %s" % err.strip())
        try:
            listed = json.loads(out) if out.strip() else {"nftables": []}
            conflicts, loaded = detect_conflicts(listed), table_loaded(listed)
        except ValueError as exc:
            module.fail_json(msg="cannot parse nft -j list ruleset: %s" % exc)
        messages = [conflict_message(c) for c in conflicts]
        for message in messages:
            module.warn(message)
    else:
        module.warn("nft is not installed yet: foreign firewall chains were not checked")

    module.exit_json(
        changed=False,
        uplink=data["uplink"],
        uplink_source=data["uplink_source"],
        slots_source=slots_source,
        conflicts=conflicts,
        conflict_messages=messages,
        nft_available=bool(nft),
        table_loaded=loaded,
        ruleset_applied=loaded and ruleset_applied(p["ruleset_file"], p["door_dir"], p["applied_digests"]),
        ip_forward=_ip_forward(),
        ruleset=data,
        proxy=proxy,
    )


if __name__ == "__main__":
    main()
