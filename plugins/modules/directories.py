#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: directories
short_description: Several directories with their mode, owner and group in one module run
description:
  - Makes each entry of O(paths) a directory with the entry's mode, owner and group, as
    M(ansible.builtin.file) with O(ansible.builtin.file#module:state=directory) does for one path, and
    reports which paths it changed. A role's directories cost one module run on the host instead of
    one per directory, which is most of the time of a run that changes nothing.
  - Missing parents are made 0755 and root's, as the file module makes them; list a parent before its
    children to give it other settings.
  - Every entry is checked before anything changes; a path that exists and is not a directory, an
    owner or group the host does not have, a bad mode or a path listed twice with different settings
    fails the task with the entry named, and nothing is changed.
  - In check mode an owner or group that does not exist yet (an earlier task of the same run would
    create it) is not an error; the path is reported as changed.
  - Linux only; SELinux contexts and ACLs are left as they are.
version_added: 0.1.0
extends_documentation_fragment: chv.fleet.owned_entries
options:
  paths:
    description: The directories, in the order they are made.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute, normalized path.
        type: str
        required: true
      mode:
        description: Octal mode as a string (V("0755"), V("02750")).
        type: str
        required: true
      owner: {description: "User name or number; O(owner) when not set.", type: str}
      group: {description: "Group name or number; O(group) when not set.", type: str}
attributes:
  check_mode:
    description:
      - Reports the paths it would create or change, changing nothing.
  diff_mode:
    description:
      - One line per changed path before and after (C(absent), or mode, uid and gid).
"""

EXAMPLES = r"""
- name: Create the role's directories
  chv.fleet.directories:
    paths:
      - {path: /etc/chv, mode: "0700"}
      - {path: /var/lib/chv-fleet/workspaces/slot0, mode: "02750", owner: "524288", group: chv}
"""

RETURN = r"""
changed_paths:
  description: The paths that were (or in check mode would be) created or changed, in order.
  returned: always
  type: list
  elements: str
  sample: [/etc/chv]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.chv.fleet.plugins.module_utils import directories
from ansible_collections.chv.fleet.plugins.module_utils.converge import entries_spec, plan_and_apply


def main():
    module = AnsibleModule(
        argument_spec=entries_spec("paths", dict(
            path=dict(type="str", required=True),
            mode=dict(type="str", required=True),
        )),
        supports_check_mode=True,
    )
    p = module.params
    plan_and_apply(
        module, "chv.fleet.directories", (directories.DirectoryError, OSError),
        plan=lambda: directories.plan(directories.wanted_entries(p["paths"], p["owner"], p["group"],
                                                                 allow_unknown=module.check_mode)),
        apply=directories.apply, diff=directories.diff, key="changed_paths", name_of=lambda change: change.path)


if __name__ == "__main__":
    main()
