# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""debops-style layering of role lists (``x_default + x + x_group + x_host``).

Documentation lives beside this file (layered.yml), as ansible-core 2.19
expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

from collections.abc import Mapping, Sequence

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean

_STATE = 'state'


def _fold(value, case_sensitive):
    """The comparison key of a value: Jinja's ``ignore_case`` (strings are
    lowercased, everything else is compared as is) unless case-sensitive."""
    if not case_sensitive and isinstance(value, str):
        return value.lower()
    return value


def _layers(layers):
    if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
        raise AnsibleFilterError('chv.fleet.layered: expected a list of layers (lists), got %s'
                                 % type(layers).__name__)
    for index, layer in enumerate(layers):
        if isinstance(layer, (str, bytes, Mapping)) or not isinstance(layer, Sequence):
            raise AnsibleFilterError('chv.fleet.layered: layer %d is a %s, not a list'
                                     % (index, type(layer).__name__))
        for item in layer:
            yield index, item


def _unique(layers, case_sensitive):
    """Concatenate, keeping the first of equal items (Ansible's ``unique``)."""
    result, seen, seen_unhashable = [], set(), []
    for dummy, item in _layers(layers):
        folded = _fold(item, case_sensitive)
        try:
            if folded in seen:
                continue
            seen.add(folded)
        except TypeError:
            if folded in seen_unhashable:
                continue
            seen_unhashable.append(folded)
        result.append(item)
    return result


def _merge_by(layers, key, case_sensitive):
    """Merge by ``key`` the way ``groupby(key) | map('last') | map('last')``
    followed by the ``state`` split did in the role's vars."""
    winners = {}
    for index, item in _layers(layers):
        if not isinstance(item, Mapping):
            raise AnsibleFilterError('chv.fleet.layered: layer %d holds %r, not a dict with %r'
                                     % (index, item, key))
        if key not in item:
            raise AnsibleFilterError('chv.fleet.layered: an entry of layer %d has no %r: %r'
                                     % (index, key, dict(item)))
        folded = _fold(item[key], case_sensitive)
        try:
            winners[folded] = item
        except TypeError:
            raise AnsibleFilterError('chv.fleet.layered: %r %r of layer %d cannot be merged on'
                                     % (key, item[key], index))
    try:
        order = sorted(winners)
    except TypeError:
        raise AnsibleFilterError('chv.fleet.layered: the %r values %r cannot be ordered (mixed types)'
                                 % (key, list(winners)))
    plain = [winners[k] for k in order if _STATE not in winners[k]]
    present = [dict((name, value) for name, value in winners[k].items() if name != _STATE)
               for k in order
               if _STATE in winners[k] and winners[k][_STATE] == 'present']
    return plain + present


def layered(layers, key=None, case_sensitive=False):
    """Merge a list of layers (lowest first).

    Without ``key``: the layers concatenated, each item kept once (the first
    occurrence, in layer order).  With ``key``: for each value of
    ``item[key]`` the entry of the latest layer wins; a winning entry with
    ``state: absent`` (or any ``state`` but ``present``) removes that key;
    the result is ordered by key, entries without ``state`` first, then those
    with ``state: present`` (the ``state`` key dropped).  Strings compare
    case-insensitively unless ``case_sensitive``, like Jinja's ``unique``,
    ``sort`` and ``groupby``."""
    try:
        case_sensitive = boolean(case_sensitive, strict=True)
    except TypeError:
        raise AnsibleFilterError('chv.fleet.layered: case_sensitive %r is not a boolean'
                                 % (case_sensitive,))
    if key is None:
        return _unique(layers, case_sensitive)
    if not isinstance(key, str):
        raise AnsibleFilterError('chv.fleet.layered: key %r is not a string' % (key,))
    return _merge_by(layers, key, case_sensitive)


class FilterModule(object):
    """chv.fleet layering filter."""

    def filters(self):
        return {
            'layered': layered,
        }
