# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The cell policy checked on the controller, before any change, by the
launcher's own validator (``chv_guest.cell.policy.validate``, in the
collection's src/, imported as any module of the collection), so the
capability names, the protected paths and every other rule have one home:
the launcher.

Documentation lives beside this file (cell_policy_errors.yml), as
ansible-core 2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import json
import re

from ansible.errors import AnsibleFilterError
from ansible_collections.chv.fleet.plugins.filter.spec_errors import show

# Policy keys the role fixes itself (no role variable sets them).
FIXED_KEYS = ('version', 'state_dir', 'no_new_privileges', 'nspawn', 'systemd_run', 'ip', 'nsenter', 'nft', 'python',
              'nspawn_environment', 'slots', 'platform', 'sandbox_exec', 'pfctl', 'pf_anchor')
# "key: ..." or "key[3]: ..." at the start of a validator message
_KEY_RE = re.compile(r'^([a-z_]+)((?:\[\d+\])?)(:| )')


def launcher_policy():
    """The launcher's chv_guest.cell.policy, imported when the filter runs
    (see the note in pools.py)."""
    from ansible_collections.chv.fleet.src.chv_guest.cell import policy  # pylint: disable=import-outside-toplevel
    return policy


def _is_under(path, root):
    return path == root or path.startswith(root.rstrip('/') + '/')


def hidden_exposures(policy):
    """Binds that show a hidden path (``inaccessible``) at another place.

    The launcher hides each ``inaccessible`` path at that path in the cell;
    a bind whose source is that path or one of its parents shows it again at
    the bind's target, unless that cell path is hidden too (a bind to the
    same place).  A bind of something inside a hidden path (a slot's own
    screenshot directory) exposes only itself and is allowed.  Returns
    ``(list name, index, bind, hidden path, cell path)`` tuples."""
    hidden = [h for h in policy.get('inaccessible') or [] if isinstance(h, str) and h.startswith('/')]
    found = []
    for key in ('readonly_binds', 'writable_binds'):
        for index, bind in enumerate(policy.get(key) or []):
            if not isinstance(bind, dict) or not isinstance(bind.get('source'), str):
                continue
            source = bind['source'].replace('{slot}', 'slot')
            target = bind.get('target', bind['source'])
            target = target.replace('{slot}', 'slot') if isinstance(target, str) else source
            for path in hidden:
                if not _is_under(path, source):
                    continue
                seen_at = target.rstrip('/') + path[len(source.rstrip('/')):] if path != source else target
                if not any(_is_under(seen_at, h) for h in hidden):
                    found.append((key, index, bind, path, seen_at))
    return found


def cell_policy_errors(policy, var_prefix='chv_cell_'):
    """What the launcher would refuse in ``policy`` (the dict the role
    renders), each message naming the role variable: ``key: ...`` becomes
    ``<var_prefix>key: ...``.  Errors about the slot table are left out (the
    slots are allocated later, on the host); so are keys the role fixes."""
    if not isinstance(policy, dict):
        raise AnsibleFilterError('chv.fleet.cell_policy_errors: expected the policy as a dict, got %s'
                                 % type(policy).__name__)
    plain = json.loads(json.dumps(policy))  # what the launcher reads: the rendered JSON
    errors = []
    for message in launcher_policy().validate(plain):
        match = _KEY_RE.match(message)
        key = match.group(1) if match else None
        if key == 'slots' or message.startswith('slots['):
            continue
        if key and key not in FIXED_KEYS and key in plain:
            if not match.group(2) and message[match.end():].lstrip().startswith('must'):
                message += ', got %s' % show(plain[key])  # the validator names no value there
            message = var_prefix + message
        errors.append(message)
    for key, index, bind, path, seen_at in hidden_exposures(plain):
        errors.append('%s%s[%d]: %s would show %s, hidden by %sinaccessible, at %s in the cell'
                      % (var_prefix, key, index, json.dumps(bind, sort_keys=True), path, var_prefix, seen_at))
    return errors


class FilterModule(object):
    """chv.fleet cell policy filters."""

    def filters(self):
        return {'cell_policy_errors': cell_policy_errors}
