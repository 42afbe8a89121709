"""macOS pieces that are pure Python: the launcher's argv, environment and
rlimits (chv_guest/cell/darwin.py), darwin cell policies (chv_guest/cell/policy.py),
the slot users (chv.fleet.darwin_slots), the broker's macOS peer check
(chv_guest/broker/peer.py: struct xucred from LOCAL_PEERCRED, slot users only),
and the names the roles' vars/Darwin.yml must agree on."""

import struct

import pytest

from darwin_render import darwin_policy, darwin_vars, role_yaml
from ansible_collections.chv.fleet.plugins.filter.darwin import darwin_slots
from ansible.errors import AnsibleFilterError
from chv_guest.cell import darwin as darwinmod
from chv_guest.cell import policy as policymod
from chv_guest.cell import seatbelt
from chv_guest.broker import peer


# --- the launcher ----------------------------------------------------------
def test_argv_is_sandbox_exec_with_the_slot_profile_and_the_command_verbatim():
    pol = darwin_policy()
    argv = darwinmod.build_argv(pol, "/etc/chv-fleet/seatbelt/slot0.sb", ["python3", "/app/host.py", "--x", "a b"])
    assert argv == ["/usr/bin/sandbox-exec", "-f", "/etc/chv-fleet/seatbelt/slot0.sb", "python3", "/app/host.py",
                    "--x", "a b"]
    for bad in ([], [""], ["-p", "(allow default)"]):
        with pytest.raises(darwinmod.Refused):
            darwinmod.build_argv(pol, "/p.sb", bad)


def test_the_profile_file_is_beside_the_policy_where_the_role_renders_it():
    slot = {"name": "slot3"}
    assert darwinmod.profile_path("/etc/chv-fleet/cell-policy.json", slot) == "/etc/chv-fleet/seatbelt/slot3.sb"
    # the role: __cell_runtime_seatbelt_dir is "{{ chv_cell_policy_path | dirname }}/seatbelt"
    assert darwin_vars("cell_runtime")["__cell_runtime_seatbelt_dir"] == "{{ chv_cell_policy_path | dirname }}/seatbelt"


def test_the_payload_environment_is_the_slots_and_nothing_of_the_callers():
    pol = darwin_policy()
    pol["setenv"] = {"FOO": "1", "HOME": "/nope"}
    slot = pol["slots"][1]
    env = darwinmod.payload_env(pol, slot, term="xterm")
    dirs = seatbelt.slot_dirs(pol, slot)
    assert env == {"FOO": "1", "PATH": darwinmod.PATH, "HOME": dirs["agent_state"], "USER": slot["user"],
                   "LOGNAME": slot["user"], "TMPDIR": dirs["tmp"] + "/", "CHV_CELL": "1", "CHV_CELL_SLOT": "slot1",
                   "CHV_WORKSPACE": dirs["workspace"], "TERM": "xterm"}


def test_rlimits_are_the_policys_that_macos_has():
    pol = darwin_policy()
    pol["rlimits"] = {"NOFILE": "4096:8192", "RLIMIT_CORE": "0", "NPROC": "infinity", "RTPRIO": "1"}
    assert darwinmod.rlimits(pol) == [("RLIMIT_NOFILE", 4096, 8192), ("RLIMIT_NPROC", -1, -1),
                                      ("RLIMIT_CORE", 0, 0)]


def test_the_launcher_refuses_off_macos_and_shared_network(monkeypatch, capsys):
    pol = darwin_policy()
    launcher = darwinmod.Launcher(pol)
    assert launcher.run(["true"]) == darwinmod.EXIT_CONFIG  # this is Linux
    assert "macOS only" in capsys.readouterr().err
    monkeypatch.setattr(darwinmod.sys, "platform", "darwin")
    assert launcher.run(["true"], shared_network=True) == darwinmod.EXIT_CONFIG
    assert launcher.run(["true"], runtime_max=-1) == darwinmod.EXIT_CONFIG


def test_the_anchor_check_reads_pfctl_and_fails_closed():
    pol = darwin_policy()

    class Proc:
        def __init__(self, rc, out):
            self.returncode, self.stdout = rc, out

    seen = []

    def run(argv, **_kw):
        seen.append(argv)
        return Proc(0, b"block drop out quick inet6 all user { 524288 }\n")

    assert darwinmod.anchor_loaded(pol, run=run)
    assert seen == [["/sbin/pfctl", "-a", "com.apple/chv.fleet", "-s", "rules"]]
    assert not darwinmod.anchor_loaded(pol, run=lambda argv, **kw: Proc(0, b"\n"))
    assert not darwinmod.anchor_loaded(pol, run=lambda argv, **kw: Proc(1, b"x"))

    def missing(argv, **_kw):
        raise FileNotFoundError(argv[0])
    assert not darwinmod.anchor_loaded(pol, run=missing)


# --- darwin policies ---------------------------------------------------------
def test_a_darwin_policy_keeps_linux_programs_out_and_needs_its_own():
    pol = darwin_policy()
    raw = {k: v for k, v in pol.items()}
    assert policymod.validate(raw) == []
    for key, value, message in (("nspawn", "/usr/bin/systemd-nspawn", "nspawn: must be null in a darwin policy"),
                                ("sandbox_exec", None, "sandbox_exec: None must be an absolute"),
                                ("pf_anchor", "bad anchor", "pf_anchor:"),
                                ("platform", "windows", "platform: must be one of")):
        broken = dict(raw, **{key: value})
        assert any(e.startswith(message) for e in policymod.validate(broken)), (key, policymod.validate(broken))


def test_darwin_slots_are_single_users_with_distinct_ids():
    pol = darwin_policy()
    good = pol["slots"]
    for change, message in (({"uid_size": 65536}, "uid_size must be 1"), ({"uid_base": 0}, "unprivileged uid"),
                            ({"user": "Root!"}, "is not a user name")):
        broken = dict(pol, slots=[dict(good[0], **change), good[1]])
        assert any(message in e for e in policymod.validate(broken)), change
    dup = dict(pol, slots=[good[0], dict(good[1], uid_base=good[0]["uid_base"])])
    assert any("also used by" in e for e in policymod.validate(dup))


def test_a_linux_policy_keeps_the_macos_keys_null():
    import cellrt  # noqa: PLC0415
    raw = dict(cellrt.BASE_POLICY)
    assert policymod.validate(raw) == []
    assert any(e.startswith("sandbox_exec: must be null in a linux policy")
               for e in policymod.validate(dict(raw, sandbox_exec="/usr/bin/sandbox-exec")))


def test_the_slot_users_follow_the_identity_modules_uid_ranges():
    assert darwin_slots(3) == [
        {"name": "slot%d" % i, "index": i, "user": "_chv-slot%d" % i, "uid_base": 0x80000 + i * 0x10000, "uid_size": 1}
        for i in range(3)]
    assert [s["user"] for s in darwin_slots(["a", "b"], "c")] == ["_ca", "_cb"]
    with pytest.raises(AnsibleFilterError):
        darwin_slots(1, "x" * 40)


# --- the broker's macOS peer check ---------------------------------------------
def xucred(uid, groups=(20, 12), version=0, ngroups=None):
    padded = list(groups) + [0] * (16 - len(groups))
    return struct.pack("=IIhxx16I", version, uid, len(groups) if ngroups is None else ngroups, *padded)


def test_xucred_bytes_give_the_peers_uid_and_groups():
    raw = xucred(524288, (524288, 20))
    assert len(raw) == 76  # sizeof(struct xucred) on macOS
    assert peer.parse_xucred(raw) == (524288, (524288, 20))
    for bad in (raw[:40], xucred(1, version=1), xucred(1, ngroups=17)):
        with pytest.raises(peer.PeerRejected):
            peer.parse_xucred(bad)


CELLS = [{"slot": "slot0", "pid": 111, "uid_base": 524288, "uid_size": 1},
         {"slot": "slot1", "pid": 222, "uid_base": 589824, "uid_size": 1},
         {"slot": "lin", "pid": 333, "uid_base": 3000000, "uid_size": 65536}]


def test_only_a_live_cells_slot_user_passes():
    alive = {111, 222, 333}.__contains__
    assert peer.match_slot_user(589824, CELLS, alive)["slot"] == "slot1"
    for uid in (0, 501, 524289, 3000001):  # root, a login user, next to a slot user, inside a Linux range
        with pytest.raises(peer.PeerRejected):
            peer.match_slot_user(uid, CELLS, alive)
    with pytest.raises(peer.PeerRejected, match="ended"):
        peer.match_slot_user(524288, CELLS, {222}.__contains__)


def test_the_checker_reads_local_peercred_on_macos(tmp_path):
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    cells = tmp_path / "cells"
    cells.mkdir()
    (cells / "slot0.json").write_text(json.dumps({"slot": "slot0", "pid": os.getpid(), "uid_base": 524288,
                                                  "uid_size": 1}))

    class Conn:
        def __init__(self, uid):
            self.uid = uid
            self.asked = []

        def getsockopt(self, level, name, size=None):
            self.asked.append((level, name, size))
            if name == peer.LOCAL_PEERCRED:
                return xucred(self.uid)
            return 4242

    checker = peer.PeerChecker(str(cells), platform="darwin")
    conn = Conn(524288)
    assert checker.identify(conn)["slot"] == "slot0"
    assert conn.asked[0] == (0, 1, 76)  # SOL_LOCAL, LOCAL_PEERCRED, sizeof(struct xucred)
    with pytest.raises(peer.PeerRejected):
        checker.identify(Conn(501))
    assert checker.live_slots() == {"slot0"}


# --- names two roles share --------------------------------------------------------
def test_the_pf_anchor_name_is_the_same_in_the_policy_and_in_cell_nat():
    assert darwin_vars("cell_runtime")["__cell_runtime_pf_anchor"] == darwin_vars("cell_nat")["__cell_nat_pf_anchor"]


def test_the_tmp_root_of_the_role_is_the_launchers():
    assert role_yaml("cell_runtime", "vars", "main.yml")["__cell_runtime_darwin_tmp_root"] == seatbelt.TMP_ROOT
