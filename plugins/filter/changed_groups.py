# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which groups of a role's chv.fleet.files entries a check-mode run found
different from the host.

The broker and browser roles compare all their files in one check-mode run
of chv.fleet.files, then write only the groups (an entry point, a
configuration, units, ...) with a difference, and drain before a restart.
Documentation lives beside this file (changed_groups.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def changed_groups(groups, checked):
    """{group: [the group's destinations that ``checked`` reports changed]}
    for every group of ``groups`` ({group: [chv.fleet.files entries]}), in
    the entries' order; every group present, empty when nothing differs.
    ``checked`` is the registered result of the check-mode run (a skipped
    or missing result counts as no difference)."""
    if not isinstance(groups, Mapping):
        raise AnsibleFilterError('chv.fleet.changed_groups: expects {group: [entries]}, got %r' % (groups,))
    changed = set((checked or {}).get('changed_files') or []) if isinstance(checked, Mapping) else set()
    out = {}
    for name, entries in groups.items():
        bad = isinstance(entries, (str, bytes, Mapping)) or any(
            not isinstance(e, Mapping) or 'dest' not in e for e in entries)
        if bad:
            raise AnsibleFilterError('chv.fleet.changed_groups: group %s must be a list of entries with dest, got %r'
                                     % (name, entries))
        out[name] = [e['dest'] for e in entries if e['dest'] in changed]
    return out


class FilterModule(object):
    def filters(self):
        return {'changed_groups': changed_groups}
