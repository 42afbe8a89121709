"""Door capacity accounting (wire.SlotQuota, wire.global_cap, wire.serve_connections'
admit step) and chv-broker's use of it; and the broker's and browser's defaults having one
home, the service's DEFAULTS (config.py), which the roles' defaults/main.yml take and their
argument specs do not repeat."""
import copy
import io
import json
import os
import socket
import threading
import time

import pytest
import yaml
from hypothesis import given, strategies as st

from testpaths import ROOT
from ansible.errors import AnsibleFilterError
from ansible_collections.chv.fleet.plugins.filter import door_config

from chv_guest.broker import config, server
from chv_guest.broker.peer import PeerRejected
from chv_guest.browser import config as bconfig, server as bserver
from chv_guest.wire import settings, wire


# ------------------------------------------------------------------ SlotQuota

@given(st.lists(st.tuples(st.sampled_from(["acquire", "release"]), st.sampled_from(["slot0", "slot1", "slot2"])),
                max_size=60), st.integers(1, 4))
def test_a_slot_holds_at_most_its_quota_and_never_another_slots(ops, limit):
    quota = wire.SlotQuota("max_connections_per_slot", limit, "connections open")
    model, holds = {}, {}
    for op, slot in ops:
        if op == "acquire":
            if model.get(slot, 0) < limit:
                holds.setdefault(slot, []).append(quota.acquire(slot))
                model[slot] = model.get(slot, 0) + 1
            else:
                with pytest.raises(wire.Busy) as busy:
                    quota.acquire(slot)
                assert (busy.value.quota, busy.value.limit, busy.value.slot) == ("max_connections_per_slot", limit, slot)
                assert str(busy.value).startswith("busy: slot %s is at its quota of %d connections open "
                                                  "(max_connections_per_slot)" % (slot, limit))
        elif holds.get(slot):
            hold = holds[slot].pop()
            hold.release()
            hold.release()  # given back once only
            model[slot] -= 1
        assert {s: quota.held(s) for s in ("slot0", "slot1", "slot2")} == {
            s: model.get(s, 0) for s in ("slot0", "slot1", "slot2")}
    assert quota.total() == sum(model.values())


def test_a_slot_at_its_quota_leaves_the_others_theirs():
    quota = wire.SlotQuota("max_requests_per_slot", 2, "requests in flight")
    held = [quota.acquire("slot0"), quota.acquire("slot0")]
    with pytest.raises(wire.Busy):
        quota.acquire("slot0")
    with quota.acquire("slot1") as hold:  # control: another slot is admitted
        assert hold.slot == "slot1" and quota.held("slot1") == 1
    assert quota.held("slot1") == 0
    held[0].release()
    quota.acquire("slot0")  # and slot0 again once one of its own has ended


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4", None])
def test_a_quota_below_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="max_requests_per_slot must be an integer of at least 1"):
        wire.SlotQuota("max_requests_per_slot", bad, "requests in flight")


@given(st.integers(1, 500), st.integers(0, 64), st.integers(1, 16))
def test_the_global_cap_leaves_room_for_every_slot_at_its_quota(configured, slots, per_slot):
    cap = wire.global_cap(configured, slots, per_slot)
    assert cap >= configured
    if slots:
        assert cap >= (slots + 1) * per_slot  # all slots at quota, one slot's worth left
    assert cap == max(configured, (slots + 1) * per_slot if slots else 0)


# ------------------------------------------------------------------ serve_connections' admit step

class Door:
    """serve_connections on a real Unix socket; ``admit`` charges each connection to the next
    slot of ``order`` (the test connects in that order); ``handle`` holds every connection until
    ``release`` is set, then answers its slot."""

    def __init__(self, tmp_path, order, max_connections=100, per_slot=2):
        self.path = str(tmp_path / "door.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.order = list(order)
        self.quota = wire.SlotQuota("max_connections_per_slot", per_slot, "connections open")
        self.busy, self.release, self.stop = [], threading.Event(), threading.Event()
        self.thread = threading.Thread(target=wire.serve_connections, daemon=True, args=(
            self.listener, self.stop, max_connections, self.handle, "busy: global (max_connections)"),
            kwargs={"on_busy": self.busy.append, "admit": self.admit})
        self.thread.start()

    def admit(self, conn):  # pylint: disable=unused-argument
        return self.quota.acquire(self.order.pop(0))

    def handle(self, conn, hold):
        with conn:
            self.release.wait(30)
            wire.send_quietly(conn, wire.ok(hold.slot))

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(self.path)
        return s

    def close(self):
        self.release.set()
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


def released(quota):
    """Whether every hold of ``quota`` is given back (handler threads release just after replying)."""
    for dummy in range(600):
        if quota.total() == 0:
            return True
        time.sleep(0.01)
    return False


def _reply(s):
    return wire.parse_object(wire.read_line(s, 65536, 30))


def test_the_accept_loop_refuses_a_slot_over_its_quota_and_admits_another(tmp_path):
    door = Door(tmp_path, ["slot0"] * 5 + ["slot1"])
    try:
        conns = [door.connect() for dummy in range(6)]
        # the refusals come from the accept loop itself, while the admitted ones are held
        for s in conns[2:5]:
            rep = _reply(s)
            assert rep["ok"] is False and "slot slot0 is at its quota of 2" in rep["error"], rep
        assert [(b.slot, b.quota) for b in door.busy] == [("slot0", "max_connections_per_slot")] * 3
        door.release.set()
        assert [_reply(s) for s in conns[:2]] == [wire.ok("slot0")] * 2
        assert _reply(conns[5]) == wire.ok("slot1")
        for s in conns:
            s.close()
    finally:
        door.close()
    assert released(door.quota)  # every admitted connection gave its quota back


def test_the_global_cap_is_a_backstop_behind_the_slot_quotas(tmp_path):
    door = Door(tmp_path, ["slot0", "slot1", "slot2"], max_connections=2, per_slot=2)
    try:
        conns = [door.connect() for dummy in range(3)]
        rep = _reply(conns[2])
        assert rep == wire.err("busy: global (max_connections)")
        assert [(b.slot, b.quota) for b in door.busy] == [(None, "max_connections")]
        door.release.set()
        assert [_reply(s) for s in conns[:2]] == [wire.ok("slot0"), wire.ok("slot1")]
        for s in conns:
            s.close()
    finally:
        door.close()
    assert released(door.quota)  # the refused one's slot quota was given back too


# ------------------------------------------------------------------ chv-broker

class FakePeers:
    def __init__(self, slot):
        self.slot = slot

    def identify(self, conn):  # pylint: disable=unused-argument
        if self.slot is None:
            raise PeerRejected("uid outside every live cell's range", 7, 7)
        return {"slot": self.slot, "pid": 2, "uid_base": 100000, "uid_size": 65536}


def _broker(**over):
    log = io.StringIO()
    b = server.Broker(server.merge(copy.deepcopy(server.DEFAULTS), over), log=log)
    return b, log


def test_the_broker_counts_connections_against_the_slot_its_peer_check_found():
    b, dummy = _broker()
    b.peers = FakePeers("slot0")
    holds = [b.admit(None) for dummy in range(4)]
    assert [h.data["slot"] for h in holds] == ["slot0"] * 4
    with pytest.raises(wire.Busy, match=r"slot slot0 is at its quota of 4 connections open \(max_connections_per_slot\)"):
        b.admit(None)
    b.peers = FakePeers("slot1")
    assert b.admit(None).slot == "slot1"  # control
    b.peers = FakePeers(None)
    assert isinstance(b.admit(None), PeerRejected)  # a rejected peer is counted against no slot
    assert b.connections.total() == 5


def test_the_broker_refuses_a_request_over_the_slots_quota_and_audits_it():
    b, log = _broker(max_requests_per_slot=1)
    b.peers = FakePeers("slot0")
    entered, release = threading.Event(), threading.Event()

    def slow_ping(cell, req):  # pylint: disable=unused-argument
        entered.set()
        release.wait(30)
        return {"pong": True, "slot": cell["slot"]}
    b.ops["ping"] = slow_ping
    first, first_peer = socket.socketpair()
    second, second_peer = socket.socketpair()
    t = threading.Thread(target=b.handle, args=(first, b.admit(first)), daemon=True)
    first_peer.sendall(b'{"op": "ping"}\n')
    t.start()
    assert entered.wait(30)
    second_peer.sendall(b'{"op": "ping"}\n')
    b.handle(second, b.admit(second))
    rep = _reply(second_peer)
    assert rep["ok"] is False and rep["error"].startswith(
        "busy: slot slot0 is at its quota of 1 requests in flight (max_requests_per_slot)"), rep
    release.set()
    t.join(30)
    assert _reply(first_peer) == wire.ok({"pong": True, "slot": "slot0"})  # control
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [(e["verdict"], e.get("quota"), e.get("limit"), e["slot"]) for e in lines] == [
        ("busy", "max_requests_per_slot", 1, "slot0"), ("ok", None, None, "slot0")]
    assert b.requests.total() == 0 and b.connections.total() == 0


class ClosingSocket(socket.socket):
    """The broker's side of a connection, noting what ``quota`` holds of ``slot`` when it is closed."""
    quota, slot, held_at_close = None, None, None

    def close(self):
        if self.held_at_close is None and self.fileno() >= 0:
            self.held_at_close = self.quota.held(self.slot)
        super().close()


@pytest.mark.parametrize("sent, verdict", [
    (b'{"op": "ping"}\n', "ok"), (b"", "bad-request"), (b"not json\n", "bad-request")])
def test_the_broker_gives_the_slots_connection_back_before_it_closes_the_socket(sent, verdict):
    """A client that reads to the broker's close (client.py) may connect again at once: the
    slot's count is down before the close it sees (no false "busy" for back-to-back requests)."""
    b, log = _broker()
    b.peers = FakePeers("slot0")
    mine, peer = socket.socketpair()
    conn = ClosingSocket(fileno=mine.detach())
    conn.quota, conn.slot = b.connections, "slot0"
    peer.sendall(sent)
    peer.shutdown(socket.SHUT_WR)
    hold = b.admit(conn)
    assert b.connections.held("slot0") == 1  # control: the connection is counted while served
    b.handle(conn, hold)
    assert conn.held_at_close == 0
    assert json.loads(peer.recv(65536))["ok"] is (verdict == "ok")
    assert json.loads(log.getvalue())["verdict"] == verdict


@pytest.mark.parametrize("key", ["max_connections_per_slot", "max_requests_per_slot"])
def test_the_broker_refuses_to_start_with_a_quota_below_one(key):
    with pytest.raises(ValueError, match="chv_broker_%s must be at least 1, not 0" % key):
        _broker(**{key: 0})


def test_the_broker_raises_its_global_cap_to_fit_every_slot():
    assert _broker(slots=2)[0].max_connections == 16 == server.DEFAULTS["max_connections"]
    assert _broker(slots=16)[0].max_connections == 17 * server.DEFAULTS["max_connections_per_slot"]
    assert _broker(slots=0)[0].max_connections == 16  # count unknown: as configured


# ------------------------------------------------------------------ each default in one place

def _yaml(*parts):
    with open(os.path.join(ROOT, "roles", *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.mark.parametrize("role,module", [("broker", config), ("browser", bconfig)])
def test_each_default_lives_in_the_services_defaults(role, module):
    """The role's default of a configuration key is the service's (door_default), written nowhere else."""
    from_service = settings.role_defaults(module.DEFAULTS, module.SETTINGS)
    role_defaults = _yaml(role, "defaults", "main.yml")
    specs = _yaml(role, "meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert {"chv_%s_max_connections" % role, "chv_%s_max_requests_per_slot" % role} <= set(from_service)
    for var, value in from_service.items():
        assert role_defaults[var] == "{{ '%s' | chv.fleet.door_default('%s') }}" % (var, role), var
        assert door_config.door_default(var, role) == value
        assert "default" not in specs[var], var  # documented as the service's, not repeated
    assert len(from_service) >= 15
    with open(os.path.join(ROOT, "roles", role, "templates", "%s.json.j2" % role), encoding="utf-8") as fh:
        assert fh.read() == "{{ __%s_config | to_nice_json(indent=2) }}\n" % role


def test_a_role_variable_without_a_service_default_is_refused():
    """Control: door_default names what it has when asked for another variable."""
    with pytest.raises(AnsibleFilterError, match="chv_broker_max_connections_per_slot"):
        door_config.door_default("chv_broker_group", "broker")
    assert door_config.door_default("chv_broker_max_connections_per_slot", "broker") == 4


def test_without_a_slot_count_the_doors_count_the_cell_policys_slots(tmp_path):
    """The rendered configurations carry no slot count (a run of one role or a tagged run does
    not know the identities, and must not change the file): the doors count the slots of the
    cell policy at start. Control: an explicit count wins; no policy, no floor."""
    policy = tmp_path / "cell-policy.json"
    policy.write_text(json.dumps({"version": 1, "slots": [{"name": "slot%d" % i} for i in range(16)]}))
    per_slot = server.DEFAULTS["max_connections_per_slot"]
    assert wire.policy_slots(str(policy)) == 16
    assert _broker(cell_policy=str(policy))[0].max_connections == 17 * per_slot
    assert _broker(cell_policy=str(policy), slots=2)[0].max_connections == server.DEFAULTS["max_connections"]
    assert _broker(cell_policy=str(tmp_path / "absent.json"))[0].max_connections == server.DEFAULTS["max_connections"]
    from browser_helpers import Recorder  # noqa: PLC0415  # pylint: disable=import-outside-toplevel

    browser = bserver.Server(dict(bserver.DEFAULTS, cell_policy=str(policy)), Recorder())
    assert browser.max_connections == 17 * bserver.DEFAULTS["max_requests_per_slot"]
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert wire.policy_slots(str(tmp_path / "bad.json")) == 0
    for role in ("broker", "browser"):
        assert "slots" not in _yaml(role, "vars", "main.yml")["__%s_config_values" % role], role
