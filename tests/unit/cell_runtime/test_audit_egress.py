"""The proxy-mode half of chv-cell audit (the EGR cases): the in-cell
probes against real sockets on loopback (a CONNECT through a stand-in
proxy, a DNS query), the guest side's request and controls, and the
counter-proof that widens the proxy's list for one run."""

import socket
import threading

import pytest

from chv_guest.cell import audit
from chv_guest.cell import audit_probe
from chv_guest.cell import catalog
from chv_guest.cell import counterproof
from chv_guest.cell import egresslog
from chv_guest.cell.catalog import egr


def _serve_once(kind, answer):
    """A loopback server of ``kind`` (tcp or udp) that answers its first
    request with answer(request); its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    if kind == "tcp":
        sock.listen(1)

    def serve():
        if kind == "tcp":
            conn, dummy = sock.accept()
            with conn:
                conn.sendall(answer(conn.recv(4096)))
        else:
            data, peer = sock.recvfrom(4096)
            for reply in answer(data):
                sock.sendto(reply, peer)
        sock.close()
    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1]


@pytest.mark.parametrize("status", ["200 Connection established", "403 Forbidden"])
def test_proxy_connect_reports_the_proxys_status(status):
    seen = []

    def answer(request):
        seen.append(request)
        return ("HTTP/1.1 %s\r\n\r\n" % status).encode()
    port = _serve_once("tcp", answer)
    assert audit_probe.proxy_connect("http://127.0.0.1:%d" % port, "api.lab.test", 443) == "status " + status[:3]
    assert seen == [b"CONNECT api.lab.test:443 HTTP/1.1\r\nHost: api.lab.test:443\r\n\r\n"]


def test_proxy_connect_without_a_proxy_or_with_none_listening():
    assert audit_probe.proxy_connect("", "api.lab.test", 443) == "no proxy: ''"
    assert audit_probe.proxy_connect("socks5://127.0.0.1:1080", "api.lab.test", 443).startswith("no proxy")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert audit_probe.proxy_connect("http://127.0.0.1:%d/" % port, "api.lab.test", 443) == "ECONNREFUSED"


def test_a_dns_query_is_answered_only_by_a_reply_with_its_id(monkeypatch):
    monkeypatch.setattr(audit_probe.socket.socket, "connect",
                        lambda self, addr, real=socket.socket.connect: real(self, ("127.0.0.1", port)))
    queries = []

    def answer(query):
        queries.append(query)
        return [b"\x00\x00" + query[2:], query[:2] + b"\x81\x80" + query[4:]]  # a stranger's id first
    port = _serve_once("udp", answer)
    assert audit_probe.dns_query("192.0.2.53", "api.lab.test", timeout=2) == "answered"
    q = queries[0]
    assert q[2:12] == b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    assert q[12:] == b"\x03api\x03lab\x04test\x00\x00\x01\x00\x01"


def test_an_unanswered_dns_query_is_a_timeout(monkeypatch):
    port = _serve_once("udp", lambda query: [])
    monkeypatch.setattr(audit_probe.socket.socket, "connect",
                        lambda self, addr, real=socket.socket.connect: real(self, ("127.0.0.1", port)))
    assert audit_probe.dns_query("192.0.2.53", "api.lab.test", timeout=0.3) == "TimeoutError"


def test_the_guest_side_asks_each_name_its_literal_and_the_resolvers(monkeypatch, policy):
    """--allow-name, --deny-name and --inside-name: the CONNECTs cell A makes,
    the direct connection past the proxy, the resolvers it queries, and the
    guest's own connections and queries beside them (the controls)."""
    monkeypatch.setattr(audit, "_resolve", lambda name: {"api.lab.test": "10.99.20.1", "evil.lab.test": "10.99.20.9",
                                                         "guest.lab.test": "127.0.0.1"}.get(name, ""))
    monkeypatch.setattr(audit.probe, "connect", lambda host, port: "connected: %s:%d" % (host, port))
    monkeypatch.setattr(audit.probe, "dns_query", lambda server, name: "answered %s %s" % (server, name))
    g = {}
    opts = {"allow_name": ["api.lab.test:18770"], "deny_name": ["evil.lab.test:18771", "gone.lab.test:80"],
            "inside_name": ["guest.lab.test"]}
    req = audit._egress_request(dict(policy, dns_servers=["192.0.2.53"]), opts, 18798, g)
    assert req == {"connect": {"allow:api.lab.test:18770": ["api.lab.test", 18770],
                               "literal:10.99.20.1:18770": ["10.99.20.1", 18770],
                               "deny:evil.lab.test:18771": ["evil.lab.test", 18771],
                               "deny:gone.lab.test:80": ["gone.lab.test", 80],
                               "inside:guest.lab.test:18798": ["guest.lab.test", 18798]},
                   "direct": {"10.99.20.1:18770": ["10.99.20.1", 18770]},
                   "dns": ["192.0.2.53"], "qname": "api.lab.test"}
    assert g["egress"]["reach"] == {"allow:api.lab.test:18770": "connected: 10.99.20.1:18770",
                                    "deny:evil.lab.test:18771": "connected: 10.99.20.9:18771",
                                    "deny:gone.lab.test:80": "does not resolve",
                                    "inside:guest.lab.test:18798": "connected: 127.0.0.1:18798"}
    assert g["egress"]["dns"] == {"192.0.2.53": "answered 192.0.2.53 api.lab.test"}


def test_the_proxys_log_since_the_run_began_for_cell_as_slot(tmp_path):
    log = tmp_path / "access.log"
    line = ("ts=1.000 slot=%s src=10.231.0.2 method=CONNECT host=api.lab.test port=443 dst=10.99.20.1 "
            "status=TCP_TUNNEL/200 bytes_out=1 bytes_in=2 ms=3\n")
    log.write_text(line % "slot0")
    offset = audit._log_size(str(log))
    with open(str(log), "a") as fh:
        fh.write(line % "slot1" + "garbage\n" + line % "slot0")
    got = audit._log_since(str(log), offset, "slot0")
    assert [(x["slot"], x["verdict"]) for x in got] == [("slot0", "allowed")]
    assert audit._log_since(str(tmp_path / "none"), 0, "slot0") == []


CONF = """http_port 3128
acl chv_slot_0 src 10.231.0.0/30
note chv_slot slot0 chv_slot_0
acl chv_slot_1 src 10.231.0.4/30
note chv_slot slot1 chv_slot_1
http_access deny !chv_cells
http_access deny all
"""


def test_the_widened_list_allows_cell_as_slot_only_before_every_rule(policy):
    ctx = {"slot_a": dict(policy["slots"][0], name="slot1")}
    out = egr._widen(CONF, ctx)
    assert out.splitlines()[5:] == ["http_access allow chv_slot_1", "http_access deny !chv_cells",
                                    "http_access deny all"]
    with pytest.raises(RuntimeError, match="no ACL of slot slot7"):
        egr._widen(CONF, {"slot_a": dict(policy["slots"][0], name="slot7")})


def test_widening_keeps_the_original_and_a_killed_runs_is_put_back(tmp_path, monkeypatch, policy):
    conf = tmp_path / "squid.conf"
    conf.write_text(CONF)
    conf.chmod(0o640)
    monkeypatch.setattr(egresslog, "PROXY_CONF", str(conf))
    monkeypatch.setattr(counterproof, "PROXY_ORIG", str(conf) + ".chv-audit-orig")
    reloads = []
    monkeypatch.setattr(counterproof, "reload_proxy", lambda pol: reloads.append(conf.read_text()))
    ctx = {"slot_a": policy["slots"][0]}
    counterproof.widen_proxy(policy, egr._widen, ctx)
    assert "http_access allow chv_slot_0\n" in conf.read_text() and reloads == [conf.read_text()]
    assert oct(conf.stat().st_mode & 0o777) == "0o640"
    # the audit was killed here: the next counter-proof's start puts the original back
    assert counterproof.restore_proxy(policy) is True
    assert conf.read_text() == CONF and len(reloads) == 2
    assert counterproof.restore_proxy(policy) is False and len(reloads) == 2


def test_a_loosening_of_the_other_modes_cases_is_not_applicable(policy):
    ctx = {"pol": policy, "slot_a": policy["slots"][0], "slot_b": policy["slots"][1],
           "opts": {"allow_name": ["10.99.20.1:18770"], "deny_name": ["evil.lab.test:80"], "deny": []}}
    before = {"cases": [{"id": c.id, "verdict": "pass", "probe": ""} for c in catalog.cases_for("cidr")]}
    assert counterproof.not_applicable(egr.WIDEN, ctx, before) == \
        "not judged on this guest: EGR-02 is of proxy mode, EGR-03 is of proxy mode"
    # the mode comes first: a cidr guest run without the proxy's options names the mode, not the options
    ctx["opts"].update(allow_name=None, deny_name=None)
    assert egr.WIDEN.needs(ctx)
    assert counterproof.not_applicable(egr.WIDEN, ctx, before).startswith("not judged on this guest")
