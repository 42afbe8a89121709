# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What must change on a host so that an installed Python package equals the
role's copy: the files to copy and the files to remove.

Each role ships its package (chv_cell, chv_broker, chv_browser) with one
``find`` of the installed directory (checksums, modes, owners: a single
module run) and copies only the files this filter names. A re-run that
changes nothing costs one module run per package instead of two per file.
Documentation lives beside this file (package_sync.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import hashlib
import os

from ansible.errors import AnsibleFilterError


def file_mode(data):
    """The mode a package file is installed with: executable when it is a
    script (its first line starts with #!)."""
    return '0755' if data.startswith(b'#!') else '0644'


def package_sync(sources, installed, uid=0, gid=0):
    """``sources``: the role's files (controller paths, symlinks followed);
    ``installed``: the ``files`` of a ``find`` of the installed directory
    run with ``get_checksum: true``. Returns ``{'install': [{'src', 'name',
    'mode'}], 'remove': [path]}``: a source is copied when it is missing or
    differs in content (SHA-1), mode or owner; an installed file that has
    no source is removed."""
    if isinstance(sources, (str, bytes)) or not isinstance(installed, list):
        raise AnsibleFilterError('chv.fleet.package_sync: expects a list of source files and the files '
                                 'list of a find result, got %r and %r'
                                 % (type(sources).__name__, type(installed).__name__))
    present = {}
    for entry in installed:
        if not isinstance(entry, dict) or 'path' not in entry:
            raise AnsibleFilterError('chv.fleet.package_sync: %r is not an entry of a find result' % (entry,))
        if 'checksum' not in entry and entry.get('isreg', True):
            raise AnsibleFilterError('chv.fleet.package_sync: %s has no checksum: run find with '
                                     'get_checksum: true' % entry['path'])
        present[os.path.basename(entry['path'])] = entry
    names = [os.path.basename(src) for src in sources]
    for name in names:
        if names.count(name) > 1:
            raise AnsibleFilterError('chv.fleet.package_sync: two sources named %s' % name)
    install = []
    for src in sorted(sources, key=os.path.basename):
        name = os.path.basename(src)
        try:
            with open(src, 'rb') as handle:
                data = handle.read()
        except OSError as exc:
            raise AnsibleFilterError('chv.fleet.package_sync: cannot read %s: %s' % (src, exc))
        mode = file_mode(data)
        have = present.get(name)
        same = (have is not None and have.get('isreg', True) and not have.get('islnk', False)
                and have.get('checksum') == hashlib.sha1(data).hexdigest()
                and int(str(have.get('mode', '')), 8) & 0o7777 == int(mode, 8)
                and have.get('uid') == uid and have.get('gid') == gid)
        if not same:
            install.append({'src': src, 'name': name, 'mode': mode})
    remove = sorted(entry['path'] for name, entry in present.items() if name not in names)
    return {'install': install, 'remove': remove}


class FilterModule(object):
    def filters(self):
        return {'package_sync': package_sync}
