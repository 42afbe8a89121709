"""chv-cell health's verdict (chv_cell.health): which check fails, and what
it says, from the unit properties, the cell's report and the ruleset's
counters. The guest side (a real cell, real units) is tested in Molecule
(molecule/shared/tests/test_health.py) and by site.yml's gate on every
converge."""

import json
import socket
import threading

import pytest

from chv_guest.cell import health

ROUTE = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
         "host0\t00000000\t0114E70A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
         "host0\t0014E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0"}


def test_default_gateway_from_proc_net_route():
    assert health.default_gateway(ROUTE) == "10.231.20.1"
    assert health.default_gateway(ROUTE.splitlines()[0] + "\n") is None


@pytest.mark.parametrize("text,parsed", [("example.org:443", ("example.org", 443)),
                                         ("10.0.0.1:22", ("10.0.0.1", 22)),
                                         ("[2001:db8::1]:80", ("2001:db8::1", 80))])
def test_targets(text, parsed):
    assert health.parse_target(text) == parsed


@pytest.mark.parametrize("text", ["example.org", "example.org:", ":80", "h:0", "h:65536", "h:x", "2001:db8::1:80"])
def test_bad_targets_are_named(text):
    with pytest.raises(ValueError, match=repr(text).replace("[", r"\[")):
        health.parse_target(text)


@pytest.mark.parametrize("after,ok,needle", [
    (ACTIVE, True, "active/running, NRestarts 0"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "listening"}, True, "active/listening"),
    (dict(ACTIVE, ActiveState="failed", SubState="failed"), False, "failed/failed, not active"),
    (dict(ACTIVE, ActiveState="activating", SubState="auto-restart"), False, "not active"),
    (dict(ACTIVE, NRestarts="3"), False, "restart loop"),
    (dict(ACTIVE, LoadState="masked"), False, "not loaded (masked)"),
])
def test_unit_check(after, ok, needle):
    before = ACTIVE if "NRestarts" in after else after  # a socket unit has no NRestarts
    check = health.unit_check("chv-broker.socket", before, after)
    assert check["ok"] is ok and needle in check["detail"] and check["check"] == "unit chv-broker.socket"


def _cell(report, rc=0, err=""):
    return {"rc": rc, "out": "noise\n" + json.dumps(report) + "\n", "err": err}


GOOD = {"gateway": "10.231.20.1", "broker": {"rc": 0, "out": '{"ok": true, "result": "pong"}', "err": ""},
        "allow": {"git.example:443": "connected"}, "deny": {"gateway:22": "TimeoutError: timed out"}}
REQUEST = {"broker_client": "/usr/lib/chv-fleet/chv_guest/broker/client.py", "allow": ["git.example:443"], "deny": []}


def _names(checks, ok=None):
    return [c["check"] for c in checks if ok is None or c["ok"] is ok]


def test_a_healthy_guest():
    checks = health.verdict(REQUEST, {"chv-broker.socket": (ACTIVE, ACTIVE)}, _cell(GOOD),
                            {"drop_cell_to_guest": 4, "nat_masquerade": 9}, {"drop_cell_to_guest": 6})
    assert _names(checks, ok=False) == []
    assert _names(checks) == ["unit chv-broker.socket", "cell runs", "broker ping", "egress git.example:443",
                              "refused gateway:22", "refused by the ruleset"]
    assert health.summary("g1", checks) == "g1: healthy (6 checks)"
    assert health.summary(None, checks) == "healthy (6 checks)"


@pytest.mark.parametrize("change,failed", [
    ({"broker": {"rc": 2, "out": "", "err": "connection refused"}}, ["broker ping"]),
    ({"broker": {"rc": 1, "out": '{"ok": false, "error": "peer is not a process of a live chv cell"}', "err": ""}},
     ["broker ping"]),
    ({"allow": {"git.example:443": "TimeoutError: timed out"}}, ["egress git.example:443"]),
    ({"deny": {"gateway:22": "connected"}}, ["refused gateway:22"]),
    # a reset or an ICMP error: the packet got past the ruleset, which only drops
    ({"deny": {"gateway:22": "ConnectionRefusedError: [Errno 111] Connection refused"}}, ["refused gateway:22"]),
    ({"deny": {"gateway:22": "OSError: [Errno 113] No route to host"}}, ["refused gateway:22"]),
])
def test_each_failure_is_named(change, failed):
    checks = health.verdict(REQUEST, {}, _cell(dict(GOOD, **change)), {"drop_x": 0}, {"drop_x": 1})
    assert _names(checks, ok=False) == failed
    assert health.summary("g2", checks).startswith("g2: UNHEALTHY: " + failed[0] + ": ")


def test_a_refusal_the_ruleset_did_not_count_fails():
    # nothing listening also "refuses": only the drop counters prove the ruleset did it
    checks = health.verdict(REQUEST, {}, _cell(GOOD), {"drop_x": 5}, {"drop_x": 5})
    assert _names(checks, ok=False) == ["refused by the ruleset"]
    checks = health.verdict(REQUEST, {}, _cell(GOOD), None, None)
    assert _names(checks, ok=False) == ["refused by the ruleset"]


def test_a_cell_that_did_not_start_fails_and_says_why():
    cell = {"rc": 125, "out": "", "err": "table inet chv_cell is not loaded"}
    checks = health.verdict(REQUEST, {"u": (ACTIVE, ACTIVE)}, cell, {}, {})
    assert _names(checks) == ["unit u", "cell runs"] and _names(checks, ok=False) == ["cell runs"]
    assert "exited 125" in checks[-1]["detail"] and "chv_cell is not loaded" in checks[-1]["detail"]


def test_the_in_cell_probe_against_real_sockets(tmp_path):
    """in_cell connects for real: a listener on loopback answers the allowed
    target; a closed port fails the denied one. (A route table without a
    default route: this machine's own gateway is never probed.)"""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def accept_once():
        try:
            srv.accept()
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=accept_once, daemon=True).start()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port_closed = closed.getsockname()[1]
    closed.close()
    allow, deny = "127.0.0.1:%d" % srv.getsockname()[1], "127.0.0.1:%d" % port_closed
    route = tmp_path / "route"
    route.write_text(ROUTE.splitlines()[0] + "\n")
    report = health.in_cell({"broker_client": None, "allow": [allow], "deny": [deny]}, str(route))
    srv.close()
    assert report["allow"] == {allow: "connected"}
    assert report["deny"] == {deny: report["deny"][deny]} and report["deny"][deny].startswith("ConnectionRefusedError")
    assert report["gateway"] is None
    assert "broker" not in report


# ----------------------------------------------------------- a busy guest

def test_the_health_cell_takes_a_free_slot_or_the_reserved_one():
    names = ["slot0", "slot1", "slot2"]
    assert health.free_slots(names, []) == names
    assert health.free_slots(names, ["slot0", "slot2"]) == ["slot1"]  # every slot but one busy: that one
    assert health.free_slots(names, names) == []
    assert health.free_slots(names, ["slot0", "slot1"], reserved="slot2") == ["slot2"]
    assert health.free_slots(names, ["slot2"], reserved="slot2") == []


def test_busy_is_its_own_verdict_and_exit_code():
    from chv_guest.cell import exits

    assert health.EXIT_HEALTH_BUSY == exits.EXIT_BUSY != health.EXIT_UNHEALTHY
    checks = [health.unit_check("chv-broker.socket", ACTIVE, ACTIVE), health.busy_check(["slot0", "slot1"])]
    assert health.outcome(checks) == "busy" and health.exit_code(checks) == health.EXIT_HEALTH_BUSY
    assert health.summary("g1", checks) == (
        "g1: busy, not unhealthy: every slot the check may use runs a cell (slot0, slot1) "
        "(1 other checks ok; the cell's checks wait for a free slot)")
    # a failed unit on a busy guest is unhealthy
    checks[0] = health.unit_check("chv-broker.socket", ACTIVE, dict(ACTIVE, ActiveState="failed"))
    assert health.outcome(checks) == "unhealthy" and health.exit_code(checks) == health.EXIT_UNHEALTHY
    assert health.summary(None, checks).startswith("UNHEALTHY: unit chv-broker.socket")
    good = health.verdict(REQUEST, {}, _cell(GOOD), {"drop_x": 0}, {"drop_x": 1})
    assert health.outcome(good) == "healthy" and health.exit_code(good) == 0


def test_the_default_units_are_the_gates():
    assert health.default_units("/run/chv-browser/browser.sock") == [
        "chv-cell-nat.service", "chv-broker.socket", "chv-browser.service"]
    assert health.default_units("") == ["chv-cell-nat.service", "chv-broker.socket"]
    assert health.default_broker_client().endswith("/chv_guest/broker/client.py")


@pytest.mark.parametrize("value,error", [
    (None, None), ("slot1", None),
    ("slot9", "health_slot: 'slot9' is not a slot of this policy"),
    (1, "health_slot: 1 is not a slot of this policy"),
])
def test_the_reserved_health_slot_is_a_slot_of_the_policy(raw_policy, value, error):
    from chv_guest.cell import policy as policymod

    errors = policymod.validate(dict(raw_policy, health_slot=value))
    assert errors == ([] if error is None else [error])
    assert policymod.validate(dict(raw_policy, health_slot="slot0", warm_slots=["slot0"])) == [
        "health_slot: 'slot0' is a warm slot too"]
    assert policymod.validate(dict(raw_policy, health_slot="slot0", slots=raw_policy["slots"][:1])) == [
        "health_slot: 'slot0' is the only slot: no run could start"]


def test_a_run_without_slot_never_takes_the_reserved_health_slot(policy, tmp_path):
    from test_launcher import _Launcher

    la = _Launcher(dict(policy, health_slot="slot0"), str(tmp_path))
    assert la.run(["true"]) == 3 and la.ran[-1][0]["name"] == "slot1"
    assert la.run(["true"], slot_name="slot0") == 3 and la.ran[-1][0]["name"] == "slot0"  # health's own --slot


def test_the_gate_passes_no_unit_so_a_call_by_hand_runs_the_same_checks():
    import os

    import yaml

    from testpaths import ROOT

    # the gate's tasks (site.yml's post_tasks and chv.fleet.check import them)
    with open(os.path.join(ROOT, "playbooks", "tasks", "health_gate.yml")) as fh:
        tasks = yaml.safe_load(fh)[0]["block"]
    gate = [t for t in tasks if t["name"].startswith("Run the health gate")]
    assert len(gate) == 1
    argv = gate[0]["ansible.builtin.command"]["argv"]
    assert "'health', '--json'" in argv and "--unit" not in argv
    stop = [t for t in tasks if t["name"].startswith("Fail a host that failed the health gate")][0]
    assert "__chv_fleet_health.rc not in [0, %d]" % health.EXIT_HEALTH_BUSY in stop["when"]
