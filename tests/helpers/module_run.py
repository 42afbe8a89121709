"""A module of the collection run in process by the unit tests: its main()
with the given arguments (check and diff mode as Ansible passes them), and
the JSON result it printed."""

import json

import pytest
from ansible.module_utils.testing import patch_module_args


def run_module(module, capsys, check=False, diff=False, **args):
    args = dict(args)
    if check:
        args['_ansible_check_mode'] = True
    if diff:
        args['_ansible_diff'] = True
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            module.main()
    return json.loads(capsys.readouterr().out)
