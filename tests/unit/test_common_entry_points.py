"""The collection's own calls of the _common role's entry points.

The roles and playbooks include or import them with `rolespec_validate:
false` (docs/architecture.md, "How a role deploys a service"): ansible-core
would otherwise run an argument-spec task at every such include, on every
host of every run. What that task would check is checked here, once, on the
calls as written: every call names an entry point that has a spec, passes
every option the spec requires, and no `_common_` variable the spec does not
know. The roles' `validate` entry points, which site.yml's validation play
includes the same way, have no options of their own to check."""

import glob
import os

import yaml

from task_walk import walk_tasks
from testpaths import ROOT

ROLE_ACTIONS = ("include_role", "import_role")


def role_calls(role):
    """(file, task) for every include_role/import_role of chv.fleet.<role> in the roles and playbooks."""
    files = sorted(glob.glob(os.path.join(ROOT, "roles", "*", "tasks", "*.yml"))
                   + glob.glob(os.path.join(ROOT, "playbooks", "*.yml"))
                   + glob.glob(os.path.join(ROOT, "playbooks", "tasks", "*.yml")))
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for task in walk_tasks(yaml.safe_load(fh)):
                for key, args in task.items():
                    if key.split(".")[-1] in ROLE_ACTIONS and isinstance(args, dict) \
                            and args.get("name") == "chv.fleet.%s" % role:
                        yield os.path.relpath(path, ROOT), task, args


def specs(role):
    with open(os.path.join(ROOT, "roles", role, "meta", "argument_specs.yml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)["argument_specs"]


def problems_of(calls, entry_points):
    """What the argument-spec task would refuse in ``calls`` ((file, task, args)), and a call without
    rolespec_validate: false."""
    problems = []
    for path, task, args in calls:
        where = "%s: %s" % (path, task.get("name"))
        entry = args.get("tasks_from")
        if entry not in entry_points:
            problems.append("%s: entry point %r has no argument spec" % (where, entry))
            continue
        if args.get("rolespec_validate") is not False:
            problems.append("%s: without rolespec_validate: false" % where)
        options = entry_points[entry].get("options") or {}
        given = set(task.get("vars") or {})
        missing = sorted(o for o, spec in options.items() if spec.get("required") and o not in given)
        unknown = sorted(v for v in given if v.startswith("_common_") and v not in options)
        if missing:
            problems.append("%s: %s lacks the required %s" % (where, entry, missing))
        if unknown:
            problems.append("%s: %s has no option %s" % (where, entry, unknown))
    return problems


def test_every_call_of_an_internal_entry_point_passes_what_its_spec_requires():
    calls = list(role_calls("_common"))
    assert len(calls) >= 30, calls  # the roles' calls were found (control)
    assert problems_of(calls, specs("_common")) == []


def test_a_bad_call_is_found():
    """Control: a call without a required option, with an unknown one, of an entry point without a spec,
    and one that would run the spec task."""
    args = {"name": "chv.fleet._common", "tasks_from": "set_vars", "rolespec_validate": False}
    calls = [("x.yml", {"name": "a", "vars": {"_common_roles": "broker"}}, args),
             ("x.yml", {"name": "b"}, dict(args, tasks_from="nothing")),
             ("x.yml", {"name": "c", "vars": {"_common_role": "broker"}}, dict(args, rolespec_validate=True))]
    assert problems_of(calls, specs("_common")) == [
        "x.yml: a: set_vars lacks the required ['_common_role']", "x.yml: a: set_vars has no option ['_common_roles']",
        "x.yml: b: entry point 'nothing' has no argument spec", "x.yml: c: without rolespec_validate: false"]


def test_the_roles_validate_entry_points_have_no_options_and_are_called_without_the_spec_task():
    calls = [c for role in ("cell_runtime", "cell_nat", "broker", "browser", "metrics")
             for c in role_calls(role)]
    # site.yml's deploy play imports each role, the validation play includes their validate entry point
    # (a templated name: found by its tasks_from), each without the spec task
    for role in ("cell_runtime", "cell_nat", "broker", "browser", "metrics"):
        assert not specs(role)["validate"].get("options"), role
    deploy = [args for path, task, args in calls if path == os.path.join("playbooks", "site.yml")
              and "tasks_from" not in args]
    assert len(deploy) == 5 and all(a.get("rolespec_validate") is False for a in deploy), deploy
    with open(os.path.join(ROOT, "playbooks", "validate.yml"), encoding="utf-8") as fh:
        validate = [args for task in walk_tasks(yaml.safe_load(fh)) for key, args in task.items()
                    if key.split(".")[-1] == "include_role" and isinstance(args, dict)
                    and args.get("tasks_from") == "validate"]
    assert len(validate) == 1 and validate[0].get("rolespec_validate") is False, validate
    # ... with __chv_fleet_platform_checked: true, which skips the _common role's validate in each role's
    # validate entry point (the platform and main's spec), as the tasks before it apply every role's main
    # spec (chv.fleet.spec_errors) and check the platform and load every role's platform variables
    # (platform_vars) for the same roles (the list the include loops over)
    with open(os.path.join(ROOT, "playbooks", "validate.yml"), encoding="utf-8") as fh:
        tasks = list(walk_tasks(yaml.safe_load(fh)))
    include = [t for t in tasks if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "validate"][0]
    assert include["vars"]["__chv_fleet_platform_checked"] is True and include["loop"] == "{{ __chv_fleet_roles }}", include
    before = tasks[:tasks.index(include)]
    assert [t for t in before if "chv.fleet.spec_errors(__chv_fleet_roles)" in str(t.get("vars"))], before
    assert [t for t in before if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "platform_vars"
            and t["vars"] == {"_common_roles": "{{ __chv_fleet_roles }}"}], before
    for role in ("cell_runtime", "cell_nat", "broker", "browser", "metrics"):
        common = [task for path, task, args in role_calls("_common")
                  if path == os.path.join("roles", role, "tasks", "validate.yml") and args.get("tasks_from") == "validate"]
        assert [t["when"] for t in common] == ["not (__chv_fleet_platform_checked | default(false) | bool)"], (role, common)
