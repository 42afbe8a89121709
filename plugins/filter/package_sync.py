# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What must change on a host so that an installed Python package equals the
role's copy: the files to copy and the files to remove; and which files of
the guest-side source tree (src/, docs/architecture.md "Source tree") make
up each role's part of it.

Each role installs its part of the chv_guest package with one ``find`` of
the installed directories (checksums, modes, owners: a single module run)
and writes only the files package_sync names, all of them in one
chv.fleet.files run (package_files: the entries, contents read here on the
controller). A re-run that changes nothing costs one module run per
package, a fresh host one more (not two per file, as a copy loop would).
Documentation lives beside this file (package_sync.yml, package_files.yml,
guest_tree.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import hashlib
import os

from ansible.errors import AnsibleFilterError

# The guest-side source tree, relative to this file in the collection.
SRC = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, 'src'))
# The one list of what each role installs from src/, as paths relative to
# src/ and to the role's install directory alike (the guest's layout is the
# tree's): "packages" are directories whose *.py files the role owns (each
# read on its own, never recursively; chv_guest itself holds only what all
# roles share), "scripts" single files, "retired" the directories earlier
# releases installed instead (removed whole on the next converge).
GUEST_TREE = {
    'cell_runtime': {'packages': ('chv_guest', 'chv_guest/cell', 'chv_guest/cell/catalog'),
                     'scripts': ('chv-cell', 'chv-cell-agent'),
                     'retired': ('chv_cell',)},
    'broker': {'packages': ('chv_guest', 'chv_guest/wire', 'chv_guest/broker'),
               'scripts': (),
               'retired': ('chv_broker',)},
    'browser': {'packages': ('chv_guest', 'chv_guest/wire', 'chv_guest/browser'),
                'scripts': (),
                'retired': ('chv_browser',)},
    # chv-fleet-metrics (the opt-in metrics role; docs/observability.md)
    # (the launcher's verdicts and the doors' operations label its event counters: cell, wire)
    'metrics': {'packages': ('chv_guest', 'chv_guest/wire', 'chv_guest/cell', 'chv_guest/metrics'),
                'scripts': (),
                'retired': ()},
}


def file_mode(data):
    """The mode a package file is installed with: executable when it is a
    script (its first line starts with #!)."""
    return '0755' if data.startswith(b'#!') else '0644'


def package_sync(sources, installed, uid=0, gid=0, root=None, retired=()):
    """``sources``: the role's files (controller paths, symlinks followed,
    each installed under its file name; or ``{'src', 'name'}`` dicts, as
    guest_tree returns them, installed under ``name``); ``installed``: the
    ``files`` of a ``find`` of the installed directories run with
    ``get_checksum: true``, named relative to ``root`` when given (else by
    their file names). Returns ``{'install': [{'src', 'name', 'mode'}],
    'remove': [path]}``: a source is copied when it is missing or differs in
    content (SHA-1), mode or owner; an installed file that has no source is
    removed. ``retired``: directories an earlier release installed the
    package in, removed whole whenever anything is to be copied (a host
    that has every current file has none of them; removing a missing one
    changes nothing), so a run that changes nothing does not list them."""
    if isinstance(sources, (str, bytes)) or not isinstance(installed, list):
        raise AnsibleFilterError('chv.fleet.package_sync: expects a list of source files and the files '
                                 'list of a find result, got %r and %r'
                                 % (type(sources).__name__, type(installed).__name__))
    sources = [src if isinstance(src, dict) else {'src': src, 'name': os.path.basename(src)} for src in sources]
    present = {}
    for entry in installed:
        if not isinstance(entry, dict) or 'path' not in entry:
            raise AnsibleFilterError('chv.fleet.package_sync: %r is not an entry of a find result' % (entry,))
        if 'checksum' not in entry and entry.get('isreg', True):
            raise AnsibleFilterError('chv.fleet.package_sync: %s has no checksum: run find with '
                                     'get_checksum: true' % entry['path'])
        present[os.path.relpath(entry['path'], root) if root else os.path.basename(entry['path'])] = entry
    names = [src['name'] for src in sources]
    for name in names:
        if names.count(name) > 1:
            raise AnsibleFilterError('chv.fleet.package_sync: two sources named %s' % name)
    install = []
    for src, name in sorted(((src['src'], src['name']) for src in sources), key=lambda pair: pair[1]):
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
    return {'install': install, 'remove': (sorted(retired) if install else []) + remove}


def package_files(install, root, owner='root', group='root'):
    """The chv.fleet.files entries that write package_sync's ``install``
    list under ``root``: each file's content (the source read here, UTF-8
    text, byte for byte), its mode, ``owner`` and ``group``."""
    if not isinstance(install, list) or not isinstance(root, str) or not root.startswith('/'):
        raise AnsibleFilterError('chv.fleet.package_files: expects package_sync\'s install list and an absolute '
                                 'directory, got %r and %r' % (type(install).__name__, root))
    entries = []
    for item in install:
        if not isinstance(item, dict) or not set(('src', 'name', 'mode')) <= set(item):
            raise AnsibleFilterError('chv.fleet.package_files: %r is not an entry of package_sync\'s install list'
                                     % (item,))
        try:
            with open(item['src'], 'rb') as handle:
                content = handle.read().decode('utf-8')
        except (OSError, UnicodeDecodeError) as exc:
            raise AnsibleFilterError('chv.fleet.package_files: cannot read %s as UTF-8 text: %s' % (item['src'], exc))
        entries.append({'dest': os.path.join(root.rstrip('/') or '/', item['name']), 'content': content,
                        'mode': item['mode'], 'owner': owner, 'group': group})
    return entries


def guest_tree(role, root):
    """What ``role`` installs from src/ (GUEST_TREE) when its install
    directory on the host is ``root``: ``sources`` (``{'src', 'name'}``,
    for package_sync), ``dirs`` (the package directories on the host,
    parents first: each is created, and read by the role's find),
    ``scripts`` (``{name: controller path}``) and ``retired`` (the host
    directories of earlier releases, for package_sync)."""
    if role not in GUEST_TREE:
        raise AnsibleFilterError('chv.fleet.guest_tree: no role %r in the source tree (one of %s)'
                                 % (role, ', '.join(sorted(GUEST_TREE))))
    if not isinstance(root, str) or not root.startswith('/'):
        raise AnsibleFilterError('chv.fleet.guest_tree: the install directory must be an absolute path, got %r'
                                 % (root,))
    tree = GUEST_TREE[role]
    sources = []
    for package in tree['packages']:
        directory = os.path.join(SRC, package)
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith('.py'))
        except OSError as exc:
            raise AnsibleFilterError('chv.fleet.guest_tree: cannot read %s: %s' % (directory, exc))
        sources.extend({'src': os.path.join(directory, n), 'name': package + '/' + n} for n in names)
    root = root.rstrip('/') or '/'
    return {'sources': sources,
            'dirs': [os.path.join(root, package) for package in tree['packages']],
            'scripts': dict((name, os.path.join(SRC, name)) for name in tree['scripts']),
            'retired': [os.path.join(root, old) for old in tree['retired']]}


class FilterModule(object):
    def filters(self):
        return {'package_sync': package_sync, 'package_files': package_files, 'guest_tree': guest_tree}
