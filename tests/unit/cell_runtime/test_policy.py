import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chv_guest.cell import cli
from chv_guest.cell import policy as policymod
import copy

from cellrt import BASE_POLICY, ENTRY, make_slot


def errors_of(p):
    return "\n".join(policymod.validate(p))


def assert_rejected(p, expected):
    errs = errors_of(p)
    assert expected in errs, errs


def test_base_policy_valid(raw_policy):
    assert policymod.validate(raw_policy) == []


def test_defaults_alone_need_slots():
    assert "slots" in errors_of({"version": 1})


def test_merged_fills_defaults(raw_policy):
    raw_policy.pop("tmpfs", None)
    m = policymod.merged(raw_policy)
    assert m["tmpfs"] == ["/tmp"]
    assert m["no_new_privileges"] is True
    assert set(m["drop_capabilities"]) >= policymod.REQUIRED_DROPPED_CAPS


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda p: p.update(version=2), "version"),
        (lambda p: p.update(bogus=1), "unknown keys: bogus"),
        (lambda p: p.update(drop_capabilities=["CAP_SYS_ADMIN"]), "must include CAP_MKNOD"),
        (lambda p: p.update(drop_capabilities=sorted(policymod.REQUIRED_DROPPED_CAPS) + ["CAP_FOO"]), "unknown capability"),
        (lambda p: p.update(syscall_deny=["io_uring_setup"]), "must include io_uring_enter"),
        (lambda p: p.update(syscall_deny=sorted(policymod.REQUIRED_DENIED_SYSCALLS) + ["@mount"]), "groups only widen"),
        (lambda p: p.update(no_new_privileges=False), "always run with no_new_privileges"),
        (lambda p: p.update(scope="docker"), "scope"),
        (lambda p: p.update(inaccessible=["relative/path"]), "inaccessible"),
        (lambda p: p.update(readonly_binds=[{"source": "/run/chv-fleet", "target": "/x"}]), "would expose /run/chv-fleet"),
        (lambda p: p.update(readonly_binds=[{"source": "/run", "target": "/x"}]), "would expose /run/chv-fleet"),
        (lambda p: p.update(readonly_binds=[{"source": "/etc", "target": "/x"}]), "would expose /etc/chv"),
        (lambda p: p.update(readonly_binds=[{"source": "/srv/a:b", "target": "/x"}]), "without ':'"),
        (lambda p: p.update(readonly_binds=[{"source": "/srv/a", "target": "/usr"}]), "system tree"),
        (lambda p: p.update(readonly_binds=[{"source": "/srv/a", "target": "/x", "mode": 1}]), "unknown keys"),
        (lambda p: p.update(writable_binds=[{"source": "/home", "target": "/home"}]), "must not be writable"),
        (lambda p: p.update(workspace_mount="/usr"), "workspace_mount"),
        (lambda p: p.update(workspace_root="/run/chv-fleet-unit/ws"), "must not overlap state_dir"),
        (lambda p: p.update(setenv={"CHV_CELL": "0"}), "CHV_CELL is always 1"),
        (lambda p: p.update(setenv={"BAD-NAME": "x"}), "not a valid environment"),
        (lambda p: p.update(setenv={"A": "x\ny"}), "single-line"),
        (lambda p: p.update(properties={"memorymax": "1G"}), "not a valid unit property"),
        (lambda p: p.update(nspawn_environment={"SYSTEMD_NSPAWN_API_VFS_WRITABLE": "1"}), "is not allowed"),
        (lambda p: p.update(rlimits={"NOFILES": "1"}), "unknown limit"),
        (lambda p: p.update(rlimits={"NOFILE": "lots"}), "must be N, infinity"),
        (lambda p: p.update(dns_servers=["127.0.0.53"]), "not reachable from a cell"),
        (lambda p: p.update(dns_servers=["dns.example"]), "not an IP address"),
        (lambda p: p.update(claim_timeout=-1), "claim_timeout"),
        (lambda p: p.update(start_timeout=True), "start_timeout"),
        (lambda p: p.update(slots=[]), "non-empty list"),
        (lambda p: p["slots"][0].pop("gateway"), "missing gateway"),
        (lambda p: p["slots"][0].update(uid_base="1000"), "wrong type for uid_base"),
        (lambda p: p["slots"][0].update(uid_base=0), "cell root must never be host root"),
        (lambda p: p["slots"][0].update(host_ifname="a-very-long-ifname"), "1-15 characters"),
        (lambda p: p["slots"][0].update(cell_ifname="lo"), "must not be lo"),
        (lambda p: p["slots"][1].update(host_ifname="lth0"), "host_ifname 'lth0' also used"),
        (lambda p: p["slots"][1].update(name="slot0"), "name 'slot0' also used"),
        (lambda p: p["slots"][0].update(machine="bad_name"), "not a valid machine name"),
        (lambda p: p["slots"][0].update(prefixlen=16), "does not match subnet"),
        (lambda p: p["slots"][0].update(address="10.231.99.2"), "not a host address"),
        (lambda p: p["slots"][0].update(address="10.231.10.1"), "gateway and address are both"),
        (lambda p: p["slots"][0].update(gateway="10.231.10.0"), "not a host address"),
        (lambda p: p["slots"][1].update(subnet="10.231.10.0/23", prefixlen=23, gateway="10.231.10.1",
                                        address="10.231.11.2"), "overlaps"),
        (lambda p: p["slots"][1].update(uid_base=3000000 + 1000), "overlap partially"),
        (lambda p: p["slots"][0].update(subnet="127.0.0.0/24", gateway="127.0.0.1", address="127.0.0.2"), "not usable"),
        (lambda p: p["slots"][0].update(subnet="169.254.3.0/24", gateway="169.254.3.1", address="169.254.3.2"), "not usable"),
        (lambda p: p["slots"][0].update(subnet="224.0.3.0/24", gateway="224.0.3.1", address="224.0.3.2"), "not usable"),
        (lambda p: p["slots"][0].update(machine="m" * 65), "machine %r is not a valid" % ("m" * 65)),
        # a trailing newline passes `^...$` with re.match: the patterns end in \Z
        (lambda p: p["slots"][0].update(name="slot0\n"), "name must match"),
        (lambda p: p["slots"][0].update(machine="lt-slot0\n"), "not a valid machine name"),
        (lambda p: p["slots"][0].update(host_ifname="lth0\n"), "host_ifname 'lth0\\n' must be 1-15 characters"),
        (lambda p: p["slots"][0].update(cell_ifname="eth0\n"), "cell_ifname 'eth0\\n' must be 1-15 characters"),
        (lambda p: p.update(agent_user="chv\n"), "must be a user name"),
        (lambda p: p.update(setenv={"A\n": "x"}), "not a valid environment"),
    ],
)
def test_rejects(raw_policy, mutate, expected):
    mutate(raw_policy)
    assert_rejected(raw_policy, expected)


def test_a_64_character_machine_name_is_valid(raw_policy):
    """systemd's machine names (nspawn --machine, hostname_is_valid) go up to HOST_NAME_MAX, 64."""
    raw_policy["slots"][0]["machine"] = "m" * 64
    assert policymod.validate(raw_policy) == []


def test_shared_uid_mode_is_valid(raw_policy):
    for s in raw_policy["slots"]:
        s["uid_base"], s["uid_size"] = 1000, 65536
    assert policymod.validate(raw_policy) == []


def test_slot_placeholder_in_binds(raw_policy):
    raw_policy["readonly_binds"].append({"source": "/run/chv/shots/{slot}", "target": "/run/chv/shots/{slot}", "optional": True})
    assert policymod.validate(raw_policy) == []


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=12), third=st.integers(min_value=0, max_value=200),
       shift=st.integers(min_value=1, max_value=1000))
def test_generated_slot_tables_valid(n, third, shift):
    raw_policy = copy.deepcopy(BASE_POLICY)
    raw_policy["slots"] = [make_slot(i, base=third % 40, uid_base=shift * 65536 + i * 65536) for i in range(n)]
    assert policymod.validate(raw_policy) == []


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=2, max_value=6), a=st.integers(0, 5), b=st.integers(0, 5))
def test_duplicate_subnets_always_rejected(n, a, b):
    raw_policy = copy.deepcopy(BASE_POLICY)
    raw_policy["slots"] = [make_slot(i) for i in range(n)]
    a, b = a % n, b % n
    if a == b:
        return
    for k in ("subnet", "gateway", "address"):
        raw_policy["slots"][b][k] = raw_policy["slots"][a][k]
    assert "overlaps" in errors_of(raw_policy)


def test_load_reports_unreadable_and_bad_json(tmp_path):
    with pytest.raises(policymod.PolicyError) as e:
        policymod.load(str(tmp_path / "missing.json"))
    assert "cannot read" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(policymod.PolicyError) as e:
        policymod.load(str(bad))
    assert "not valid JSON" in str(e.value)


def test_validate_policy_command(tmp_path, raw_policy, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(raw_policy))
    assert cli.main(["validate-policy", str(good)]) == 0
    raw_policy["slots"][0]["uid_base"] = 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw_policy))
    assert cli.main(["validate-policy", str(bad)]) == 78
    assert "cell root must never be host root" in capsys.readouterr().err


def test_entry_script_runs_isolated(tmp_path, raw_policy):
    """The installed entry point (python3 -I) finds its package by realpath."""
    good = tmp_path / "p.json"
    good.write_text(json.dumps(raw_policy))
    link = tmp_path / "chv-cell"
    link.symlink_to(ENTRY)
    r = subprocess.run([sys.executable, "-I", str(link), "validate-policy", str(good)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "valid, 2 slot(s)" in r.stdout


# ---------------------------------------------------------------- fail-closed keys (issue 10)
def test_fail_closed_defaults():
    m = policymod.merged({})
    assert m["nft"] == "/usr/sbin/nft"
    assert m["require_ruleset"] is True and m["require_limits"] is True
    assert m["allow_user_namespaces"] is False and m["allow_shared_network"] is False
    assert m["runtime_max"] == 0
    assert "CAP_SYS_RESOURCE" in m["drop_capabilities"]  # the defaults satisfy their own rule


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"nft": "nft"}, "nft: 'nft' must be an absolute"),
        ({"require_ruleset": "yes"}, "require_ruleset: must be a boolean"),
        ({"require_limits": 1}, "require_limits: must be a boolean"),
        ({"allow_user_namespaces": "false"}, "allow_user_namespaces: must be a boolean"),
        ({"allow_shared_network": None}, "allow_shared_network: must be a boolean"),
        ({"runtime_max": -1}, "runtime_max: must be a number"),
        ({"runtime_max": True}, "runtime_max: must be a number"),
        ({"runtime_max": "60"}, "runtime_max: must be a number"),
        ({"runtime_max": 10 ** 9}, "runtime_max: must be a number"),
        ({"properties": {"IOWeight": 100}}, "IOWeight is not a property the launcher can map"),
        ({"properties": {"MemoryMax": "lots"}}, "MemoryMax=lots: expected bytes"),
    ],
)
def test_rejects_fail_closed_keys(raw_policy, changes, expected):
    raw_policy.update(changes)
    assert_rejected(raw_policy, expected)


def test_unmappable_property_allowed_only_without_require_limits(raw_policy):
    raw_policy["properties"] = {"IOWeight": 100, "MemoryMax": "10%"}
    assert "IOWeight" in errors_of(raw_policy)
    raw_policy["require_limits"] = False
    assert policymod.validate(raw_policy) == []


def test_user_namespaces_off_needs_cap_sys_resource_dropped(raw_policy):
    caps = sorted(policymod.REQUIRED_DROPPED_CAPS)
    raw_policy["drop_capabilities"] = caps
    assert "must include CAP_SYS_RESOURCE while allow_user_namespaces is false" in errors_of(raw_policy)
    raw_policy["drop_capabilities"] = caps + ["CAP_SYS_RESOURCE"]
    assert policymod.validate(raw_policy) == []
    # control: with nested user namespaces allowed, the capability may stay
    raw_policy["drop_capabilities"] = caps
    raw_policy["allow_user_namespaces"] = True
    assert policymod.validate(raw_policy) == []


def test_fail_closed_keys_valid_when_set(raw_policy):
    raw_policy.update(nft="/usr/local/sbin/nft", require_ruleset=False, require_limits=False,
                      allow_user_namespaces=True, allow_shared_network=True, runtime_max=3600.5)
    assert policymod.validate(raw_policy) == []


@pytest.mark.parametrize(
    "policy_max, requested, result",
    [(0, None, 0), (0, 5, 5), (0, 0.5, 0.5), (60, None, 60), (60, 30, 30), (60, 60, 60), (60, 0.1, 0.1)],
)
def test_effective_runtime_max(policy_max, requested, result):
    assert policymod.effective_runtime_max(policy_max, requested) == result


@pytest.mark.parametrize(
    "policy_max, requested, message",
    [
        (60, 61, "exceeds the policy's runtime_max of 60s (role variable chv_cell_runtime_max)"),
        (60, 0, "a run may only lower that"),
        (0, 0, "must be > 0"),
        (0, -3, "must be > 0"),
        (60, float("nan"), "must be a number"),
        (60, True, "must be a number"),
    ],
)
def test_effective_runtime_max_refuses(policy_max, requested, message):
    with pytest.raises(ValueError) as e:
        policymod.effective_runtime_max(policy_max, requested)
    assert message in str(e.value)


@settings(max_examples=100, deadline=None)
@given(policy_max=st.integers(min_value=0, max_value=10 ** 6), requested=st.floats(min_value=0.001, max_value=10 ** 7))
def test_runtime_max_can_only_be_lowered(policy_max, requested):
    try:
        got = policymod.effective_runtime_max(policy_max, requested)
    except ValueError:
        assert policy_max and requested > policy_max
    else:
        assert got == requested and (policy_max == 0 or got <= policy_max)


# ---------------------------------------------------------------- the agent's paths
AGENT = {"agent_state_mount": "/home/chv", "workspace_aliases": ["/home/chv/workspace"]}


def test_agent_keys_default_and_role_shape_valid(raw_policy):
    m = policymod.merged(raw_policy)
    assert (m["agent_user"], m["agent_home"], m["workspace_aliases"]) == ("chv", "/home/chv", [])
    raw_policy.update(AGENT)
    assert policymod.validate(raw_policy) == []


# workspace_aliases the policy refuses: the message, then every alias list that gets it
WORKSPACE_ALIAS_REFUSALS = [
    ("workspace_aliases[0]: 'rel/ws' must be an absolute", [["rel/ws"]]),
    ("workspace_aliases[0]: '/' must be", [["/"]]),
    ("must be an absolute normalised path", [["/home/chv/w:x"]]),
    ("inside the system tree /usr", [["/usr/local/ws"]]),
    ("inside the system tree /run", [["/run/ws"]]),
    ("inside the system tree /etc", [["/etc"]]),
    ("collides with workspace_mount /workspace", [["/workspace"], ["/workspace/again"]]),
    ("collides with tmpfs /tmp", [["/tmp/ws"]]),
    ("collides with bind target /app", [["/app"], ["/app/sub"]]),
    ("would hide the agent_state_mount /home/chv", [["/home/chv"], ["/home"]]),
    ("workspace_aliases[1]: /srv/ws collides with workspace_aliases[0]", [["/srv/ws", "/srv/ws"]]),
    ("collides with workspace_aliases[0] /srv/ws", [["/srv/ws", "/srv/ws/in"]]),
]


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"agent_user": "Root Admin"}, "agent_user: 'Root Admin' must be a user name"),
        ({"agent_user": 1000}, "agent_user: 1000 must be a user name"),
        ({"agent_home": "home/chv"}, "agent_home: 'home/chv' must be an absolute"),
        ({"agent_home": "/etc/chv"}, "agent_home: '/etc/chv' must be an absolute normalised path outside"),
        ({"agent_home": "/"}, "agent_home: '/' must be"),
        ({"workspace_aliases": "/home/chv/workspace"}, "workspace_aliases: must be a list"),
    ] + [({"workspace_aliases": aliases}, expected) for expected, many in WORKSPACE_ALIAS_REFUSALS for aliases in many] + [
        ({"setenv": {"HOME": "/root"}}, "setenv: HOME is set from agent_user/agent_home"),
        ({"setenv": {"USER": "root"}}, "setenv: USER is set from"),
        ({"setenv": {"LOGNAME": "root"}}, "setenv: LOGNAME is set from"),
    ],
)
def test_agent_keys_refused(raw_policy, extra, expected):
    raw_policy.update(AGENT)
    raw_policy.update(extra)
    assert expected in errors_of(raw_policy)


@pytest.mark.parametrize("aliases", [["/home/chv/workspace"], ["/home/chv/a/b", "/srv/ws"], ["/home/other"], []])
def test_agent_aliases_allowed(raw_policy, aliases):
    raw_policy.update(AGENT, workspace_aliases=aliases)
    assert policymod.validate(raw_policy) == []


@pytest.mark.parametrize("state_dir", [None, 7, "relative", ["/run/x"]])
def test_a_state_dir_that_is_not_a_path_is_reported_not_a_crash(raw_policy, state_dir):
    """Found by the fuzz run (tests/unit/test_protocol_fuzz.py): the binds'
    check compared paths against state_dir before its type was checked."""
    raw_policy["state_dir"] = state_dir
    errors = policymod.validate(raw_policy)
    assert any(e.startswith("state_dir: ") for e in errors), errors
