"""Door fairness at chv-broker: one slot at its quota never shuts the door for another.

Real Unix socket, chv-broker as systemd runs it (a process of its own, handed
the listening socket), two slots whose cells are processes in pid namespaces
of their own with uid ranges of their own (slot0: CELL_UID, slot1:
OTHER_UID). Each test holds slot0 at its quota the way the issue's tenant
did (16 idle connections: the old global cap; 16 requests in flight) and
asserts that slot1's requests still succeed, beside the positive controls
(slot1 unloaded before, slot0 served again once it lets go). Latencies are
printed (run with -s), never asserted; docs/security.md "Door capacity" has
the figures.
"""
import json
import time

import pytest

from broker_helpers import (CELL_UID, OTHER_UID, BrokerProc, DoorClient, StubBrowser, busy_for, make_listener,
                            median_ms, needs_root, write_record, write_config)

pytestmark = needs_root

PING = {"op": "ping"}
N = 20  # calls per latency figure


@pytest.fixture
def door(env, cell, other_ns):
    """chv-broker with the role's quota defaults for a 2-slot host, slot0 and slot1 live,
    a DoorClient in each cell; idle connections last longer than the test (read_timeout 60)."""
    write_config(env, read_timeout=60.0, slots=2, browser={"timeout": 120.0})
    write_record(env["cells"], "slot0", cell.pid, uid_base=CELL_UID)
    write_record(env["cells"], "slot1", other_ns.pid, uid_base=OTHER_UID)
    listener = make_listener(env["sock"])
    broker = BrokerProc(listener, env["config"]).start()
    a, b = DoorClient(cell, CELL_UID, env["sock"]), DoorClient(other_ns, OTHER_UID, env["sock"])
    yield broker, a, b
    a.stop()
    b.stop()
    broker.stop()
    listener.close()


def settled(client, keep_open=0, deadline=60):
    """The states of ``client``'s held connections once at most ``keep_open`` of them are still
    waiting (replies on their way are waited for; a wait, not a timing assertion). Which ones
    stay open is the broker's order of admission, not the order they were sent in (on a loaded
    machine the third connection can be read before the second). The deadline is below the
    browser timeout of the ``door`` fixture, so a reply that never comes shows as "open"."""
    states = client.state()
    end = time.monotonic() + deadline
    while states.count("open") > keep_open and time.monotonic() < end:
        time.sleep(0.05)
        states = [s if s != "open" else now for s, now in zip(states, client.state())]
    return states


def ended(broker, slot, n, reason="connection closed before end of request", deadline=30):
    """The audit entries of ``slot``'s connections that ended before a request for ``reason``,
    once there are ``n`` of them. The broker releases a
    connection's quota before it writes that entry, so after this a new connection of ``slot``
    is admitted. A wait with a deadline, not a timing assertion: the caller asserts the count."""
    end = time.monotonic() + deadline
    while True:
        entries = [e for e in broker.audit() if e["slot"] == slot and e["verdict"] == "bad-request"
                   and e.get("reason") == reason]
        if len(entries) >= n or time.monotonic() > end:
            return entries
        time.sleep(0.05)


def _all_ok(replies, slot):
    return all(r == {"ok": True, "result": {"pong": True, "slot": slot}} for r in replies)


def test_idle_connections_of_one_slot_do_not_refuse_another(door):
    broker, a, b = door
    # positive control: slot1 unloaded, and slot0 itself served
    unloaded_replies, unloaded = b.call(PING, N)
    assert _all_ok(unloaded_replies, "slot1"), unloaded_replies
    assert _all_ok(a.call(PING)[0], "slot0")

    # the tenant: 16 idle connections (the old global cap), then one more with a request
    assert a.idle(16) == {"held": 16}
    probe, dummy = a.call(PING)
    loaded_replies, loaded = b.call(PING, N)
    # slot1 is served while slot0 is at its quota (the old code answered "broker busy")
    assert _all_ok(loaded_replies, "slot1"), loaded_replies
    print("\ndoor capacity: broker ping of slot1, median of %d: unloaded %.2f ms, slot0 holding 16 idle "
          "connections %.2f ms" % (N, median_ms(unloaded), median_ms(loaded)))

    # slot0 was refused for its own quota, named in the reply, and no more than its quota was held
    assert busy_for(probe[0], "max_connections_per_slot", "slot0"), probe
    states = a.state()
    assert states.count("open") == 4, states
    assert all(busy_for(s, "max_connections_per_slot", "slot0") for s in states if s != "open"), states
    busy = [e for e in broker.audit() if e["verdict"] == "busy"]
    assert len(busy) == 13 and {(e["slot"], e["quota"], e["limit"]) for e in busy} == {
        ("slot0", "max_connections_per_slot", 4)}, busy

    # control: once slot0 lets go (the broker has seen its 4 connections end), it is served again
    a.close_all()
    assert len(ended(broker, "slot0", 4)) == 4, broker.audit()
    assert _all_ok(a.call(PING)[0], "slot0")


def test_requests_in_flight_of_one_slot_do_not_refuse_another(env, door):
    broker, a, b = door
    stub = StubBrowser(json.load(open(env["config"]))["browser"]["socket"], hold_slot="slot0")
    try:
        unloaded_replies, unloaded = b.call(PING, N)
        assert _all_ok(unloaded_replies, "slot1"), unloaded_replies
        opened, dummy = b.call({"op": "browser", "action": "open", "url": "http://example.test/"})
        assert opened[0]["ok"] is True and opened[0]["result"]["slot"] == "slot1", opened  # control

        # 16 slow page opens of slot0, each on a connection of its own
        for dummy in range(16):
            a.send({"op": "browser", "action": "open", "url": "http://example.test/slow"})
        assert stub.wait_seen("slot0", 2)
        probe, dummy = a.call(PING)  # every connection before it has been admitted or refused
        loaded_replies, loaded = b.call(PING, N)
        opened, opened_ms = b.call({"op": "browser", "action": "open", "url": "http://example.test/"})
        assert _all_ok(loaded_replies, "slot1"), loaded_replies
        assert opened[0]["ok"] is True and opened[0]["result"]["slot"] == "slot1", opened
        print("\ndoor capacity: broker ping of slot1, median of %d: unloaded %.2f ms, slot0 with 16 requests "
              "sent (2 in flight) %.2f ms; slot1 browser open (stub) %.2f ms"
              % (N, median_ms(unloaded), median_ms(loaded), opened_ms[0]))

        # slot0: 2 in flight (its request quota), the rest refused naming one of its quotas
        assert busy_for(probe[0], "max_connections_per_slot", "slot0") or busy_for(
            probe[0], "max_requests_per_slot", "slot0"), probe
        states = settled(a, keep_open=2)
        held = [i for i, s in enumerate(states) if s == "open"]
        assert len(held) == 2, states
        refused = [s for s in states if s != "open"]
        assert all(busy_for(s, "max_requests_per_slot", "slot0") or busy_for(s, "max_connections_per_slot", "slot0")
                   for s in refused), refused
        assert any(busy_for(s, "max_requests_per_slot", "slot0") for s in refused), refused
        assert stub.seen("slot0") == 2
    finally:
        stub.released.set()
    # control: the two held requests were real, and are answered once the page loads
    done = settled(a)
    assert [done[i]["ok"] for i in held] == [True, True], done
    assert _all_ok(a.call(PING)[0], "slot0")
    stub.close()
    assert {(e["slot"], e["quota"]) for e in broker.audit() if e["verdict"] == "busy"} <= {
        ("slot0", "max_requests_per_slot"), ("slot0", "max_connections_per_slot")}


def test_idle_connections_time_out_and_free_the_quota(env, door):
    broker, a, b = door
    broker.stop()
    write_config(env, read_timeout=1.0)
    broker.start()
    assert _all_ok(b.call(PING)[0], "slot1")  # the restarted broker serves
    a.idle(4)
    probe, dummy = a.call(PING)
    assert busy_for(probe[0], "max_connections_per_slot", "slot0"), probe
    # the broker ends each idle connection after read_timeout, with an error reply
    states = settled(a)
    assert len(states) == 4 and all(s == {"ok": False, "error": "read timeout"} for s in states), states
    assert len(ended(broker, "slot0", 4, "read timeout")) == 4, broker.audit()  # their quota is released
    assert _all_ok(a.call(PING)[0], "slot0")
