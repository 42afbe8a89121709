"""Render the roles' macOS templates as Ansible renders them (trim_blocks,
strict undefined), with the collection's filters they call, for the tests
of tests/unit/darwin. Also: cell policies for macOS as the cell_runtime
role renders them (the launcher's defaults, a darwin platform, the role's
default lists), and a small s-expression reader for Seatbelt profiles."""

import base64
import copy
import json
import os
import re

import jinja2
import jinja2.nativetypes
import yaml

import cellrt  # noqa: F401  # pylint: disable=unused-import  (puts the launcher package on sys.path)
from ansible_collections.chv.fleet.plugins.filter.darwin import darwin_slots, pf_anchor_rules, seatbelt_profile
from chv_guest.cell import policy as policymod
from testpaths import ROOT


def _to_nice_json(value, indent=4, sort_keys=True):
    return json.dumps(value, indent=indent, sort_keys=sort_keys, separators=(",", ": "))


def environment():
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update({
        "to_json": json.dumps,
        "to_nice_json": _to_nice_json,
        "chv.fleet.seatbelt_profile": seatbelt_profile,
        "chv.fleet.pf_anchor_rules": pf_anchor_rules,
        "chv.fleet.darwin_slots": darwin_slots,
    })
    env.tests["match"] = lambda value, pattern: re.match(pattern, value) is not None
    return env


def evaluate(expression, **variables):
    """A role variable's Jinja expression (vars/*.yml) evaluated as Ansible
    does, to a native value."""
    env = jinja2.nativetypes.NativeEnvironment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(environment().filters)
    env.filters["b64decode"] = lambda text: base64.b64decode(text).decode()
    return env.from_string(expression.strip()).render(**variables)


def template_path(role, name):
    return os.path.join(ROOT, "roles", role, "templates", name)


def render(role, name, **variables):
    """The role's template ``name`` rendered with ``variables``."""
    with open(template_path(role, name), encoding="utf-8") as fh:
        return environment().from_string(fh.read()).render(ansible_managed="Managed by chv.fleet", **variables)


def role_yaml(role, *parts):
    with open(os.path.join(ROOT, "roles", role, *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def darwin_vars(role):
    return role_yaml(role, "vars", "Darwin.yml")


def role_default_inaccessible(agent_home):
    """chv_cell_inaccessible_default of the cell_runtime role, its one template filled in."""
    return [p.replace("{{ chv_cell_agent_home }}", agent_home)
            for p in role_yaml("cell_runtime", "defaults", "main.yml")["chv_cell_inaccessible_default"]]


def darwin_policy(slots=2, agent_home="/Users/chv", inaccessible_extra=(), readonly_extra=(),
                  workspace_root="/var/lib/chv-fleet/workspaces", agent_state_root="/var/lib/chv-fleet/agent-state"):
    """A darwin cell policy as the cell_runtime role renders it on macOS
    (vars/main.yml __cell_runtime_policy with vars/Darwin.yml), merged with
    the launcher's defaults as the launcher reads it."""
    defaults = role_yaml("cell_runtime", "defaults", "main.yml")
    dvars = darwin_vars("cell_runtime")
    pol = copy.deepcopy(policymod.DEFAULTS)
    pol.update({
        "platform": "darwin",
        "nspawn": None, "systemd_run": None, "ip": None, "nsenter": None, "nft": None,
        "sandbox_exec": dvars["__cell_runtime_commands"]["sandbox_exec"],
        "pfctl": dvars["__cell_runtime_commands"]["pfctl"],
        "python": dvars["__cell_runtime_commands"]["python"],
        "pf_anchor": dvars["__cell_runtime_pf_anchor"],
        "workspace_root": workspace_root,
        "agent_state_root": agent_state_root,
        "agent_home": agent_home,
        "agent_state_mount": agent_home,
        "inaccessible": dvars["__cell_runtime_inaccessible_platform"] + role_default_inaccessible(agent_home)
        + list(inaccessible_extra),
        "readonly_binds": defaults["chv_cell_readonly_binds_default"] + list(readonly_extra),
        "writable_binds": defaults["chv_cell_writable_binds_default"],
        "slots": darwin_slots(slots, defaults["chv_cell_machine_prefix"]),
    })
    errors = policymod.validate(json.loads(json.dumps(pol)))
    assert errors == [], errors
    return policymod.merged(pol)


# --- a small reader of SBPL (Seatbelt's s-expressions) -------------------
_TOKEN = re.compile(r'\s+|;[^\n]*|(\()|(\))|"((?:[^"\\]|\\.)*)"|#"((?:[^"\\]|\\.)*)"|([^\s()";]+)')


class Str(str):
    """A string literal of the profile."""


class Regex(str):
    """A #"..." regex literal of the profile."""


def parse_sexprs(text):
    """The profile's top-level forms as nested lists (symbols as str,
    literals as Str / Regex); raises ValueError on anything unbalanced or
    unreadable."""
    stack = [[]]
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError("unreadable at %d: %r" % (pos, text[pos:pos + 20]))
        pos = m.end()
        if m.group(1):
            stack.append([])
        elif m.group(2):
            if len(stack) == 1:
                raise ValueError("unbalanced ')' at %d" % pos)
            form = stack.pop()
            stack[-1].append(form)
        elif m.group(3) is not None:
            stack[-1].append(Str(re.sub(r"\\(.)", r"\1", m.group(3))))
        elif m.group(4) is not None:
            stack[-1].append(Regex(m.group(4)))
        elif m.group(5):
            stack[-1].append(m.group(5))
    if len(stack) != 1:
        raise ValueError("%d unclosed '('" % (len(stack) - 1))
    return stack[0]
