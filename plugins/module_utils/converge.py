# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The end of a module that plans changes, makes them unless in check mode
and reports them (chv.fleet.directories, chv.fleet.files): one home for the
check mode, the failure message and the diff."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type


def entries_spec(key, options):
    """The argument_spec of such a module: ``key`` the list of its entries (each with ``options``, an
    owner and a group), owner and group their defaults (doc fragment chv.fleet.owned_entries)."""
    entry = dict(options, owner=dict(type="str"), group=dict(type="str"))
    return {key: dict(type="list", elements="dict", required=True, options=entry),
            "owner": dict(type="str", default="root"), "group": dict(type="str", default="root")}


def plan_and_apply(module, label, errors, plan, apply, diff, key, name_of):
    """plan() returns the changes; apply(changes) makes them, except in
    check mode. Exits the module: changed, ``key`` (the name_of of each
    change, in order) and, in diff mode, diff(changes); an exception of
    ``errors`` fails it with the message after ``label``."""
    try:
        changes = plan()
        if changes and not module.check_mode:
            apply(changes)
    except errors as e:
        module.fail_json(msg="%s: %s" % (label, e))
    result = {"changed": bool(changes), key: [name_of(c) for c in changes]}
    if changes and module._diff:
        result["diff"] = diff(changes)
    module.exit_json(**result)
