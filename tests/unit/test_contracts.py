"""Contracts between the roles that no single role's tests see.

1. A slot identity the allocator (module_utils/cell_identity) can produce is
   accepted by every consumer: cell_nat (normalize_slot_records and its
   ifname prefix check), the cell_runtime role's ifname prefix check,
   chv-cell's policy (validate), chv-browser (check_slot) and chv-broker (the
   sync unit named after the slot).  What a consumer refuses (loopback,
   link-local and multicast subnets, uid 0, cell_ifname lo, ifname prefixes
   longer than 12, trailing newlines, machine names over 64) the allocator
   refuses itself, and the consumers keep refusing it too.
2. chv_cell_inaccessible_default, after the platform's own paths
   (vars/Debian.yml), hides every path the browser role installs, its
   chromium, and the broker's credential directory.
3. lab_role_packages (baked into the lab image) is the union of the roles'
   package lists (the platform's, vars/Debian.yml, and the public extras),
   apart from what every lab image holds anyway.
4. Every unit a role masks (a systemd_service task with masked: true) is in
   that role's `owned` masked_units, which playbooks/remove.yml unmasks.
"""
import ipaddress
import json
import os
import re
import sys

import jinja2
import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings as hsettings, strategies as st

from ansible_collections.chv.fleet.plugins.module_utils import cell_identity as ci
from ansible_collections.chv.fleet.plugins.module_utils import cell_nat as cn
from ansible_collections.chv.fleet_lab.plugins.module_utils import lab

from role_defaults import role_defaults
from task_walk import walk_tasks
from testpaths import LAB_ROLE, ROOT

ROLES = os.path.join(ROOT, "roles")

from chv_guest.broker import server as broker_server  # noqa: E402
from chv_guest.browser import policy as browser_policy  # noqa: E402
from chv_guest.cell import policy as cell_policy  # noqa: E402


def yaml_file(path):
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def role_yaml(role, kind="defaults", name="main"):
    return yaml_file(os.path.join(ROLES, role, kind, name + ".yml"))


# ------------------------------------------------------------ 1. slot records

# systemd's unit_name_is_valid: these characters, at most 255 bytes with the suffix.
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\-]+")


def role_ifname_prefix_check():
    """The cell_runtime role's check of chv_cell_ifname_prefix (tasks/checks.yml): the template of its
    list of messages, empty when the prefix passes."""
    with open(os.path.join(ROLES, "cell_runtime", "tasks", "checks.yml"), encoding="utf-8") as fh:
        tasks = yaml.safe_load(fh)
    found = [task["vars"]["__cell_runtime_ifname_errors"] for task in tasks
             if "__cell_runtime_ifname_errors" in task.get("vars", {})]
    assert len(found) == 1, found
    return found[0]


def role_accepts_ifname_prefix(prefix):
    env = jinja2.Environment()
    env.filters["to_json"] = json.dumps
    errors = env.from_string(role_ifname_prefix_check()).render(chv_cell_ifname_prefix=prefix)
    assert errors == "[]" or "leaves no room for the slot index" in errors, errors
    return errors == "[]"


def consumer_errors(settings, records):
    """What each consumer says about the allocator's output ([] = all accept)."""
    errors = []
    try:
        cn.normalize_slot_records(records, "slots")
    except cn.CellNatError as exc:
        errors.append("cell_nat.normalize_slot_records: %s" % exc)
    try:
        cn.validate_ifname_prefix(settings.ifname_prefix, "ifname_prefix")
    except cn.CellNatError as exc:
        errors.append("cell_nat.validate_ifname_prefix: %s" % exc)
    if not role_accepts_ifname_prefix(settings.ifname_prefix):
        errors.append("cell_runtime.tasks.validate: chv_cell_ifname_prefix %r fails %s"
                      % (settings.ifname_prefix, role_ifname_prefix_check()))
    if records:  # a policy needs at least one slot
        policy = {"version": cell_policy.POLICY_VERSION, "slots": records}
        errors.extend("chv_cell.policy.validate: %s" % e for e in cell_policy.validate(policy))
    for rec in records:
        try:
            browser_policy.check_slot(rec["name"])
        except browser_policy.Refused as exc:
            errors.append("chv_browser.policy.check_slot(%r): %s" % (rec["name"], exc))
        argv = broker_server.sync_unit_argv(broker_server.DEFAULTS["sync"], rec["name"], "/w", rec["uid_base"],
                                            rec["uid_base"], {}, ["true"])
        unit = next(a for a in argv if a.startswith("--unit="))[len("--unit="):]
        if not _UNIT_NAME.fullmatch(unit) or len(unit + ".service") > 255:
            errors.append("chv_broker sync unit %r is not a valid systemd unit name" % unit)
    return errors


def refusing_consumers(errors):
    return sorted(set(re.match(r"[\w.]+", e).group(0) for e in errors))


_LOWER, _DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"


def _word(first, rest, max_rest):
    return st.builds(lambda a, b: a + b, st.sampled_from(first), st.text(rest, max_size=max_rest))


def _now_and_then_a_newline(strategy):
    """A trailing newline in about one draw of eight (`^...$` with re.match lets it through)."""
    return st.builds(lambda a, b: a + b, strategy, st.sampled_from([""] * 7 + ["\n"]))


# Addresses in and next to the loopback, link-local and multicast ranges
# (hypothesis's integers lean to small values and would seldom reach them).
_EDGE_ADDRESSES = [int(ipaddress.IPv4Address(a)) for a in (
    "10.200.0.0", "126.255.255.252", "127.0.0.0", "127.255.255.252", "128.0.0.0", "169.253.255.252",
    "169.254.0.0", "169.254.255.252", "169.255.0.0", "223.255.255.252", "224.0.0.0", "239.255.255.252",
    "240.0.0.0", "255.255.255.252")]


@st.composite
def pools(draw):
    plen = draw(st.integers(0, ci.MAX_PREFIX))
    address = draw(st.one_of(st.integers(0, 2 ** 32 - 1), st.sampled_from(_EDGE_ADDRESSES)))
    address &= (2 ** 32 - 1) ^ ((1 << (32 - plen)) - 1)
    return "%s/%d" % (ipaddress.IPv4Address(address), plen)


@st.composite
def allocator_inputs(draw):
    """Settings (some of which the allocator must refuse: loopback, link-local
    and multicast pools, shared uid 0, cell_ifname lo, ifname prefixes of 13-14
    characters, trailing newlines), slots (a count or names), host facts that
    push the indexes up, and optionally a second round with other settings
    (reassign=True) over the first ledger."""
    def settings():
        pool = draw(pools())
        plen = int(pool.split("/")[1])
        return dict(
            pool=pool,
            # chv-cell's validate builds the set of a subnet's host addresses:
            # a cell subnet shorter than /22 costs it milliseconds each (/8: minutes and
            # gigabytes), so the property stays at /22 or longer.
            prefix=draw(st.integers(max(plen, 22), ci.MAX_PREFIX)),
            uid_mode=draw(st.sampled_from(ci.UID_MODES)),
            shared_uid=draw(st.one_of(st.integers(0, ci.UID_MAX - ci.UID_RANGE_SIZE + 1),
                                      st.sampled_from([0, 1, 1000, ci.UID_MAX - ci.UID_RANGE_SIZE + 1]))),
            ifname_prefix=draw(_now_and_then_a_newline(_word(_LOWER, _LOWER + _DIGITS + "_-", ci.IFNAMSIZ_MAX - 2))),
            cell_ifname=draw(_now_and_then_a_newline(st.one_of(
                st.sampled_from(["eth0", "lo", "host0"]),
                _word(_LOWER + _LOWER.upper(), _LOWER + _DIGITS + "_.-", ci.IFNAMSIZ_MAX - 1)))),
            machine_prefix=draw(_now_and_then_a_newline(st.one_of(st.just(""), _word(_LOWER, _LOWER + _DIGITS + "-", 40)))),
        )
    first = settings()
    names = _now_and_then_a_newline(st.one_of(
        st.text(_LOWER, min_size=1, max_size=1),
        st.builds(lambda a, b, c: a + b + c, st.sampled_from(_LOWER),
                  st.text(_LOWER + _DIGITS + "-", max_size=29), st.sampled_from(_LOWER + _DIGITS))))
    slots = draw(st.one_of(st.integers(0, 12), st.lists(names, max_size=8, unique=True)))
    blocked = draw(st.lists(st.integers(0, 10 ** 6), max_size=4))
    second = settings() if draw(st.booleans()) else None
    return first, slots, blocked, second


def allocate(settings_kw, slots, blocked, ledger=None):
    """The allocator's records, or None when its own validation refuses the input."""
    try:
        settings = ci.Settings(**settings_kw)
        host = ci.HostFacts(ifnames=[settings.ifname_prefix + str(i) for i in blocked])
        result = ci.allocate(ledger, slots, settings, host, reassign=ledger is not None)
    except ci.AllocationError:
        return None, None, None
    return settings, result.ledger, result.identities()


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(allocator_inputs())
@example(({"machine_prefix": "chv-", "ifname_prefix": "chvh"}, 3, [], None))
@example(({"pool": "10.0.0.0/30", "prefix": 30, "ifname_prefix": "a" * 12, "machine_prefix": "m" * 33},
          ["s" * 31], [10 ** 2], None))
def test_every_record_the_allocator_makes_is_accepted_by_every_consumer(inputs):
    first, slots, blocked, second = inputs
    settings, ledger, records = allocate(first, slots, blocked)
    assume(records is not None)
    rounds = [(settings, records)]
    if second is not None:
        settings2, _ledger2, records2 = allocate(second, slots, blocked, ledger)
        if records2 is not None:
            rounds.append((settings2, records2))
    for settings, records in rounds:
        assert consumer_errors(settings, records) == [], records


# What a consumer refuses, the allocator refuses itself, naming the option and the value.
@pytest.mark.parametrize("settings_kw,slots,param,text", [
    ({"ifname_prefix": "a" * 13}, 2, "ifname_prefix", "ifname_prefix %r" % ("a" * 13)),
    ({"ifname_prefix": "a" * 14}, 2, "ifname_prefix", "ifname_prefix %r" % ("a" * 14)),
    ({"cell_ifname": "lo"}, 2, "cell_ifname", "cell_ifname 'lo'"),
    ({"pool": "127.0.0.0/8"}, 2, "pool", "pool '127.0.0.0/8' overlaps 127.0.0.0/8, the loopback range"),
    ({"pool": "169.254.0.0/16"}, 2, "pool", "pool '169.254.0.0/16' overlaps 169.254.0.0/16, the link-local range"),
    ({"pool": "169.254.128.0/24"}, 2, "pool", "pool '169.254.128.0/24' overlaps 169.254.0.0/16"),
    ({"pool": "224.0.0.0/4"}, 2, "pool", "pool '224.0.0.0/4' overlaps 224.0.0.0/4, the multicast range"),
    ({"pool": "239.1.0.0/16"}, 2, "pool", "pool '239.1.0.0/16' overlaps 224.0.0.0/4"),
    ({"pool": "0.0.0.0/0"}, 2, "pool", "pool '0.0.0.0/0' overlaps 127.0.0.0/8"),
    ({"uid_mode": "shared", "shared_uid": 0}, 2, "shared_uid", "shared_uid 0"),
    ({}, ["slot\n"], "slots", "'slot\\n'"),
    ({"machine_prefix": "chv-\n"}, 2, "machine_prefix", "machine_prefix 'chv-\\n'"),
    ({"ifname_prefix": "chvh\n"}, 2, "ifname_prefix", "ifname_prefix 'chvh\\n'"),
    ({"cell_ifname": "eth0\n"}, 2, "cell_ifname", "cell_ifname 'eth0\\n'"),
    ({"machine_prefix": "m" * 34}, ["s" * 31], "machine_prefix", "longer than 64 characters"),
])
def test_the_allocator_refuses_what_a_consumer_refuses(settings_kw, slots, param, text):
    with pytest.raises(ci.AllocationError) as err:
        ci.allocate(None, slots, ci.Settings(**settings_kw), ci.HostFacts())
    assert err.value.param == param
    assert text in str(err.value)


def test_the_allocator_accepts_the_edges_next_to_them():
    """Controls for the refusals above: the closest accepted values pass every consumer."""
    edges = [({"ifname_prefix": "a" * 12}, 2), ({"cell_ifname": "lo0"}, 2), ({}, ["slot"]),
             ({"uid_mode": "shared", "shared_uid": 1}, 2), ({"uid_mode": "per_slot", "shared_uid": 0}, 2)]
    edges += [({"pool": pool, "prefix": 26}, 2) for pool in (
        "126.255.255.0/24", "128.0.0.0/24", "169.253.255.0/24", "169.255.0.0/24", "223.255.255.0/24")]
    for settings_kw, slots in edges:
        settings, _ledger, records = allocate(settings_kw, slots, [])
        assert records is not None, settings_kw
        assert consumer_errors(settings, records) == [], settings_kw


def test_a_64_character_machine_name_is_accepted_by_every_consumer():
    settings, _ledger, records = allocate({"machine_prefix": "m" * 33}, ["s" * 31], [])
    assert [len(r["machine"]) for r in records] == [ci.MACHINE_NAME_MAX] == [64]  # systemd's HOST_NAME_MAX
    assert consumer_errors(settings, records) == []


def test_the_ifname_prefix_limit_is_one_number():
    """The allocator, cell_nat and the cell_runtime role accept exactly the same
    prefix lengths, and with the longest one, indexes up to 999 fit in IFNAMSIZ-1."""
    verdicts = {}
    for n in range(1, ci.IFNAMSIZ_MAX + 2):
        prefix = "a" * n
        try:
            ci.Settings(ifname_prefix=prefix)
            allocator = True
        except ci.AllocationError:
            allocator = False
        try:
            cn.validate_ifname_prefix(prefix, "ifname_prefix")
            nat = True
        except cn.CellNatError:
            nat = False
        verdicts[n] = (allocator, nat, role_accepts_ifname_prefix(prefix))
    assert verdicts == {n: (n <= ci.IFNAME_PREFIX_MAX,) * 3 for n in verdicts}
    assert ci.IFNAME_PREFIX_MAX == 12
    assert len(ci.Settings(ifname_prefix="a" * 12).host_ifname(999).encode()) == ci.IFNAMSIZ_MAX


def _with_subnet(rec, subnet):
    net = ipaddress.ip_network(subnet)
    return dict(rec, subnet=str(net), gateway=str(net[1]), address=str(net[2]), prefixlen=net.prefixlen)


_NAT, _CELL = "cell_nat.normalize_slot_records", "chv_cell.policy.validate"


@pytest.mark.parametrize("mutate,refused_by", [
    (lambda r: dict(r, machine="m" * 65), [_CELL]),
    (lambda r: dict(r, cell_ifname="lo"), [_CELL]),
    (lambda r: _with_subnet(r, "127.0.0.0/24"), [_CELL]),
    (lambda r: _with_subnet(r, "169.254.0.0/24"), [_NAT, _CELL]),
    (lambda r: _with_subnet(r, "224.0.0.0/24"), [_CELL]),
    (lambda r: dict(r, uid_base=0), [_NAT, _CELL]),
    (lambda r: dict(r, name=r["name"] + "\n"), ["chv_broker", "chv_browser.policy.check_slot", _NAT, _CELL]),
    (lambda r: dict(r, machine=r["machine"] + "\n"), [_CELL]),
    (lambda r: dict(r, host_ifname=r["host_ifname"] + "\n"), [_NAT, _CELL]),
    (lambda r: dict(r, cell_ifname=r["cell_ifname"] + "\n"), [_CELL]),
])
def test_the_consumers_still_refuse_what_they_must(mutate, refused_by):
    """The consumers keep their own checks: a record the allocator no longer
    makes, put into an allocated table, is refused by them."""
    settings, _ledger, records = allocate({}, 2, [])
    assert consumer_errors(settings, records) == []  # control
    records[0] = mutate(records[0])
    assert refusing_consumers(consumer_errors(settings, records)) == sorted(refused_by)


@pytest.mark.parametrize("prefix,refused_by", [
    ("a" * 13, ["cell_nat.validate_ifname_prefix", "cell_runtime.tasks.validate"]),
    ("a" * 14, ["cell_nat.validate_ifname_prefix", "cell_runtime.tasks.validate"]),
    # the role's check is a length check: the allocator (the role's next step) refuses the newline
    ("chvh\n", ["cell_nat.validate_ifname_prefix"]),
])
def test_the_consumers_still_refuse_a_long_or_multiline_ifname_prefix(prefix, refused_by):
    settings, _ledger, records = allocate({}, 2, [])
    settings.ifname_prefix = prefix
    assert refusing_consumers(consumer_errors(settings, records)) == sorted(refused_by)


def test_defaults_are_accepted_by_every_consumer():
    settings, _ledger, records = allocate({}, 4, [])
    assert [r["name"] for r in records] == ["slot0", "slot1", "slot2", "slot3"]
    assert consumer_errors(settings, records) == []


# --------------------------------------------- 2. what cells must never see

def _resolve(value, variables, depth=0):
    """Resolve plain "{{ var }}" references (no filters) in a role default."""
    if not isinstance(value, str) or "{{" not in value:
        return value
    assert depth < 10, value

    def one(match):
        name = match.group(1)
        assert name in variables, "%s: only plain references to role defaults are resolved here" % value
        return str(_resolve(variables[name], variables, depth + 1))
    resolved = re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", one, value)
    assert "{{" not in resolved and "{%" not in resolved, value
    return resolved


def browser_and_broker_install_paths():
    browser = role_defaults("browser")  # door_default resolved: the services' own defaults
    broker = role_defaults("broker")
    paths = {
        "chv_browser_home": browser["chv_browser_home"],
        "chv_browser_venv": browser["chv_browser_venv"],
        "chv_browser code": browser["chv_browser_install_dir"] + "/chv_guest/browser",
        "chv-browser entry point": browser["chv_browser_install_dir"] + "/chv-browser",
        "chv_browser_state_dir": browser["chv_browser_state_dir"],
        "chv-browser runtime dir": os.path.dirname(browser["chv_browser_socket_path"]),
        "chv_browser_shots_dir": browser["chv_browser_shots_dir"],
        # the distribution's chromium (chv_browser_executable_path "" drives it)
        "chromium": role_yaml("browser", "vars", "Debian")["__browser_chromium"],
        # Debian's chromium package: /usr/bin/chromium is a wrapper of this tree
        "chromium's tree": "/usr/lib/chromium",
        "chv-broker credentials dir": os.path.dirname(broker["chv_broker_sync_credentials_file"]),
    }
    return {k: _resolve(v, dict(browser, **broker)) for k, v in paths.items()}


def hidden(path, inaccessible):
    return any(cell_policy.is_under(path, entry) for entry in inaccessible)


def test_inaccessible_default_hides_the_browser_and_the_broker_credentials():
    defaults = role_yaml("cell_runtime")
    inaccessible = role_yaml("cell_runtime", "vars", "Debian")["__cell_runtime_inaccessible_platform"] + [
        _resolve(p, defaults) for p in defaults["chv_cell_inaccessible_default"]]
    paths = browser_and_broker_install_paths()
    assert all(p.startswith("/") for p in paths.values()), paths
    assert {k: p for k, p in paths.items() if not hidden(p, inaccessible)} == {}
    # control: the check sees a path that is missing from the list
    assert not hidden(paths["chv_browser_state_dir"],
                      [p for p in inaccessible if not cell_policy.is_under(paths["chv_browser_state_dir"], p)])
    assert hidden("/etc/chv/broker", ["/etc/chv"]) and not hidden("/etc/chv-fleet", ["/etc/chv"])


# -------------------------------------------------- 3. the lab's baked image

# mmdebstrap --variant=minbase (lab/plugins/modules/lab_image.py) installs every
# Essential: yes package, so a role may list one that the image never needs baked.
MINBASE_ESSENTIAL = frozenset(["util-linux"])


def role_packages():
    """What each role installs on Debian with its defaults: the platform's list and the public extras."""
    return {
        "cell_runtime": role_yaml("cell_runtime", "vars", "Debian")["__cell_runtime_packages"]
        + role_yaml("cell_runtime")["chv_cell_packages"],
        "cell_nat": role_yaml("cell_nat", "vars", "Debian")["__cell_nat_packages"],
        "broker": role_yaml("broker", "vars", "Debian")["__broker_packages"] + role_yaml("broker")["chv_broker_packages"],
        "browser": role_yaml("browser", "vars", "Debian")["__browser_packages"]
        + role_yaml("browser")["chv_browser_packages"],
    }


def test_lab_bakes_exactly_what_the_roles_install():
    lists = role_packages()
    assert all(isinstance(v, list) and v for v in lists.values()), lists
    needed = set().union(*lists.values()) - set(lab.BASE_PACKAGES) - MINBASE_ESSENTIAL
    baked = set(yaml_file(os.path.join(LAB_ROLE, "defaults", "main.yml"))["lab_role_packages"]) - set(lab.BASE_PACKAGES)
    assert sorted(needed - baked) == [], "a role installs it, the baked image lacks it"
    assert sorted(baked - needed) == [], "baked into the image, no role installs it"
    # the exemption is for packages a role really lists and the image has without baking
    assert MINBASE_ESSENTIAL <= set().union(*lists.values()) - set(lab.BASE_PACKAGES)


# -------------------------------------------------- 4. what a role masks, the uninstall unmasks

def masked_by_tasks(role):
    """The unit names the role's task files mask (systemd_service with masked: true), blocks included."""
    out = set()
    tasks_dir = os.path.join(ROLES, role, "tasks")
    for name in os.listdir(tasks_dir):
        for task in walk_tasks(yaml_file(os.path.join(tasks_dir, name))):
            mod = task.get("ansible.builtin.systemd_service") or task.get("ansible.builtin.systemd") or {}
            if isinstance(mod, dict) and mod.get("masked") is True:
                out.add(mod["name"])
    return out


def test_the_uninstall_unmasks_every_unit_a_role_masks():
    masked = {role: masked_by_tasks(role) for role in sorted(os.listdir(ROLES))
              if os.path.isdir(os.path.join(ROLES, role, "tasks"))}
    assert masked["cell_nat"] == {"squid.service"}  # control: the walk finds the proxy mode's mask
    for role, units in masked.items():
        owned = (role_yaml(role, "vars").get("__%s_owned" % role.lstrip("_")) or {}) if units else {}
        assert units <= set(owned.get("masked_units", [])), (role, units, owned.get("masked_units"))
    with open(os.path.join(ROOT, "playbooks", "remove.yml"), encoding="utf-8") as fh:
        assert "map(attribute='masked_units'" in fh.read()


# -------------------------------------------------- 5. the fleet plays run linear, whatever ansible.cfg says

def test_every_play_of_the_collection_pins_the_linear_strategy():
    """The failure thresholds of site.yml, remove.yml, audit.yml and check.yml
    (max_fail_percentage, any_errors_fatal) hold only under the linear
    strategy (ansible-core's free strategy ignores both, with a warning):
    every play of playbooks/ sets `strategy: linear`, so that `strategy` in
    ansible.cfg or ANSIBLE_STRATEGY cannot turn them off
    (molecule/shared/tests/test_fleet.py runs the bad-value rollout with
    ANSIBLE_STRATEGY=free)."""
    plays, unpinned = [], []
    for name in sorted(os.listdir(os.path.join(ROOT, "playbooks"))):
        if name.endswith(".yml"):
            for play in yaml_file(os.path.join(ROOT, "playbooks", name)):
                if "hosts" in play:
                    plays.append((name, play["name"]))
                    if play.get("strategy") != "linear":
                        unpinned.append((name, play["name"]))
    # control: the walk finds the plays of the five playbooks, the thresholds' plays among them
    assert {n for n, _ in plays} == {"audit.yml", "check.yml", "remove.yml", "site.yml", "validate.yml"}, plays
    assert ("validate.yml", "Validate every targeted host before the first change") in plays
    assert unpinned == []
