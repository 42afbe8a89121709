"""chv.fleet.cell_nat on a lab guest, through real cells (chv-cell run).

Each negative check runs beside a positive control from the same cell. The
"outside" is a listener this test starts on the lab host, bound to the
guest's default gateway (the lab host's end of the guest's veth): beyond
the guest's uplink, and reachable from a cell only through the masquerade
(the lab host has no route to the cell pool). It answers with the peer
address it sees, so a reply proves the source was the guest's uplink address.

Policy variants (deny list, allow list, uplink override, strict mode) are
applied by re-running the role with ansible-playbook against the same
inventory, and the scenario's own settings are restored at the end.
Assumes site.yml converges chv.fleet.cell_runtime then chv.fleet.cell_nat
with at least two slots (the default chv_cell_slots: 2).
"""

import json
import shlex
import socket
import threading

import pytest

from conftest import lab_guest, only_in, run_roles

OUT_PORT, DENIED_PORT, UNLISTED_PORT = 18080, 18081, 18082

PROBE = r"""
import socket, sys
s = socket.socket(); s.settimeout(2)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print(s.recv(100).decode().strip())
except OSError as e:
    print("FAIL", e); sys.exit(1)
"""


# ------------------------------------------------------------------ helpers

class _Outside(object):
    """TCP listeners on the lab host that answer with the peer address."""

    def __init__(self, address, ports):
        self.socks = []
        for port in ports:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(16)
            self.socks.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    @staticmethod
    def _serve(sock):
        while True:
            try:
                conn, addr = sock.accept()
            except OSError:
                return
            conn.sendall((addr[0] + "\n").encode())
            conn.close()

    def close(self):
        for sock in self.socks:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(), which holds the port otherwise
            sock.close()


@pytest.fixture(scope="module")
def lab(host):
    guest = lab_guest(host)
    outside = _Outside(guest["host_address"], [OUT_PORT, DENIED_PORT, UNLISTED_PORT])
    slots = json.loads(host.file("/var/lib/chv-fleet/identities.json").content_string)["slots"]
    slots = sorted(slots.values(), key=lambda s: s["index"])
    assert len(slots) >= 2, "the scenario needs two slots"
    try:
        uplink = json.loads(host.check_output("ip -j -4 route show default"))[0]["dev"]
        yield {"guest": guest, "out": guest["host_address"], "uplink_addr": guest["address"], "slots": slots,
               "uplink": uplink}
    finally:
        outside.close()


def in_cell(host, slot, addr, port):
    """Probe addr:port from a fresh cell in slot; the echoed peer address or None."""
    cmd = "chv-cell run --slot %s -- python3 -c %s %s %d" % (slot, shlex.quote(PROBE), addr, port)
    out = host.run(cmd)
    lines = out.stdout.strip().splitlines() or [""]
    if out.rc == 0:
        return lines[-1].strip()
    # Only a network failure of the probe counts as "unreachable"; a cell that
    # did not start is an error, never a passing negative test.
    assert lines[-1].startswith("FAIL"), "cell did not run: rc=%d %s %s" % (out.rc, out.stdout, out.stderr)
    return None


def counters(host):
    out = host.check_output("nft -j list counters table inet chv_cell")
    return {i["counter"]["name"]: i["counter"]["packets"] for i in json.loads(out)["nftables"] if "counter" in i}


def converge(extra_vars, expect_ok=True):
    """Re-run cell_nat alone (slots from the ledger) with extra variables."""
    return run_roles(["chv.fleet.cell_nat"], extra_vars, expect_ok)


# -------------------------------------------------------------------- tests

def test_unit_table_and_forwarding(host):
    assert host.service("chv-cell-nat").is_enabled
    assert host.service("chv-cell-nat").is_running           # oneshot, RemainAfterExit: active
    assert host.service("chv-cell-nat-check.timer").is_enabled
    assert host.service("chv-cell-nat-check.timer").is_running  # the table's check (test_faults fails it)
    assert host.run("nft list table inet chv_cell").rc == 0
    assert host.file("/proc/sys/net/ipv4/ip_forward").content_string.strip() == "1"
    statements = [ln.strip() for ln in host.file("/etc/chv-fleet/nft/cell-nat.nft").content_string.splitlines()
                  if ln.strip() and not ln.strip().startswith("#")]
    assert not [ln for ln in statements if ln.startswith("flush ruleset")]
    assert statements[:2] == ["table inet chv_cell {}", "delete table inet chv_cell"]


def test_cell_reaches_outside_through_masquerade(host, lab):
    slot0 = lab["slots"][0]["name"]
    before = counters(host)
    assert in_cell(host, slot0, lab["out"], OUT_PORT) == lab["uplink_addr"]
    after = counters(host)
    assert after["nat_masquerade"] > before["nat_masquerade"]
    assert after[slot0 + "_accepted"] > before[slot0 + "_accepted"]


@only_in("trixie")
def test_policy_variants_deny_allow_uplink_and_foreign_chains(host, lab):
    """The policy variants, applied by re-running cell_nat, in one sequence
    so that each re-run does double duty (every converge of the role costs
    a minute under `make test`): allow and deny lists, then an uplink
    override, then the restoring run (beside a foreign drop chain, which it
    must report), then cell_nat_strict, which must refuse that chain."""
    s0, out, me, uplink = lab["slots"][0]["name"], lab["out"], lab["uplink_addr"], lab["uplink"]
    # control, on the scenario's own policy (its one carve-out, the lab host): every port of the outside answers
    assert in_cell(host, s0, out, UNLISTED_PORT) == me
    assert in_cell(host, s0, out, DENIED_PORT) == me
    try:
        converge({"cell_nat_egress_allow": [{"cidr": out, "proto": "tcp", "ports": ["%d-%d" % (OUT_PORT, DENIED_PORT)]}],
                  "cell_nat_egress_deny": [{"cidr": out, "proto": "tcp", "ports": [DENIED_PORT]}]})
        before = counters(host)
        assert in_cell(host, s0, out, OUT_PORT) == me                  # listed
        assert in_cell(host, s0, out, UNLISTED_PORT) is None          # not listed
        assert in_cell(host, s0, out, DENIED_PORT) is None            # listed, but denied
        after = counters(host)
        # the lab host is in 10.0.0.0/8: the allow entry is a carve-out of the default deny of the
        # special-purpose ranges, which drops its unlisted port (docs/network.md)
        assert after["drop_special_range"] > before["drop_special_range"]
        assert after["drop_denied"] > before["drop_denied"]

        converge({"cell_nat_uplink": "lo"})
        table = host.check_output("nft -j list set inet chv_cell uplink_ifs")
        assert '"%s"' % uplink not in table and '"lo"' in table
        assert in_cell(host, s0, out, OUT_PORT) is None                # fails closed
    finally:
        host.check_output("nft 'add table ip cnt_foreign; add chain ip cnt_foreign FORWARD "
                          "{ type filter hook forward priority 0; policy drop; }'")
        try:
            restored = converge({})
            strict = converge({"cell_nat_strict": True}, expect_ok=False)
        finally:
            host.run("nft delete table ip cnt_foreign")
    assert "table ip cnt_foreign, chain FORWARD (hook forward, priority 0): policy drop" in \
        restored.stdout + restored.stderr
    assert strict.returncode != 0 and "cell_nat_strict is set" in strict.stdout + strict.stderr
    # the restored policy: the uplink is back, nothing listed, nothing denied
    table = host.check_output("nft -j list set inet chv_cell uplink_ifs")
    assert '"lo"' not in table and '"%s"' % uplink in table
    assert in_cell(host, s0, out, UNLISTED_PORT) == me
    assert in_cell(host, s0, out, DENIED_PORT) == me
