# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The digest of a run's inputs for one host (site.yml's fast path,
chv.fleet.converge_state): the collection's own files and what the host's
run reads from the inventory, the facts and the guest. Two runs with the same
digest render the same files, units and rulesets on that host.
Documentation lives beside this file (converge_digest.yml)."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import hashlib
import json
import os
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

# what a converge is made of: the roles, their plugins and programs, the playbooks
TREE_PARTS = ('roles', 'plugins', 'src', 'playbooks', 'site.yml', 'galaxy.yml')
TREE_SKIP = ('__pycache__',)


def tree_digest(root):
    """sha256 over every file of TREE_PARTS under root: each relative path and its content, in order."""
    h = hashlib.sha256()
    found = False
    for part in TREE_PARTS:
        top = os.path.join(root, part)
        if os.path.isfile(top):
            paths = [top]
        else:
            paths = []
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames[:] = sorted(d for d in dirnames if d not in TREE_SKIP)
                paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.endswith('.pyc'))
        for path in paths:
            found = True
            h.update(os.path.relpath(path, root).encode('utf-8') + b'\0')
            with open(path, 'rb') as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    if not found:
        raise AnsibleFilterError('chv.fleet.converge_digest: %s holds none of %s' % (root, ', '.join(TREE_PARTS)))
    return h.hexdigest()


def converge_digest(inputs, root):
    """sha256 of ``inputs`` (a dict of the run's inputs for the host, as JSON with sorted keys) and of the
    collection's files under ``root``."""
    if not isinstance(inputs, Mapping):
        raise AnsibleFilterError('chv.fleet.converge_digest: expects a dict of inputs, got %r' % (inputs,))
    try:
        text = json.dumps(inputs, sort_keys=True, default=str)
    except (TypeError, ValueError) as e:
        raise AnsibleFilterError('chv.fleet.converge_digest: inputs not serializable: %s' % e)
    return hashlib.sha256((tree_digest(root) + '\n' + text).encode('utf-8')).hexdigest()


class FilterModule(object):
    def filters(self):
        return {'converge_digest': converge_digest}
