import copy
import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chv_guest.cell import argv as argvmod
from chv_guest.cell import cli
from chv_guest.cell import policy as policymod
from cellrt import BASE_POLICY

NONE = frozenset()


def facts(existing=NONE, scope="standalone", shared=False):
    return argvmod.HostFacts(scope=scope, existing=frozenset(existing), shared_network=shared)


def build(policy, slot=0, cmd=("true",), **kw):
    return argvmod.build_argv(policy, policy["slots"][slot], list(cmd), facts(**kw))


def opts(argv):
    """Options before the `--` that ends nspawn's options."""
    return argv[: argv.index("--")]


def test_core_flags(policy):
    a = opts(build(policy))
    for flag in (
        "--directory=/",
        "--volatile=yes",
        "--as-pid2",
        "--pipe",
        "--quiet",
        "--machine=lt-slot0",
        "--register=no",
        "--keep-unit",
        "--private-users=3000000:65536",
        "--private-users-ownership=off",
        "--no-new-privileges=yes",
        "--system-call-filter=~io_uring_enter io_uring_register io_uring_setup",
        "--link-journal=no",
        "--resolv-conf=off",
        "--bind-ro=/etc",
        "--tmpfs=/tmp:mode=1777",
        "--setenv=CHV_CELL=1",
        "--setenv=CHV_SLOT=slot0",
        "--private-network",
        "--network-veth-extra=lth0:eth0",
        "--chdir=/workspace",
        "--rlimit=RLIMIT_NOFILE=4096:8192",
    ):
        assert flag in a, flag
    caps = next(x for x in a if x.startswith("--drop-capability="))
    assert set(caps.split("=", 1)[1].split(",")) >= {
        "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_ADMIN", "CAP_NET_RAW",
        "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_BOOT", "CAP_MKNOD",
    }


def test_slot_identity_flows_in(policy):
    a = opts(build(policy, slot=1))
    assert "--private-users=3065536:65536" in a
    assert "--network-veth-extra=lth1:eth0" in a
    assert "--machine=lt-slot1" in a
    assert "--bind=/nonexistent/ws/slot1:/workspace" in a
    assert "--bind=/nonexistent/state/slot1:/root" in a
    assert "--bind-ro=/run/chv-fleet-unit/net/slot1/resolv.conf:/etc/resolv.conf" in a
    assert "--bind-ro=/run/chv-fleet-unit/net/slot1/hosts:/etc/hosts" in a
    assert "--bind-ro=/run/chv-fleet-unit/gate/slot1:/run/chv-gate" in a


def test_command_runs_behind_gate(policy):
    a = build(policy, cmd=["sh", "-c", "echo 'x y'", "--weird"])
    tail = a[a.index("--") + 1:]
    assert tail[:2] == ["/bin/sh", "-c"]
    assert "3</run/chv-gate;" in tail[2] and "read -r chv_g <&3" in tail[2] and 'exec "$@" 3<&-' in tail[2]
    assert tail[3:] == ["chv-gate", "sh", "-c", "echo 'x y'", "--weird"]


def test_state_dir_itself_never_bound(policy):
    """Only the three per-cell files are bound out of the state dir, read-only."""
    for x in opts(build(policy)):
        if "/run/chv-fleet-unit" in x:
            assert x.startswith("--bind-ro=/run/chv-fleet-unit/")
            src = x.split("=", 1)[1].split(":")[0]
            assert src.rsplit("/", 1)[1] in ("resolv.conf", "hosts", "slot0")


def test_optional_binds_only_when_present(policy):
    assert not any(x.startswith("--bind-ro=/app") for x in build(policy))
    a = build(policy, existing={"/app"})
    assert "--bind-ro=/app" in a


def test_inaccessible_only_for_visible_existing_paths(policy):
    # nothing exists: nspawn would fail on a missing --inaccessible path
    assert not any(x.startswith("--inaccessible") for x in build(policy))
    a = build(policy, existing={"/etc/chv", "/usr/lib/chromium", "/opt/chv-browser", "/root/.git-credentials"})
    hidden = [x.split("=", 1)[1] for x in a if x.startswith("--inaccessible=")]
    # /opt and the host's /root are not in the cell at all (volatile root):
    # nothing to hide, and nspawn would refuse the path.
    assert hidden == ["/etc/chv", "/usr/lib/chromium"]


def test_inaccessible_follows_binds(policy):
    # /root in the cell is the slot's agent state dir, so a credential file
    # there is hidden when it exists in that dir (and only then).
    a = build(policy, existing={"/nonexistent/state/slot0/.git-credentials"})
    assert "--inaccessible=/root/.git-credentials" in a


def test_inaccessible_after_binds(policy):
    a = build(policy, existing={"/etc/chv"})
    assert a.index("--inaccessible=/etc/chv") > a.index("--bind-ro=/etc")


def test_host_path_of(policy):
    s = policy["slots"][0]
    assert argvmod.host_path_of("/etc/chv/x", policy, s) == "/etc/chv/x"
    assert argvmod.host_path_of("/workspace/a", policy, s) == "/nonexistent/ws/slot0/a"
    assert argvmod.host_path_of("/opt/x", policy, s) is None
    assert argvmod.host_path_of("/etc/ssl/certs/a.pem", policy, s) == "/etc/ssl/certs/a.pem"
    # an optional bind that is not mounted does not shadow anything
    assert argvmod.host_path_of("/app/x", policy, s, existing=frozenset()) is None
    assert argvmod.host_path_of("/app/x", policy, s, existing=frozenset({"/app"})) == "/app/x"


def test_shared_network_is_explicit(policy):
    a = opts(build(policy, shared=True))
    assert "--private-network" not in a
    assert not any("network-veth" in x for x in a)
    assert not any(x.endswith(":/etc/resolv.conf") for x in a)
    assert "--network-veth-extra=lth0:eth0" in opts(build(policy, shared=False))


def test_standalone_has_no_unit_properties(policy):
    # without a scope nspawn would ignore them (and say so): never pretend
    a = build(policy, scope="standalone")
    assert a[0] == "/usr/bin/systemd-nspawn"
    assert not any(x.startswith("--property") for x in a)


def test_systemd_scope_wraps_nspawn_in_a_unique_transient_scope(policy):
    a = argvmod.build_argv(policy, policy["slots"][1], ["true"],
                           argvmod.HostFacts(scope="systemd", existing=NONE, shared_network=False, run_id="4242"))
    i = a.index("/usr/bin/systemd-nspawn")
    head, nspawn = a[:i], opts(a[i:])
    assert head == ["/usr/bin/systemd-run", "--scope", "--quiet", "--collect", "--unit=chv-cell-slot1-4242",
                    "--description=chv cell slot1", "--property=Delegate=yes", "--property=MemoryMax=2G", "--property=TasksMax=512", "--"]
    assert "--keep-unit" in nspawn and "--register=no" in nspawn
    assert not any(x.startswith("--property") for x in nspawn)
    policy["register"] = True
    assert "--register=yes" in build(policy, scope="systemd")
    # without systemd there is no machined to register with
    assert "--register=no" in opts(build(policy, scope="standalone"))


def test_setenv_cannot_override_cell_marker(policy):
    policy["setenv"] = {"CHV_SLOT": "other", "FOO": "bar"}
    a = build(policy)
    assert "--setenv=CHV_SLOT=slot0" in a and "--setenv=FOO=bar" in a
    assert "--setenv=CHV_SLOT=other" not in a


def test_pure_and_deterministic(policy):
    assert build(policy, existing={"/etc/chv"}) == build(policy, existing={"/etc/chv"})


def test_empty_command_refused(policy):
    with pytest.raises(ValueError):
        build(policy, cmd=[])


def test_nspawn_environment_is_clean(policy, monkeypatch):
    monkeypatch.setenv("SYSTEMD_NSPAWN_API_VFS_WRITABLE", "1")
    env = argvmod.nspawn_environment(policy)
    assert set(env) == {"PATH", "LANG"}
    policy["nspawn_environment"] = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
    assert argvmod.nspawn_environment(policy)["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] == "1"


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=0,
                        max_size=20), min_size=1, max_size=8))
def test_any_command_is_passed_verbatim(cmd):
    policy = policymod.merged(copy.deepcopy(BASE_POLICY))
    a = argvmod.build_argv(policy, policy["slots"][0], cmd, facts())
    assert a[-len(cmd):] == cmd
    assert a[a.index("--") + 5:] == cmd


def test_argv_command_prints_shell_line(tmp_path, raw_policy, capsys):
    import json

    p = tmp_path / "p.json"
    p.write_text(json.dumps(raw_policy))
    assert cli.main(["--policy", str(p), "argv", "--slot", "slot1", "--", "echo", "a b"]) == 0
    out = capsys.readouterr().out
    words = shlex.split(out.replace("\\\n", " "))
    assert words[0] == "/usr/bin/systemd-nspawn"
    assert "--network-veth-extra=lth1:eth0" in words
    assert words[-2:] == ["echo", "a b"]
    assert cli.main(["--policy", str(p), "argv", "--slot", "nope", "--", "true"]) == 78


def test_scope_unit_name_is_the_one_in_the_argv(policy):
    unit = argvmod.scope_unit(policy["slots"][1], "4242")
    assert unit == "chv-cell-slot1-4242"
    a = argvmod.build_argv(policy, policy["slots"][1], ["true"],
                           argvmod.HostFacts(scope="systemd", existing=NONE, shared_network=False, run_id="4242"))
    assert "--unit=" + unit in a


def _policy_file(tmp_path, raw_policy, **kw):
    import json

    raw_policy.update(kw)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(raw_policy))
    return str(p)


def test_shared_network_refused_unless_the_policy_allows_it(tmp_path, raw_policy, capsys):
    p = _policy_file(tmp_path, raw_policy)
    assert cli.main(["--policy", p, "argv", "--shared-network", "--", "true"]) == 78
    assert "chv_cell_allow_shared_network" in capsys.readouterr().err
    assert cli.main(["--policy", p, "run", "--shared-network", "--", "true"]) == 78
    err = capsys.readouterr().err
    assert "--shared-network is not allowed by the policy" in err and "chv_cell_allow_shared_network" in err
    # control: allowed by the policy, argv shows the shared-network command line
    p = _policy_file(tmp_path, raw_policy, allow_shared_network=True)
    assert cli.main(["--policy", p, "argv", "--shared-network", "--", "true"]) == 0
    assert "--private-network" not in capsys.readouterr().out


def test_runtime_max_above_the_policy_refused_before_anything_starts(tmp_path, raw_policy, capsys):
    p = _policy_file(tmp_path, raw_policy, runtime_max=60)
    assert cli.main(["--policy", p, "run", "--runtime-max", "61", "--", "true"]) == 78
    err = capsys.readouterr().err
    assert "--runtime-max 61s exceeds the policy's runtime_max of 60s" in err and "chv_cell_runtime_max" in err


def test_epilog_documents_the_exit_codes():
    text = cli.build_parser().format_help()
    for code in ("125", "75", "78", "124", "128+N"):
        assert code in text, code


# ---------------------------------------------------------------- the agent's paths
def test_agent_environment_and_alias_binds(policy):
    policy.update(agent_state_mount="/home/chv", workspace_aliases=["/home/chv/workspace", "/srv/ws"],
                  setenv={"FOO": "bar"})
    a = opts(build(policy, slot=1))
    for kv in ("HOME=/home/chv", "USER=chv", "LOGNAME=chv", "CHV_CELL=1", "CHV_SLOT=slot1", "FOO=bar"):
        assert "--setenv=" + kv in a, kv
    state = a.index("--bind=/nonexistent/state/slot1:/home/chv")
    alias = a.index("--bind=/nonexistent/ws/slot1:/home/chv/workspace")
    assert state < alias  # the parent is mounted first, then the alias inside it
    assert "--bind=/nonexistent/ws/slot1:/srv/ws" in a
    assert "--bind=/nonexistent/ws/slot1:/workspace" in a and "--chdir=/workspace" in a
    # a cell path under an alias shows the slot's workspace, not the agent state dir
    assert argvmod.host_path_of("/home/chv/workspace/x", policy, policy["slots"][1]) == "/nonexistent/ws/slot1/x"
    assert argvmod.host_path_of("/home/chv/.codex", policy, policy["slots"][1]) == "/nonexistent/state/slot1/.codex"


def test_agent_environment_follows_the_policy_and_wins_over_setenv(policy):
    policy.update(agent_user="agent", agent_home="/home/agent", setenv={"HOME": "/root", "USER": "root"})
    a = opts(build(policy))
    assert "--setenv=HOME=/home/agent" in a and "--setenv=USER=agent" in a and "--setenv=LOGNAME=agent" in a
    assert "--setenv=HOME=/root" not in a and "--setenv=USER=root" not in a
    # without aliases: no extra bind of the workspace
    assert sum(x.startswith("--bind=/nonexistent/ws/") for x in a) == 1


def test_alias_mountpoints_only_inside_the_agent_state_mount(policy):
    policy.update(agent_state_mount="/home/chv", workspace_aliases=["/home/chv/workspace", "/srv/ws", "/home/chv/a/b",
                                                                    "/home/chvx"])
    assert argvmod.alias_mountpoints(policy) == [["workspace"], ["a", "b"]]
