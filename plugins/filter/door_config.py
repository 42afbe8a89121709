# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A door service's configuration checked on the controller, before any
change, by the service's own validator (``chv_guest.broker.config`` and
``chv_guest.browser.config``, in the collection's src/, imported as any
module of the collection), and the role variables' defaults taken from the
service's ``DEFAULTS``: each rule and each default has one home, the service.

Documentation lives beside this file (door_config.yml,
door_config_errors.yml, door_default.yml), as ansible-core 2.19 expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import importlib
import json
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible_collections.chv.fleet.src.chv_guest.wire import settings

SERVICES = ('broker', 'browser')


def _service(name, caller):
    """The service's config module (chv_guest.<name>.config), imported when a
    filter runs (see the note in pools.py)."""
    if name not in SERVICES:
        raise AnsibleFilterError('chv.fleet.%s: no door service %r (one of %s)'
                                 % (caller, name, ', '.join(SERVICES)))
    return importlib.import_module('ansible_collections.chv.fleet.src.chv_guest.%s.config' % name)


def _plain(value, what, caller):
    """What the service reads: the rendered JSON."""
    if not isinstance(value, Mapping):
        raise AnsibleFilterError('chv.fleet.%s: expected %s as a dict, got %s' % (caller, what, type(value).__name__))
    return json.loads(json.dumps(dict(value)))


def door_config_errors(config, service, role_vars=None):
    """What ``service`` would refuse in ``config`` (the configuration the
    role renders, over the service's DEFAULTS) and in ``role_vars`` (the
    role's variables that are no configuration key), each message naming the
    role variable and its value."""
    module = _service(service, 'door_config_errors')
    plain = _plain(config, 'the configuration', 'door_config_errors')
    return module.validate(settings.merge(module.DEFAULTS, plain),
                           _plain(role_vars or {}, 'the role variables', 'door_config_errors'))


def door_config(config, service):
    """``config`` as the service reads it, or AnsibleFilterError naming every problem."""
    errors = door_config_errors(config, service)
    if errors:
        raise AnsibleFilterError('chv.fleet.door_config: chv-%s would refuse its configuration: %s'
                                 % (service, '; '.join(errors)))
    return _plain(config, 'the configuration', 'door_config')


def door_default(var, service):
    """The default of role variable ``var``: the service's own (its DEFAULTS)."""
    module = _service(service, 'door_default')
    defaults = settings.role_defaults(module.DEFAULTS, module.SETTINGS)
    if var not in defaults:
        raise AnsibleFilterError('chv.fleet.door_default: chv-%s has no default for %r (it has %s)'
                                 % (service, var, ', '.join(sorted(defaults))))
    return json.loads(json.dumps(defaults[var]))  # a copy: DEFAULTS stays as it is


class FilterModule(object):
    """chv.fleet door service configuration filters."""

    def filters(self):
        return {'door_config': door_config, 'door_config_errors': door_config_errors, 'door_default': door_default}
