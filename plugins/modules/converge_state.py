#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: converge_state
short_description: Whether the last converge of chv.fleet still holds on a host, in one module run
description:
  - The fast path of C(site.yml) (docs/operations.md, "A run that changes nothing"). With O(state=verify) it
    reads the stamp the last converge wrote and compares it with the host and the run; the digest of the run's
    inputs (O(digest), from the filter P(chv.fleet.converge_digest#filter)) and, for everything O(want) names,
    what is on the host now. RV(fresh) is true only when the digest is the same and nothing differs; a file
    changed, added or removed under the owned paths (type, mode, owner, inode, size, change time), a unit
    enabled, disabled, started or stopped, an account, nftables table, sysctl value or package that is not as
    it was, or a rollout's cordon left on the host, each makes it false.
  - With O(state=record) it writes the stamp after a converge whose health gate passed (O(gate_summary)). The
    stamp is bookkeeping, like a cache; writing it is not reported as a change.
  - Reads only, except the stamp. Linux with systemd and dpkg.
version_added: 0.4.0
options:
  state:
    description: V(verify) compares; V(record) writes the stamp.
    type: str
    choices: [verify, record]
    default: verify
  path:
    description: The stamp's path.
    type: path
    default: /var/lib/chv-fleet/converged.json
  digest:
    description: The digest of the run's inputs.
    type: str
    required: true
  want:
    description: What the roles own, from their C(owned) declarations.
    type: dict
    required: true
    suboptions:
      paths: {description: "Paths recorded with everything under them.", type: list, elements: path, default: []}
      tops: {description: "Paths recorded alone (directories whose contents are the host's).", type: list,
             elements: path, default: []}
      runtime: {description: "Paths a role's service rewrites as it runs, recorded alone by type, mode, owner and
                link target (not inode, size or change time).", type: list, elements: path, default: []}
      units: {description: "systemd units: enablement, and activity (not of socket- or timer-started services).",
              type: list, elements: str, default: []}
      users: {description: "Accounts, with their ids.", type: list, elements: str, default: []}
      groups: {description: "Groups, with their ids.", type: list, elements: str, default: []}
      nft_tables: {description: "nftables tables (V(inet chv_cell)) that must be loaded.", type: list,
                   elements: str, default: []}
      sysctls: {description: "sysctl keys (V(net.ipv4.ip_forward)) whose values must hold.", type: list,
                elements: str, default: []}
      packages: {description: "Packages that must be installed (dpkg).", type: list, elements: str, default: []}
  cordon:
    description:
      - The host's cordon marker (C(chv-cell cordon)); a rollout's cordon there (a run that stopped before its gate)
        makes the stamp not hold, so that the full run's gate lifts it.
    type: path
    default: /run/chv-fleet/cordon
  gate_summary:
    description: With O(state=record), the passed health gate's summary.
    type: str
    default: ""
attributes:
  check_mode:
    support: full
    description:
      - V(verify) runs as always; V(record) writes nothing.
  diff_mode:
    support: none
    description: Nothing to show.
author:
  - chv.fleet maintainers (@chv-fleet)
"""

EXAMPLES = r"""
- name: Read what the last converge left
  chv.fleet.converge_state:
    digest: "{{ {'vars': {'chv_cell_slots': 4}} | chv.fleet.converge_digest(playbook_dir ~ '/..') }}"
    want:
      paths: [/etc/chv]
      units: [chv-cell-nat.service]
  register: converged
"""

RETURN = r"""
fresh:
  description: With O(state=verify), whether the stamp holds (the roles have nothing to do).
  returned: always
  type: bool
reasons:
  description: Why it does not hold, one line each (at most 10, then how many more).
  returned: always
  type: list
  elements: str
  sample: ["/etc/chv/cell-policy.json: ino, ctime_ns changed"]
gate_age:
  description: Seconds since the health gate the stamp records passed; null without a stamp.
  returned: always
  type: float
"""

import grp
import os
import pwd
import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.chv.fleet.plugins.module_utils import converge_state


def readers(module):
    def units(names):
        rc, out, err = module.run_command(["systemctl", "show", "--property=Id,UnitFileState,ActiveState", "--"]
                                          + list(names))
        if rc != 0:
            module.fail_json(msg="systemctl show failed: %s" % err.strip())
        return converge_state.parse_units(out)

    def packages():
        try:
            with open("/var/lib/dpkg/status") as fh:
                return converge_state.parse_dpkg_status(fh.read())
        except (IOError, OSError):
            return set()

    def nft_tables():
        rc, out, err = module.run_command(["nft", "list", "tables"])
        return converge_state.parse_nft_tables(out) if rc == 0 else set()

    def user(name):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            return None
        return [pw.pw_uid, pw.pw_gid, pw.pw_dir, pw.pw_shell]

    def group(name):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            return None

    def sysctl(key):
        try:
            with open(os.path.join("/proc/sys", *key.split("."))) as fh:
                return fh.read().strip()
        except (IOError, OSError):
            return None

    return {"units": units, "packages": packages, "nft_tables": nft_tables, "user": user, "group": group,
            "sysctl": sysctl, "lstat": os.lstat, "readlink": os.readlink, "listdir": os.listdir}


def main():
    listed = dict(type="list", elements="str", default=[])
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["verify", "record"], default="verify"),
            path=dict(type="path", default="/var/lib/chv-fleet/converged.json"),
            digest=dict(type="str", required=True),
            cordon=dict(type="path", default="/run/chv-fleet/cordon"),
            want=dict(type="dict", required=True, options=dict(
                paths=dict(listed, elements="path"), tops=dict(listed, elements="path"),
                runtime=dict(listed, elements="path"), units=listed,
                users=listed, groups=listed, nft_tables=listed, sysctls=listed, packages=listed)),
            gate_summary=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    read = readers(module)
    now = time.time()
    if p["state"] == "record":
        if not module.check_mode:
            try:
                converge_state.save(p["path"], converge_state.stamp(p["want"], p["digest"], p["gate_summary"], now,
                                                                    read))
            except (IOError, OSError) as e:
                module.fail_json(msg="chv.fleet.converge_state: cannot write %s: %s" % (p["path"], e))
        module.exit_json(changed=False, fresh=True, reasons=[], gate_age=0.0)
    try:
        with open(p["cordon"]) as fh:
            cordon = fh.read()
    except (IOError, OSError):
        cordon = None
    verdict = converge_state.verify(converge_state.load(p["path"]), p["want"], p["digest"], now, read, cordon)
    module.exit_json(changed=False, **verdict)


if __name__ == "__main__":
    main()
