"""chv-cell health on a converged guest: healthy, and each injected fault
named (a destination that should be refused but connects; the broker's
socket stopped). site.yml's gate itself runs on every converge, and its
failure path is tested in test_rollout.py."""

import json

import pytest

from conftest import CLIENT, OutsideHTTP, lab_guest

PORT = 18750


@pytest.fixture(scope="module")
def outside(host):
    server = OutsideHTTP(lab_guest(host)["host_address"], PORT, {})
    yield "%s:%d" % (lab_guest(host)["host_address"], PORT)
    server.close()


def health(host, *args):
    with host.sudo():
        r = host.run("chv-cell health --json --broker-client %s --unit chv-broker.socket --unit chv-cell-nat.service "
                     + " ".join(args), CLIENT)
    try:
        return r, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(r)


def failed(body):
    return [c["check"] for c in body["checks"] if not c["ok"]]


def test_a_converged_guest_is_healthy_and_each_fault_is_named(host, outside):
    r, body = health(host, "--allow", outside)
    assert r.rc == 0 and body["healthy"] and failed(body) == [], body
    assert [c["check"] for c in body["checks"]] == [
        "unit chv-broker.socket", "unit chv-cell-nat.service", "cell runs", "broker ping", "egress " + outside,
        "refused gateway:22", "refused by the ruleset"], body
    # the same reachable destination given as one to refuse: the check fails and says it connected
    r, body = health(host, "--deny", outside)
    assert r.rc == 1 and failed(body) == ["refused " + outside], body
    assert "refused %s: connected" % outside in body["summary"]
    with host.sudo():
        host.run_expect([0], "systemctl stop chv-broker.socket chv-broker.service")
        try:
            r, body = health(host)
        finally:
            host.run_expect([0], "systemctl start chv-broker.socket")
    assert r.rc == 1 and failed(body) == ["unit chv-broker.socket", "broker ping"], body
    # control: with the socket back, healthy again
    r, body = health(host)
    assert r.rc == 0, body
