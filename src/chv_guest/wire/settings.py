"""A door service's settings as one table: each configuration key with the
role variable that sets it and the rule its value must meet.

The service checks its configuration against the table at start; the role
checks the same table on the controller before any change (the filters
chv.fleet.door_config and door_config_errors), so a message names the role
variable either way: ``<variable> must be <rule>, not <value>``.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

# None when the value is good, else what follows the variable's name in the message
Rule = Callable[[object], Optional[str]]
MISSING = object()


class Setting(NamedTuple):
    key: str  # the key in the configuration, "sync.timeout" for a nested one; "" for a role variable only
    var: str  # what a message names: the role variable (the key when no role variable sets it)
    rule: Rule
    # the role variable whose default is this key's default (DEFAULTS): var's own
    # when None, "" when the role has a default of its own (or none)
    default_var: Optional[str] = None


def show(value: object) -> str:
    """A value as the user wrote it (JSON)."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def must(what: str, value: object) -> str:
    return "must be %s, not %s" % (what, show(value))


def integer(least: int) -> Rule:
    def rule(value: object) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, int):
            return must("an integer of at least %d" % least, value)
        return None if value >= least else must("at least %d" % least, value)
    return rule


def number(least: float = 0, strict: bool = True) -> Rule:
    """A number above ``least`` (at least ``least`` when not ``strict``)."""
    what = ("a number above %g" if strict else "a number of at least %g") % least

    def rule(value: object) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return must(what, value)
        return None if (value > least if strict else value >= least) else must(what, value)
    return rule


def boolean(value: object) -> Optional[str]:
    return None if isinstance(value, bool) else must("true or false", value)


def text(value: object) -> Optional[str]:
    return None if isinstance(value, str) else must("a string", value)


def absolute_path(value: object) -> Optional[str]:
    return None if isinstance(value, str) and value.startswith("/") else must("an absolute path", value)


def one_of(*choices: str) -> Rule:
    def rule(value: object) -> Optional[str]:
        return None if value in choices else must("one of %s" % ", ".join(choices), value)
    return rule


def strings(choices: Sequence[str] = ()) -> Rule:
    """A list of strings (each among ``choices``, when given)."""
    what = "a list of %s" % ("strings among " + ", ".join(choices) if choices else "strings")

    def rule(value: object) -> Optional[str]:
        good = isinstance(value, list) and all(isinstance(v, str) and (not choices or v in choices) for v in value)
        return None if good else must(what, value)
    return rule


def not_root(value: object) -> Optional[str]:
    return None if isinstance(value, str) and value != "root" else must("a user other than root", value)


def get(config: Mapping[str, Any], key: str) -> object:
    """The value at ``key`` ("a.b": nested), or MISSING."""
    value: object = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def problems(values: Mapping[str, Any], settings: Iterable[Setting], by_var: bool = False) -> List[str]:
    """``<var> <problem>`` of each setting whose value breaks its rule: the
    values by configuration key (a key missing is not checked), or with
    ``by_var`` by role variable."""
    out = []
    for setting in settings:
        value = values.get(setting.var, MISSING) if by_var else get(values, setting.key)
        problem = None if value is MISSING else setting.rule(value)
        if problem:
            out.append("%s %s" % (setting.var, problem))
    return out


def role_defaults(defaults: Mapping[str, Any], settings: Iterable[Setting]) -> Dict[str, object]:
    """{role variable: its default}, for the role variables whose default is the service's."""
    out: Dict[str, object] = {}
    for setting in settings:
        var = setting.var if setting.default_var is None else setting.default_var
        if var and setting.key:
            out[var] = get(defaults, setting.key)
    return out


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """``over`` on ``base``, dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out
