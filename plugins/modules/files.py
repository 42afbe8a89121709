#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: files
short_description: Several files, symlinks and removals in one module run
description:
  - Makes each entry of O(files) true and reports which destinations it changed. An entry is a file
    with the given content, mode, owner and group (as M(ansible.builtin.copy) with
    O(ansible.builtin.copy#module:content) does), a symlink (as M(ansible.builtin.file) with
    O(ansible.builtin.file#module:state=link)), or a path that must be absent.
  - A role's files cost one module run on the host instead of two per file (a copy or template task
    runs a stat, then the file module for the attributes, even when nothing changes). Templates are
    rendered on the controller with the P(ansible.builtin.template#lookup) lookup and passed as
    O(files[].content).
  - Every entry is checked before anything changes. New contents are written to temporary files beside
    their destinations, given their owner and mode, and checked by the entry's O(files[].validate)
    command; only when every check passed are they renamed into place, one rename each. A failed check
    leaves every destination as it was and names the entry.
  - A destination that is a directory, a link destination that is a file, a file destination that is not
    a regular file, or a missing directory fails the task with the entry named. In check mode a missing
    directory, owner or group is not an error (an earlier task of the same run makes it); the entry is
    reported as changed.
  - Linux only; SELinux contexts and ACLs are left as they are. Content is text (UTF-8); secrets belong
    in a task of their own with C(no_log).
version_added: 0.1.0
extends_documentation_fragment: chv.fleet.owned_entries
options:
  files:
    description: The entries, in the order they are applied.
    type: list
    elements: dict
    required: true
    suboptions:
      dest:
        description: Absolute, normalized path of the file, link or path to remove.
        type: str
        required: true
      state:
        description: V(file) for content, V(link) for a symlink, V(absent) for a path to remove.
        type: str
        choices: [file, link, absent]
        default: file
      content:
        description: The file's content. Required with O(files[].state=file).
        type: str
      src:
        description: The path the link points to. Required with O(files[].state=link).
        type: str
      mode:
        description: Octal mode as a string (V("0644")). Required with O(files[].state=file).
        type: str
      owner: {description: "User name or number; O(owner) when not set.", type: str}
      group: {description: "Group name or number; O(group) when not set.", type: str}
      validate:
        description:
          - A command that checks the new content before it replaces the destination; V(%s) is the
            temporary file's path. Split into words as a shell would, not run by a shell.
        type: str
      force:
        description: V(false) leaves an existing file as it is (content, mode and owner).
        type: bool
        default: true
attributes:
  check_mode:
    description:
      - Reports the destinations it would create, change or remove, changing nothing; validate
        commands are not run.
  diff_mode:
    description:
      - One diff per changed destination, content before and after (a link's target; mode, uid and
        gid when only those change).
"""

EXAMPLES = r"""
- name: Install the role's configuration and units
  chv.fleet.files:
    files:
      - dest: /etc/chv/broker.json
        content: "{{ lookup('ansible.builtin.template', 'broker.json.j2') }}"
        mode: "0644"
        validate: /usr/bin/python3 -c "import json, sys; json.load(open(sys.argv[1]))" %s
      - {dest: /usr/local/bin/chv-cell, state: link, src: /usr/local/lib/chv-cell/chv-cell}
      - {dest: /etc/sudoers.d/chv-cell, state: absent}
"""

RETURN = r"""
changed_files:
  description: The destinations that were (or in check mode would be) created, changed or removed, in order.
  returned: always
  type: list
  elements: str
  sample: [/etc/chv/broker.json]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.chv.fleet.plugins.module_utils import files
from ansible_collections.chv.fleet.plugins.module_utils.converge import entries_spec, plan_and_apply


def main():
    module = AnsibleModule(
        argument_spec=entries_spec("files", dict(
            dest=dict(type="str", required=True),
            state=dict(type="str", default="file", choices=list(files.STATES)),
            content=dict(type="str"),
            src=dict(type="str"),
            mode=dict(type="str"),
            validate=dict(type="str"),
            force=dict(type="bool", default=True),
        )),
        supports_check_mode=True,
    )
    p = module.params
    plan_and_apply(
        module, "chv.fleet.files", (files.FilesError, OSError),
        plan=lambda: files.plan(files.wanted_entries(p["files"], p["owner"], p["group"], allow_unknown=module.check_mode),
                                check_mode=module.check_mode),
        apply=lambda changes: files.apply(changes, run=module.run_command),
        diff=files.diff, key="changed_files", name_of=lambda change: change.dest)


if __name__ == "__main__":
    main()
