"""A role's defaults/main.yml as Ansible sees it: the variables whose default is a door
service's own (chv.fleet.door_default) resolved to the service's DEFAULTS."""
import os
import re

import yaml

from ansible_collections.chv.fleet.plugins.filter.door_config import door_default
from testpaths import ROOT

_DOOR_DEFAULT = re.compile(r"^\{\{ '(\w+)' \| chv\.fleet\.door_default\('(\w+)'\) \}\}$")


def role_defaults(role):
    with open(os.path.join(ROOT, "roles", role, "defaults", "main.yml"), encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    out = {}
    for name, value in data.items():
        match = _DOOR_DEFAULT.match(value) if isinstance(value, str) else None
        out[name] = door_default(match.group(1), match.group(2)) if match else value
    return out
