"""The controller-side checks site.yml and the cell_runtime role run before
any change (docs/reliability.md, "Bad input refused before any change"):
chv.fleet.spec_errors (a role's argument spec, naming each bad value),
chv.fleet.cell_policy_errors (the launcher's own policy validator, named by
the role's variables) and pool_overlaps(ignore_equal=true) (per-host pools).
Each refusal beside its control: the closest accepted value passes."""

import copy
import os

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.chv.fleet.plugins.filter import cell_policy, pools, spec_errors

from testpaths import ROOT
from chv_guest.cell import policy as launcher

ROLES = ("cell_runtime", "cell_nat", "broker", "browser")


def spec(role):
    """main's options, the one entry point that documents them (validate checks main's)."""
    with open(os.path.join(ROOT, "roles", role, "meta", "argument_specs.yml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)["argument_specs"]["main"]["options"]


# ------------------------------------------------------------------ spec_errors

def test_filters_are_registered():
    assert set(spec_errors.FilterModule().filters()) == {"spec_errors", "spec_options"}
    assert set(cell_policy.FilterModule().filters()) == {"cell_policy_errors"}


@pytest.mark.parametrize("role", ROLES)
def test_every_documented_default_passes_its_own_spec(role):
    options = spec(role)
    defaults = dict((name, o["default"]) for name, o in options.items() if "default" in o)
    assert defaults and spec_errors.spec_errors(defaults, options) == []


@pytest.mark.parametrize("name,value,message", [
    ("chv_cell_properties", ["MemoryMax=1G"], 'chv_cell_properties ["MemoryMax=1G"]: not a dict'),
    ("chv_cell_claim_timeout", "soon", 'chv_cell_claim_timeout "soon": not a number'),
    ("chv_cell_register", "maybe", 'chv_cell_register "maybe": not a boolean'),
    ("chv_cell_prefix", "wide", 'chv_cell_prefix "wide": not an integer'),
    ("chv_cell_tmpfs", {"path": "/tmp"}, 'chv_cell_tmpfs {"path": "/tmp"}: not a list'),
    ("chv_cell_uid_mode", "root",
     'chv_cell_uid_mode "root": value of chv_cell_uid_mode must be one of: per_slot, shared, got: root'),
    ("chv_cell_readonly_binds", [{"target": "/x"}],
     'chv_cell_readonly_binds [{"target": "/x"}]: missing required arguments: source'),
])
def test_a_wrong_type_names_the_variable_and_its_value(name, value, message):
    options = spec("cell_runtime")
    found = spec_errors.spec_errors({name: value}, options)
    assert len(found) == 1 and found[0].startswith(message), found
    # ansible-core's own validation refuses the same value (the filter adds the value, not a rule)
    assert ArgumentSpecValidator({name: options[name]}).validate(
        {name: value}, validate_role_argument_spec=True).error_messages


@pytest.mark.parametrize("name,value", [
    ("chv_cell_properties", {"MemoryMax": "1G"}), ("chv_cell_claim_timeout", 12.5), ("chv_cell_register", "yes"),
    ("chv_cell_prefix", "28"), ("chv_cell_tmpfs", ["/tmp"]), ("chv_cell_uid_mode", "shared"),
    ("chv_cell_readonly_binds", [{"source": "/x", "target": "/x"}]),
])
def test_the_accepted_value_next_to_each_passes(name, value):
    assert spec_errors.spec_errors({name: value}, spec("cell_runtime")) == []


def test_each_bad_variable_is_named_once_in_spec_order_and_long_values_are_cut():
    options = spec("cell_runtime")
    found = spec_errors.spec_errors({"chv_cell_tmpfs": {"x": "y" * 300}, "chv_cell_prefix": "wide",
                                     "chv_cell_pool": "10.200.0.0/16", "not_an_option": []}, options)
    names = list(options)
    assert [f.split(" ")[0] for f in found] == sorted(["chv_cell_prefix", "chv_cell_tmpfs"], key=names.index)
    shown = found[1][len("chv_cell_tmpfs "):found[1].index(": not a list")]
    assert len(shown) == spec_errors.VALUE_MAX and shown.endswith("...")


def test_spec_errors_wants_two_dicts():
    with pytest.raises(AnsibleFilterError, match="expected a dict of values"):
        spec_errors.spec_errors(["chv_cell_prefix"], spec("cell_runtime"))


# ------------------------------------------------------------- cell_policy_errors

def role_policy(**changes):
    """A policy as the role renders it (the launcher's defaults, no slots yet)."""
    policy = copy.deepcopy(launcher.DEFAULTS)
    policy.update(inaccessible=["/etc/chv", "/opt/chv-browser", "/run/chv-shots"],
                  readonly_binds=[{"source": "/app", "target": "/app", "optional": True},
                                  {"source": "/run/chv-shots/{slot}", "target": "/run/chv/shots", "optional": True}],
                  slots=[])
    policy.update(changes)
    return policy


def test_the_capability_names_are_the_launchers():
    assert cell_policy.launcher_policy().KNOWN_CAPS == launcher.KNOWN_CAPS
    assert len(launcher.KNOWN_CAPS) == 41


def test_the_role_shaped_policy_passes():
    assert cell_policy.cell_policy_errors(role_policy()) == []


@pytest.mark.parametrize("changes,message", [
    ({"drop_capabilities": sorted(launcher.REQUIRED_DROPPED_CAPS | {"CAP_SYS_RESOURCE", "CAP_SYS_ADMINN"})},
     "chv_cell_drop_capabilities: unknown capability 'CAP_SYS_ADMINN'"),
    ({"workspace_root": "var/lib/chv-fleet/workspaces"},
     "chv_cell_workspace_root: 'var/lib/chv-fleet/workspaces' must be an absolute normalised path"),
    ({"tmpfs": ["tmp"]}, 'chv_cell_tmpfs: must be a list of absolute paths other than /, got ["tmp"]'),
    ({"writable_binds": [{"source": "/etc/chv", "target": "/mnt/chv", "optional": False}]},
     "chv_cell_writable_binds[0]: source /etc/chv would expose /etc/chv inside the cell"),
    ({"readonly_binds": [{"source": "/opt", "target": "/mnt/opt"}]},
     'chv_cell_readonly_binds[0]: {"source": "/opt", "target": "/mnt/opt"} would show /opt/chv-browser, hidden by '
     'chv_cell_inaccessible, at /mnt/opt/chv-browser in the cell'),
])
def test_what_the_launcher_refuses_is_refused_naming_the_role_variable(changes, message):
    found = cell_policy.cell_policy_errors(role_policy(**changes))
    assert message in found, found


@pytest.mark.parametrize("changes", [
    {"drop_capabilities": sorted(launcher.REQUIRED_DROPPED_CAPS | {"CAP_SYS_RESOURCE", "CAP_SYSLOG"})},
    {"workspace_root": "/srv/workspaces"},
    {"tmpfs": ["/tmp", "/var/tmp"]},
    {"writable_binds": [{"source": "/srv/cache", "target": "/mnt/chv", "optional": False}]},
    # a hidden path bound at its own place stays hidden there; a part of one (a slot's own shots) is no exposure
    {"readonly_binds": [{"source": "/opt", "target": "/opt"}]},
    {"readonly_binds": [{"source": "/run/chv-shots/{slot}", "target": "/run/chv/shots"}]},
    {"readonly_binds": [{"source": "/opt/other", "target": "/mnt/other"}]},
])
def test_the_accepted_policy_next_to_each_passes(changes):
    assert cell_policy.cell_policy_errors(role_policy(**changes)) == []


def test_slot_errors_and_fixed_keys_are_not_named_as_role_variables():
    found = cell_policy.cell_policy_errors(role_policy(state_dir="run/x", slots=[{"name": "slot0"}]))
    assert found == ["state_dir: 'run/x' must be an absolute normalised path"], found


def test_the_launcher_is_the_collections_src():
    """The filter imports the launcher's validator as a module of the collection
    (ansible_collections.chv.fleet.src.chv_guest), the same file the tests import."""
    assert cell_policy.launcher_policy().__name__ == "ansible_collections.chv.fleet.src.chv_guest.cell.policy"
    assert os.path.samefile(cell_policy.launcher_policy().__file__, launcher.__file__)
    with pytest.raises(AnsibleFilterError, match="expected the policy as a dict"):
        cell_policy.cell_policy_errors([])


# ------------------------------------------------------- pool_overlaps(ignore_equal)

def test_equal_pools_are_not_a_clash_but_a_pool_inside_another_is():
    hosts = {"h1": "10.200.0.0/16", "h2": "10.200.0.0/16", "h3": "10.200.128.0/17", "h4": "10.201.0.0/16"}
    assert pools.pool_overlaps(hosts, ignore_equal=True) == [
        {"a": "h1", "a_pool": "10.200.0.0/16", "b": "h3", "b_pool": "10.200.128.0/17"},
        {"a": "h2", "a_pool": "10.200.0.0/16", "b": "h3", "b_pool": "10.200.128.0/17"}]
    # without it, the equal pair is one too (the filter's default, unchanged)
    assert {"a": "h1", "a_pool": "10.200.0.0/16", "b": "h2", "b_pool": "10.200.0.0/16"} in pools.pool_overlaps(hosts)
    assert pools.pool_overlaps({"h1": "10.200.0.0/16", "h2": "10.200.0.0/16"}, ignore_equal=True) == []


def test_a_role_name_reads_its_spec_from_the_collection():
    assert spec_errors.spec_options("cell_runtime") == list(spec("cell_runtime"))
    assert spec_errors.spec_options(["cell_nat", "broker"]) == list(spec("cell_nat")) + list(spec("broker"))
    values = {"chv_cell_prefix": "wide", "chv_broker_read_timeout": "soon", "cell_nat_ratelimit": 5}
    assert spec_errors.spec_errors(values, list(ROLES)) == [
        'chv_cell_prefix "wide": not an integer', 'chv_broker_read_timeout "soon": not a number']
    with pytest.raises(AnsibleFilterError, match="no options of entry point 'main'"):
        spec_errors.spec_options("no_such_role")


@pytest.mark.parametrize("role", ROLES)
def test_the_filters_read_mains_options_which_validate_does_not_repeat(role):
    # by default main's (site.yml's type check names no entry point)
    assert spec_errors.spec_options(role) == spec_errors.spec_options(role, "main") == list(spec(role))
    assert spec_errors.spec_errors({"not_an_option": 1}, role) == []
    # validate documents no options of its own: reading them is an error, not an empty spec that passes all
    with pytest.raises(AnsibleFilterError, match="no options of entry point 'validate'"):
        spec_errors.spec_options(role, "validate")
