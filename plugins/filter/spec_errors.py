# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A role's argument spec applied to variable values, each error naming the
variable and showing its value (ansible-core's own role validation names
the variable but, for most types, not the value).

Documentation lives beside this file (spec_errors.yml), as ansible-core 2.19
expects."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import json
import os
import re
from collections.abc import Mapping

import yaml

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.errors import ArgumentTypeError

VALUE_MAX = 120  # characters of a shown value
# The collection's roles, relative to this file.
ROLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, 'roles')
# ansible-core appends the converter's own complaint (often only the Python
# class) to "... unable to convert to <type>"; the shown value says more.
_TAIL_RE = re.compile(r'(unable to convert to \w+)(?::.*)?$', re.S)
# what a spec type is called in a message
TYPE_NAMES = {'str': 'a string', 'int': 'an integer', 'float': 'a number', 'bool': 'a boolean',
              'dict': 'a dict', 'list': 'a list', 'path': 'a path'}


def show(value, limit=VALUE_MAX):
    """A value as JSON (as the user wrote it), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + '...'


_SPECS = {}  # path -> (mtime, argument_specs): one read per file and process


def _read_spec(path):
    mtime = os.stat(path).st_mtime
    if _SPECS.get(path, (None,))[0] != mtime:
        with open(path, encoding='utf-8') as handle:
            _SPECS[path] = (mtime, yaml.load(handle, Loader=getattr(yaml, 'CSafeLoader', yaml.SafeLoader))['argument_specs'])
    return _SPECS[path][1]


def role_options(roles, entry_point='main'):
    """The options of an entry point of the collection's roles (a role name
    or a list of them, in order), read from their meta/argument_specs.yml
    with the plain YAML loader (a spec passed through Jinja is re-templated
    at every access, thousands of times slower).  By default ``main``'s, the
    one entry point that documents them (``validate`` checks main's options
    and has none of its own)."""
    options = {}
    for role in [roles] if isinstance(roles, str) else roles:
        path = os.path.join(ROLES_DIR, str(role), 'meta', 'argument_specs.yml')
        try:
            options.update(_read_spec(path)[entry_point]['options'])
        except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
            raise AnsibleFilterError('chv.fleet.spec_options: no options of entry point %r in %s: %s'
                                     % (entry_point, os.path.normpath(path), exc))
    return options


def spec_options(roles, entry_point='main'):
    """The option names of the roles' entry point (see ``role_options``)."""
    return list(role_options(roles, entry_point))


def spec_errors(values, spec, entry_point='main'):
    """Every option of ``spec`` (a role entry point's ``options``, or the
    name of one of the collection's roles or a list of them, whose
    ``entry_point`` options are read) that has a value in ``values`` is
    validated alone by ansible-core's ArgumentSpecValidator; returns one
    message per bad variable, naming it and its value, in the order of the
    spec.  Options without a value are not checked here (ansible-core's role
    validation reports a missing required one)."""
    if isinstance(spec, (str, list)):
        spec = role_options(spec, entry_point)
    if not isinstance(values, Mapping) or not isinstance(spec, Mapping):
        raise AnsibleFilterError('chv.fleet.spec_errors: expected a dict of values and a dict of options, '
                                 'got %s and %s' % (type(values).__name__, type(spec).__name__))
    # plain data, as the variables were written: Ansible's templated values
    # make every copy the validator takes thousands of times slower
    values = json.loads(json.dumps(dict((k, v) for k, v in values.items() if k in spec), default=str))
    if not ArgumentSpecValidator(dict(spec)).validate(values, validate_role_argument_spec=True).error_messages:
        return []  # the common case: one validation of everything
    messages = []
    for name, option in spec.items():
        if name not in values:
            continue
        value = values[name]
        result = ArgumentSpecValidator({name: dict(option)}).validate({name: value}, validate_role_argument_spec=True)
        if not result.error_messages:
            continue
        wanted = option.get('type', 'str')
        texts = []
        for error in result.errors:
            text = error.error_message
            if isinstance(error, ArgumentTypeError) and text.startswith("argument '%s' is of type" % name):
                text = 'not %s' % TYPE_NAMES.get(wanted, 'of type %s' % wanted)
            texts.append(_TAIL_RE.sub(r'\1', text))
        messages.append('%s %s: %s' % (name, show(value), '; '.join(texts)))
    return messages


class FilterModule(object):
    """chv.fleet argument spec filters."""

    def filters(self):
        return {'spec_errors': spec_errors, 'spec_options': spec_options}
