"""The isolation case catalog's verdicts (chv_cell.audit): every case from
synthetic facts of one run, the control-before-probe rule, skips, the
reports, and docs/isolation-cases.md matching the catalog. The probes run
in real cells in Molecule (molecule/shared/tests/test_catalog.py)."""

import copy
import json
import os
import re
import stat
import xml.etree.ElementTree as ET

import pytest

from chv_guest.cell import audit
from chv_guest.cell import audit_probe
from chv_guest.cell import catalog
from chv_guest.cell.catalog import facts as factsmod
from chv_guest.cell.catalog import loosen
from chv_guest.cell import counterproof
from chv_guest.cell import egresslog
from chv_guest.cell import exits
from chv_guest.cell import policy as policymod
from chv_guest.cell import runner

from testpaths import ROOT


def _mask(names):
    value = 0
    for bit, name in enumerate(policymod.CAP_NAMES):
        if name in names:
            value |= 1 << bit
    return "%016x" % value


def good_facts(policy, broker_client):
    """The facts of a run on a guest whose every boundary holds."""
    a_slot, b_slot = policy["slots"][0], policy["slots"][1]
    kept = set(policymod.CAP_NAMES) - set(policy["drop_capabilities"])
    ok_run = {"rc": 0, "err": ""}
    denied_run = {"rc": 2, "err": "RTNETLINK answers: Operation not permitted"}
    refused_open = {"rc": 1, "err": "", "out": json.dumps({"ok": False, "error": "net::ERR_CONNECTION_REFUSED"})}
    page = {"title": "chv-audit", "url": "http://10.99.20.1:18771/", "truncated": False, "status": 200,
            "aria_snapshot": '- heading "chv-audit" [level=1]'}
    allowed_open = {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": page})}
    a = {
        "uid": 0, "uid_map": ["0", str(a_slot["uid_base"]), "65536"],
        "CapEff": _mask(kept), "CapBnd": _mask(kept), "NoNewPrivs": "1",
        "read": {"etc_chv": "EACCES", "os_release": "ok", "credentials": "ENOENT", "ordinary": "ok",
                 "other_workspace": "ENOENT", "own_workspace": "ok", "other_shots": "ENOENT", "own_shots": "ok",
                 "hidden:/opt/chv-browser": "ENOENT", "hidden:/usr/lib/chromium": "EACCES", "env": "ok",
                 "state_dir": "ENOENT", "run_chv": "ok"},
        "write": {"workspace": "ok", "usr": "EROFS", "etc": "ok", "trusted:/etc/chv-fleet/cell-policy.json": "EROFS"},
        "kernel": {"io_uring_setup": "EPERM", "syscall_getpid": "ok", "unshare_user": "EPERM", "unshare_none": "ok",
                   "mkdir": "ok", "mount_tmpfs": "EPERM", "mknod_chr": "EPERM", "mkfifo": "ok",
                   "raw_socket": "EPERM", "dgram_socket": "ok", "kill0_own_child": "ok", "ptrace_guest": "EPERM",
                   "kill0_guest": "ESRCH", "marker_seen": [], "own_pid_listed": True, "open_guest_ns": "ENOENT",
                   "open_own_ns": "ok", "setns_own": "EPERM",
                   "nsenter_guest": {"rc": 1, "err": "nsenter: cannot open /proc/4242/ns/net"},
                   "nsenter_init": {"rc": 1, "err": "nsenter: reassociate to namespace 'ns/net' failed"},
                   "nsenter_version": ok_run, "ip_addr_add": denied_run, "ip_addr_show": ok_run,
                   "ip_route_add": denied_run, "ip_route_show": ok_run},
        "tcp": {"allow:10.99.20.1:18770": "connected: hello", "cell_b": "TimeoutError",
                "guest:10.99.20.2": "TimeoutError", "guest:" + a_slot["gateway"]: "TimeoutError",
                "guest:" + b_slot["gateway"]: "TimeoutError", "metadata": "TimeoutError",
                "deny:192.0.2.10:80": "TimeoutError"},
        "tcp6": {"2001:db8::1": "ENETUNREACH"},
        "neigh_out": "%s dev eth0 lladdr 02:00:00:00:00:01 REACHABLE" % a_slot["gateway"],
        "resolv": "nameserver 10.99.20.1\n",
        "browser": {"allowed": allowed_open, "denied": dict((key, refused_open) for key in (
            "guest:127.0.0.1", "guest:10.99.20.2", "guest:" + a_slot["gateway"], "metadata", "cell_b"))},
        "broker": {"ping": {"rc": 0, "out": '{"ok": true, "op": "ping"}', "err": ""},
                   "unknown": {"rc": 1, "out": '{"ok": false, "error": "unknown op"}', "err": ""},
                   "ping_after": {"rc": 0, "out": '{"ok": true, "op": "ping"}', "err": ""}},
    }
    nonce = "0badcafe"
    ping_ok = {"rc": 0, "out": '{"ok": true, "result": {"pong": true, "slot": "%s"}}' % b_slot["name"], "err": ""}
    sent = factsmod.cookie_sent(nonce)

    def page_reply(heading, shown):
        result = {"title": heading, "url": "http://10.99.20.1:18770/chv-audit-cookie?v=" + nonce, "status": 200,
                  "truncated": False, "aria_snapshot": '- heading "%s" [level=1]\n- heading "sent:[%s]" [level=2]'
                  % (heading, shown)}
        return {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": result})}
    busy = ("busy: slot %s is at its quota of 4 connections open (max_connections_per_slot); retry when one has ended"
            % a_slot["name"])
    a["kernel"]["families"] = {
        "allowed": {"AF_UNIX": "ok", "AF_INET": "ok", "AF_INET6": "ok", "AF_NETLINK": "ok"},
        "denied": {"AF_VSOCK": "EAFNOSUPPORT", "AF_PACKET": "EAFNOSUPPORT", "AF_XDP": "EAFNOSUPPORT"},
        "vsock_bind": "socket: EAFNOSUPPORT", "high_bits": "EAFNOSUPPORT"}
    a["tcp"]["special"] = "TimeoutError"
    a["browser"]["denied"]["special"] = refused_open
    a["disk"] = {"size": 62 << 20, "free": 50 << 20, "asked": 51 << 20, "small": "ok", "big": "ENOSPC",
                 "big_seconds": 0.01}
    a["plant"] = {"file": "ok", "shadow": "ok", "fifo": "ok", "other_slot": "ok"}
    a["cookie"] = [page_reply("chv-audit-cookie", ""), page_reply("chv-audit-cookie", sent)]
    sync_refused = {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "sync rejected: symbolic link in the git directory: .git/packed-refs"})}
    a["sync"] = {"setup": {"clean": "ok", "packed_refs": "ok", "alternates": "ok"},
                 "replies": {"clean": {"rc": 0, "err": "", "out": json.dumps(
                     {"ok": True, "result": {"action": "status", "returncode": 0, "stdout": "## No commits yet on main\n",
                                             "stderr": "", "truncated": False}})},
                             "packed_refs": sync_refused,
                             "alternates": {"rc": 1, "err": "", "out": json.dumps(
                                 {"ok": False, "error": "sync rejected: .git/objects/info/alternates is not allowed"})}}}
    a["quota"] = {"replies": ["idle"] * 4 + ['{"ok": false, "error": "%s"}' % busy] * 2, "go": True, "still_held": 4,
                  "ping_after": {"rc": 0, "err": "", "out": '{"ok": true, "result": {"pong": true}}'},
                  "ping_attempts": 1}
    refused = {"rc": 1, "out": '{"ok": false, "error": "peer is not a cell"}', "err": ""}
    read_refused = {"rc": 65, "out": "", "err": "chv-cell read: refused: a symbolic link", "seconds": 0.05}
    guest = {
        "etc_chv_readable": True, "workspace_write_seen": True, "etc_write_seen": False, "trusted_changed": [],
        "marker_alive": True, "b_seen_running": True,
        "counters_moved": {"drop_cell_to_cell": 2, "drop_cell_to_guest": 6, "drop_denied": 2,
                           "drop_ipv6": 1, "drop_door_to_guest": 4, "drop_door_to_cell": 1, "drop_special_range": 2},
        "listener_seen": [], "b_listener_seen": [],
        "reach": {"10.99.20.2": "connected: hello", b_slot["gateway"]: "connected: hello",
                  "metadata": "connected: hello", "10.99.20.1:18770": "connected: hello",
                  "192.0.2.10:80": "connected: hello", "special": "connected: hello"},
        "broker_root": refused, "broker_cell_uid": refused,
        "left_behind": [], "runs": [0] * 5, "runtime": {"control_rc": 0, "limited_rc": exits.EXIT_RUNTIME},
        "tasks": {"limit": 64, "control": 4, "started": 63},
        "busy": {"slots": 2, "running": 2, "all_ran": True, "extra_rc": exits.EXIT_BUSY,
                 "extra_record": {"exit": 75, "payload_exit": None, "payload_started": False, "slot": None,
                                  "verdict": "busy"}},
        "sigkill": {"started": True, "after_rc": 0},
        "vsock_guest": "ok",
        "disk": {"limit": 64 << 20, "disk_max": "64M", "own_device": True, "image": "/var/lib/chv-fleet/disks/slot0.img", "image_grew": 0},
        "read": {"file": {"rc": 0, "out": factsmod.marker("read", nonce), "err": "", "seconds": 0.05},
                 "shadow": dict(read_refused), "fifo": dict(read_refused), "other_slot": dict(read_refused)},
        "shadow_words": ["root:", "daemon:"],
        "slot_dirs": [{"path": "/var/lib/chv-fleet/%s/%s" % (kind, s["name"]), "uid_base": s["uid_base"],
                       "uid": s["uid_base"], "gid": s["uid_base"], "mode": "0700", "dir": True}
                      for s in (a_slot, b_slot) for kind in ("workspaces", "agent-state")],
        "b_files_readable": True,
        "quota": {"max_connections_per_slot": 4, "read_timeout": 10.0, "config": "/etc/chv-fleet/broker.json"},
        "quota_b_ping": ping_ok, "quota_b_ping_seconds": 0.2,
        "forged": {"rc": 75, "write": "EBADF", "warm": False,
                   "record": {"exit": 75, "payload_exit": 75, "payload_started": True, "slot": a_slot["name"],
                              "verdict": "ran"}},
    }
    run2 = {"snapshot": {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "browser: no page open for this slot; use open first"})},
        "open": page_reply("chv-audit-cookie", "")}
    return {"nonce": nonce, "policy": policy, "slot_a": a_slot, "slot_b": b_slot, "broker_client": broker_client,
            "a": a, "b": {"uid_map": ["0", str(b_slot["uid_base"]), "65536"], "self": "connected: hello"},
            "guest": guest, "run2": run2}


@pytest.fixture
def facts(policy, tmp_path):
    client = tmp_path / "client.py"
    client.write_text("")
    return good_facts(policy, str(client))


# the cases of each egress mode's guests
CIDR_CASES = [c.id for c in catalog.cases_for("cidr")]
PROXY_CASES = [c.id for c in catalog.cases_for("proxy")]
ALLOW, DENY = "allow:api.lab.test:18770", "deny:evil.lab.test:18771"
LITERAL, INSIDE = "literal:10.99.20.1:18770", "inside:guest.lab.test:18798"


def _log_line(slot, host, port, dst, status):
    """A line of the proxy's audit log, as egresslog reads it."""
    return egresslog.parse_line("ts=1.000 slot=%s src=10.231.0.2 method=CONNECT host=%s port=%s dst=%s status=%s "
                                "bytes_out=0 bytes_in=0 ms=1" % (slot, host, port, dst, status))


@pytest.fixture
def proxy_facts(policy, tmp_path):
    """The facts of a run on a proxy-mode guest whose every boundary holds:
    the cell's CONNECTs answered as the list says, its direct connection and
    DNS dropped, each attempt in the proxy's log."""
    client = tmp_path / "client.py"
    client.write_text("")
    f = good_facts(dict(policy, egress_proxy={"port": 3128}), str(client))
    slot = f["slot_a"]["name"]
    f["a"]["resolv"] = ""
    f["a"]["egress"] = {"proxy": "http://%s:3128" % f["slot_a"]["gateway"],
                        "connect": {ALLOW: "status 200", DENY: "status 403", LITERAL: "status 403",
                                    INSIDE: "status 403"},
                        "direct": {"10.99.20.1:18770": "TimeoutError"}, "dns": {"10.99.20.1": "TimeoutError"}}
    f["guest"]["egress"] = {
        "resolved": {"api.lab.test": "10.99.20.1", "evil.lab.test": "10.99.20.1"}, "qname": "api.lab.test",
        "reach": {ALLOW: "connected: hello", DENY: "connected: hello", INSIDE: "connected: hello"},
        "dns": {"10.99.20.1": "answered"},
        "log": [_log_line(slot, "api.lab.test", 18770, "10.99.20.1", "TCP_TUNNEL/200"),
                _log_line(slot, "evil.lab.test", 18771, "-", "TCP_DENIED/403"),
                _log_line(slot, "10.99.20.1", 18770, "-", "TCP_DENIED/403"),
                _log_line(slot, "guest.lab.test", 18798, "-", "TCP_DENIED/403")]}
    f["guest"]["counters_moved"]["drop_proxy_mode"] = 3
    return f


def verdicts(results):
    return dict((cid, r["verdict"]) for cid, r in results.items())


def not_passing(results):
    return dict((cid, r["verdict"]) for cid, r in results.items() if r["verdict"] != "pass")


def test_the_catalog_has_at_least_40_cases_with_unique_ids_by_area():
    ids = [c.id for c in catalog.CASES]
    assert len(ids) >= 40
    assert len(set(ids)) == len(ids)
    for c in catalog.CASES:
        assert re.match(r"^(FS|ID|SYS|NET|EGR|IPC|BRW|TEN|LIFE|LIM)-\d\d$", c.id), c.id
        assert c.title and c.probe and c.control, c.id


def test_each_case_is_one_object_in_its_areas_module():
    """catalog/<area>.py defines the area's cases, judge and loosening with
    them; the registry lists every area's, in catalog order."""
    modules = dict((m.__name__.rsplit(".", 1)[1], m) for m in (
        catalog.fs, catalog.id_, catalog.net, catalog.egr, catalog.ipc, catalog.brw, catalog.ten, catalog.life,
        catalog.lim))
    assert sorted(modules) == ["brw", "egr", "fs", "id", "ipc", "life", "lim", "net", "ten"]
    assert catalog.CASES == [c for m in modules.values() for c in m.CASES]
    for name, module in modules.items():
        for c in module.CASES:
            assert c.area.lower() == name and c.judge.__module__ == module.__name__, c.id
            assert c.loosening and (isinstance(c.loosening, str) or c.id in c.loosening.cases), c.id
    assert catalog.CASES is catalog.CASES and catalog.BY_ID is catalog.BY_ID


def test_a_guest_whose_boundaries_hold_passes_every_case(facts):
    results = catalog.judge(facts)
    assert set(results) == set(CIDR_CASES)
    assert not_passing(results) == {}
    assert audit.verdict_of(results)[:2] == ("passed", 0)


def test_a_proxy_mode_guest_judges_the_egr_cases_instead_of_the_nats(proxy_facts):
    """In proxy mode the EGR cases stand where NET-01, NET-05, NET-07 and
    TEN-06 (the NAT's egress, the cell's resolvers, the special ranges'
    drop) stand on the others."""
    results = catalog.judge(proxy_facts)
    assert set(results) == set(PROXY_CASES)
    assert set(CIDR_CASES) - set(PROXY_CASES) == {"NET-01", "NET-05", "NET-07", "TEN-06"}
    assert sorted(set(PROXY_CASES) - set(CIDR_CASES)) == ["EGR-0%d" % i for i in range(1, 7)]
    assert not_passing(results) == {}
    assert "through http://" in results["EGR-01"]["probe"] and "allowed in the proxy's log: 1 of 1" in \
        results["EGR-01"]["probe"]


# one loosened boundary of a proxy-mode guest: (where in the facts, the value, the one case that must fail)
EGR_FAILURES = [
    (("a", "egress", "connect", DENY), "status 200", "EGR-02"),
    (("guest", "egress", "log", 1), _log_line("slot0", "evil.lab.test", 18771, "10.99.20.1", "TCP_DENIED/403"),
     "EGR-02"),
    (("a", "egress", "connect", LITERAL), "status 200", "EGR-03"),
    (("guest", "egress", "log", 2), None, "EGR-03"),
    (("a", "egress", "connect", INSIDE), "status 200", "EGR-04"),
    (("a", "egress", "dns", "10.99.20.1"), "answered", "EGR-05"),
    (("a", "egress", "dns", "10.99.20.1"), "ECONNREFUSED", "EGR-05"),
    (("a", "resolv"), "nameserver 10.99.20.1\n", "EGR-05"),
    (("a", "egress", "direct", "10.99.20.1:18770"), "connected: hello", "EGR-06"),
]


@pytest.mark.parametrize("path,value,case", EGR_FAILURES, ids=lambda x: x if isinstance(x, str) else None)
def test_what_got_past_the_proxy_fails_exactly_its_case(proxy_facts, path, value, case):
    _set(proxy_facts, path, value)
    if value is None:
        proxy_facts["guest"]["egress"]["log"] = [x for x in proxy_facts["guest"]["egress"]["log"] if x]
    assert not_passing(catalog.judge(proxy_facts)) == {case: "fail"}


def test_a_refused_allowed_name_fails_egr_01_and_errs_the_literal_beside_it(proxy_facts):
    proxy_facts["a"]["egress"]["connect"][ALLOW] = "status 403"
    results = catalog.judge(proxy_facts)
    assert not_passing(results) == {"EGR-01": "fail", "EGR-03": "error"}
    proxy_facts["a"]["egress"]["connect"][ALLOW] = "status 200"
    proxy_facts["guest"]["egress"]["log"].pop(0)  # tunnelled, but the proxy wrote no line of it
    assert not_passing(catalog.judge(proxy_facts)) == {"EGR-01": "fail"}


@pytest.mark.parametrize("path,value,cases", [
    (("guest", "egress", "reach", DENY), "TimeoutError", ["EGR-02"]),
    (("guest", "egress", "reach", INSIDE), "ECONNREFUSED", ["EGR-04"]),
    (("guest", "egress", "dns", "10.99.20.1"), "TimeoutError", ["EGR-05"]),
    (("guest", "egress", "reach", ALLOW), "does not resolve", ["EGR-01", "EGR-06"]),
])
def test_an_egr_control_that_failed_is_an_error(proxy_facts, path, value, cases):
    _set(proxy_facts, path, value)
    assert not_passing(catalog.judge(proxy_facts)) == dict((c, "error") for c in cases)


def _proxy_refusal(facts, count):
    """chv-browser's opens of the denied targets answered by the proxy's 403
    page, and ``count`` denied lines of the doors (from cell A's gateway)."""
    page = {"title": "ERROR: The requested URL could not be retrieved", "url": "http://10.99.20.2:18798/",
            "status": 403, "truncated": False, "aria_snapshot": '- heading "ERROR"'}
    for key in facts["a"]["browser"]["denied"]:
        facts["a"]["browser"]["denied"][key] = {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": page})}
    line = _log_line(facts["slot_a"]["name"], "10.99.20.2", 18798, "-", "TCP_DENIED/403")
    facts["guest"]["egress"]["log"] += [dict(line, src=facts["slot_a"]["gateway"])] * count
    for name in ("drop_door_to_guest", "drop_door_to_cell"):
        facts["guest"]["counters_moved"].pop(name, None)


def test_in_proxy_mode_the_proxys_refusal_of_a_door_is_a_refusal(proxy_facts):
    """The doors go through the proxy: its 403 for each denied open, each
    with its denied line, holds BRW-01 to BRW-03 without the kernel's drop
    counters; a 403 without its line, or a page that opened, does not."""
    _proxy_refusal(proxy_facts, len(proxy_facts["a"]["browser"]["denied"]))
    results = catalog.judge(proxy_facts)
    assert not_passing(results) == {}
    assert "refused by the proxy: 403" in results["BRW-01"]["probe"]
    proxy_facts["guest"]["egress"]["log"].pop()
    assert not_passing(catalog.judge(proxy_facts)) == {"BRW-01": "fail", "BRW-02": "fail", "BRW-03": "fail"}
    _proxy_refusal(proxy_facts, 1)
    opened = {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": {"status": 200, "aria_snapshot": "x"}})}
    proxy_facts["a"]["browser"]["denied"]["metadata"] = opened
    assert not_passing(catalog.judge(proxy_facts)) == {"BRW-02": "fail"}


def test_the_door_loosenings_do_not_apply_in_proxy_mode(policy):
    ctx = {"pol": dict(policy, egress_proxy={"port": 3128}), "slot_a": policy["slots"][0],
           "slot_b": policy["slots"][1], "opts": {"allow_url": "http://a.test/", "metadata_stand_in": True}}
    for cid in ("BRW-01", "BRW-02", "BRW-03"):
        assert catalog.BY_ID[cid].loosening.needs(ctx).startswith("proxy mode: the egress proxy refuses"), cid
        assert catalog.BY_ID[cid].loosening.needs(dict(ctx, pol=policy)) is None, cid


def test_without_the_names_the_egr_cases_skip_by_option(proxy_facts):
    proxy_facts["a"]["egress"].update(connect={}, direct={})
    results = catalog.judge(proxy_facts)
    assert not_passing(results) == dict((c, "skip") for c in ("EGR-01", "EGR-02", "EGR-03", "EGR-04", "EGR-06"))
    assert "--deny-name" in results["EGR-02"]["probe"] and "--inside-name" in results["EGR-04"]["probe"]


def test_no_report_from_cell_a_makes_every_case_an_error(facts):
    facts["a"] = None
    facts["a_error"] = "chv-cell run exited 125: nspawn: No such file or directory"
    results = catalog.judge(facts)
    assert set(verdicts(results).values()) == {"error"}
    assert "exited 125" in results["FS-01"]["control"]
    verdict, code, counts = audit.verdict_of(results)
    assert (verdict, code, counts["error"]) == ("error", audit.EXIT_ERROR, len(CIDR_CASES))


# cell A's attempts that one case's boundary must refuse: {section of cell A's report: {key: case}};
# each fails its case when it got through ("ok")
GOT_THROUGH = {
    "read": {"etc_chv": "FS-01", "credentials": "FS-02", "other_workspace": "FS-03", "other_shots": "FS-04",
             "hidden:/usr/lib/chromium": "FS-05", "state_dir": "FS-06"},
    "write": {"usr": "FS-07", "trusted:/etc/chv-fleet/cell-policy.json": "FS-09"},
    "kernel": {"io_uring_setup": "ID-06", "unshare_user": "ID-07", "mount_tmpfs": "ID-08", "mknod_chr": "ID-09",
               "raw_socket": "ID-10", "ptrace_guest": "ID-11", "setns_own": "ID-12", "kill0_guest": "ID-13"},
}
# cell A's connects that one case's drop must stop: {key of cell A's tcp report: case}; each fails its
# case when it was answered
ANSWERED = {"cell_b": "NET-02", "guest:10.99.20.2": "NET-03", "metadata": "NET-04", "deny:192.0.2.10:80": "NET-05",
            "special": "TEN-06"}
# one loosened boundary: (where in the facts, the value, the one case that must fail)
PROBE_FAILURES = [(("a", section, key), "ok", case) for section, keys in GOT_THROUGH.items()
                  for key, case in keys.items()] + \
    [(("a", "tcp", key), "connected: hello", case) for key, case in ANSWERED.items()] + [
    (("guest", "etc_write_seen"), True, "FS-08"),
    (("guest", "trusted_changed"), ["/etc/chv-fleet/cell-policy.json"], "FS-09"),
    (("a", "uid_map"), ["0", "0", "65536"], "ID-01"),
    (("a", "NoNewPrivs"), "0", "ID-05"),
    (("a", "kernel", "io_uring_setup"), "ENOSYS", "ID-06"),
    (("a", "kernel", "nsenter_guest"), {"rc": 0, "err": ""}, "ID-12"),
    (("a", "kernel", "marker_seen"), [4242], "ID-13"),
    (("a", "kernel", "ip_addr_add"), {"rc": 0, "err": ""}, "ID-14"),
    (("a", "kernel", "ip_route_add"), {"rc": 0, "err": ""}, "ID-15"),
    (("a", "tcp", "allow:10.99.20.1:18770"), "TimeoutError", "NET-01"),
    (("a", "tcp6", "2001:db8::1"), "connected: hello", "NET-06"),
    (("a", "resolv"), "nameserver 127.0.0.53\n", "NET-07"),
    (("guest", "broker_root"), {"rc": 0, "out": '{"ok": true}', "err": ""}, "IPC-02"),
    (("guest", "broker_cell_uid"), {"rc": 0, "out": '{"ok": true}', "err": ""}, "IPC-03"),
    (("a", "broker", "unknown"), {"rc": 0, "out": '{"ok": true}', "err": ""}, "IPC-04"),
    (("a", "browser", "denied", "guest:127.0.0.1"), {"rc": 0, "err": "", "out": '{"ok": true, "result": {}}'},
     "BRW-01"),
    (("guest", "listener_seen"), [{"local": "127.0.0.1", "peer": "127.0.0.1"}], "BRW-01"),
    (("guest", "counters_moved", "drop_door_to_guest"), 0, "BRW-01"),
    (("a", "browser", "denied", "metadata"), {"rc": 0, "err": "", "out": '{"ok": true, "result": {}}'}, "BRW-02"),
    (("guest", "listener_seen"), [{"local": "169.254.169.254", "peer": "127.0.0.1"}], "BRW-02"),
    (("a", "browser", "denied", "cell_b"), {"rc": 0, "err": "", "out": '{"ok": true, "result": {}}'}, "BRW-03"),
    (("guest", "b_listener_seen"), ["10.231.11.1"], "BRW-03"),
    (("guest", "counters_moved", "drop_door_to_cell"), 0, "BRW-03"),
    (("a", "browser", "allowed"), {"rc": 0, "err": "", "out": json.dumps(
        {"ok": True, "result": {"title": "chv-audit", "aria_snapshot": '- heading "chv-audit"',
                                "html": "<h1>chv-audit</h1>"}})}, "BRW-04"),
    (("a", "browser", "allowed"), {"rc": 0, "err": "", "out": json.dumps(
        {"ok": True, "result": {"title": "chv-audit", "aria_snapshot": '- heading "chv-audit" chv-audit-raw-html'}})},
     "BRW-04"),
    # TEN: the sync door let a hostile repository through, or a reply carried slot B's text
    (("a", "sync", "replies", "packed_refs"), {"rc": 0, "err": "", "out": json.dumps(
        {"ok": True, "result": {"returncode": 0, "stdout": "", "stderr": ""}})}, "TEN-01"),
    (("a", "sync", "replies", "alternates"), {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "fatal: bad object chv-audit-bstate-0badcafe"})}, "TEN-01"),
    (("guest", "quota_b_ping"), {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "busy: chv-broker serves at most 16 connections at once (max_connections)"})}, "TEN-02"),
    (("a", "quota", "replies"), ["idle"] * 6, "TEN-02"),
    (("a", "quota", "replies"), ["idle"] * 4 + ['{"ok": false, "error": "busy: slot slot1 is at its quota of 4 '
                                                'connections open (max_connections_per_slot)"}'] * 2, "TEN-02"),
    (("run2", "snapshot"), {"rc": 0, "err": "", "out": json.dumps(
        {"ok": True, "result": {"title": "chv-audit-cookie", "aria_snapshot": "- heading"}})}, "TEN-03"),
    (("run2", "open"), {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": {
        "title": "chv-audit-cookie", "aria_snapshot": '- heading "chv-audit-cookie"\n- heading '
        '"sent:[chv_audit=0badcafe-kept]"'}})}, "TEN-03"),
    (("a", "kernel", "families", "denied", "AF_VSOCK"), "ok", "TEN-04"),
    (("a", "kernel", "families", "denied", "AF_PACKET"), "EPERM", "TEN-04"),
    (("a", "kernel", "families", "vsock_bind"), "ok", "TEN-04"),
    (("a", "kernel", "families", "high_bits"), "ok", "TEN-04"),
    (("a", "disk", "big"), "ok", "TEN-05"),
    (("a", "disk", "size"), 2 << 30, "TEN-05"),
    (("guest", "disk", "image_grew"), 1 << 20, "TEN-05"),
    (("guest", "counters_moved", "drop_special_range"), 0, "TEN-06"),
    (("a", "browser", "denied", "special"), {"rc": 0, "err": "", "out": '{"ok": true, "result": {}}'}, "TEN-06"),
    (("guest", "forged", "record"), {"exit": 75, "payload_exit": None, "payload_started": False, "slot": None,
                                     "verdict": "busy"}, "TEN-07"),
    (("guest", "forged", "write"), "ok", "TEN-07"),
    (("guest", "read", "other_slot"), {"rc": 0, "out": "chv-audit-bws-0badcafe\n", "err": "", "seconds": 0.05},
     "TEN-08"),
    (("guest", "read", "shadow"), {"rc": 65, "out": "root:*:19000:0:99999:7:::\n", "err": "", "seconds": 0.05},
     "TEN-08"),
    (("guest", "read", "fifo"), {"rc": None, "out": "", "err": "no answer within 30 s", "seconds": 30.0}, "TEN-08"),
    (("guest", "slot_dirs", 0, "mode"), "2750", "TEN-09"),
    (("guest", "slot_dirs", 3, "gid"), 64321, "TEN-09"),
    (("guest", "left_behind"), ["interface ve-slot0"], "LIFE-01"),
    (("guest", "runs"), [0, 0, 125, 0], "LIFE-02"),
    (("guest", "busy", "extra_rc"), 0, "LIFE-03"),
    (("guest", "sigkill"), {"started": True, "after_rc": 75}, "LIFE-04"),
    (("guest", "runtime"), {"control_rc": 0, "limited_rc": 0}, "LIM-01"),
    (("guest", "tasks"), {"limit": 64, "control": 4, "started": 80}, "LIM-02"),
]


def _set(facts, path, value):
    node = facts
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = copy.deepcopy(value)


@pytest.mark.parametrize("path,value,case", PROBE_FAILURES, ids=lambda x: x if isinstance(x, str) else None)
def test_a_probe_that_got_through_fails_exactly_its_case(facts, path, value, case):
    _set(facts, path, value)
    results = catalog.judge(facts)
    assert not_passing(results) == {case: "fail"}
    assert audit.verdict_of(results)[:2] == ("failed", audit.EXIT_FAILED)


def test_every_probed_case_has_a_failure_above():
    probed = set(entry[2] for entry in PROBE_FAILURES + EGR_FAILURES)
    # ID-02 and ID-03/04 are covered below; IPC-01's and EGR-01's failures are their own probes
    assert set(catalog.BY_ID) - probed == {"ID-02", "ID-03", "ID-04", "IPC-01", "EGR-01"}


def test_what_the_tenant_cases_lack_is_a_skip_by_name(facts):
    """No git, no socket family list, no disk quota, no --special, no vsock on
    the guest, a broker without the sync op: each its own skip, named."""
    facts["sync_skip"] = "git on the guest (the sync door's worker and the cell's git init)"
    facts["families_skip"] = "a socket_families list in the policy (it has 'any': no filter)"
    del facts["guest"]["disk"]
    del facts["a"]["tcp"]["special"]
    facts["quota_skip"] = "a second slot"
    results = catalog.judge(facts)
    assert not_passing(results) == dict((c, "skip") for c in ("TEN-01", "TEN-02", "TEN-04", "TEN-05", "TEN-06"))
    assert "git" in results["TEN-01"]["probe"] and "disk_max" in results["TEN-05"]["probe"]
    assert "--special" in results["TEN-06"]["probe"]
    facts2 = good_facts(facts["policy"], facts["broker_client"])
    facts2["guest"]["vsock_guest"] = "socket: EAFNOSUPPORT"
    facts2["a"]["sync"]["replies"]["clean"] = {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "unknown or disabled op: 'sync'"})}
    results = catalog.judge(facts2)
    assert not_passing(results) == {"TEN-01": "skip", "TEN-04": "skip"}
    assert "AF_VSOCK" in results["TEN-04"]["probe"] and "sync op" in results["TEN-01"]["probe"]


def test_a_warm_slot_may_record_unknown_but_never_busy(facts):
    facts["guest"]["forged"]["record"]["verdict"] = "unknown"
    assert not_passing(catalog.judge(facts)) == {"TEN-07": "fail"}
    facts["guest"]["forged"]["warm"] = True
    assert not_passing(catalog.judge(facts)) == {}


def test_the_cookie_page_sets_its_cookie_and_shows_what_it_got_and_the_page_stays():
    body, extra = audit.Listener.page(b"GET /chv-audit-cookie?v=0badcafe HTTP/1.1\r\nHost: h\r\n"
                                      b"Cookie: chv_audit=0badcafe-kept; x=<b>\r\n\r\n")
    assert extra == b"Set-Cookie: chv_audit=0badcafe-kept; Path=/; Max-Age=3600\r\n"
    assert b"<h2>sent:[chv_audit=0badcafe-kept; x=&lt;b&gt;]</h2>" in body
    assert factsmod.cookie_sent("0badcafe").encode() in body
    assert audit.Listener.page(b"GET /chv-audit-cookie?v=<script> HTTP/1.1\r\n\r\n")[1] == \
        b"Set-Cookie: chv_audit=script-kept; Path=/; Max-Age=3600\r\n"
    assert audit.Listener.page(b"GET / HTTP/1.1\r\n\r\n") == (audit.PAGE.encode(), b"")
    assert audit.Listener.page(b"") == (audit.PAGE.encode(), b"")
    assert audit.cookie_url("http://10.99.20.1:18770/", "ab") == "http://10.99.20.1:18770/chv-audit-cookie?v=ab"


def test_the_listener_serves_the_cookie_page_over_http():
    import urllib.request

    with audit.Listener("127.0.0.1") as srv:
        url = "http://127.0.0.1:%d/chv-audit-cookie?v=abc" % srv.port
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Cookie": "chv_audit=abc-kept"}),
                                    timeout=10) as r:
            assert r.headers["Set-Cookie"].startswith("chv_audit=abc-kept;")
            assert b"sent:[chv_audit=abc-kept]" in r.read()
        with urllib.request.urlopen("http://127.0.0.1:%d/" % srv.port, timeout=10) as r:
            assert r.read() == audit.PAGE.encode()


def test_the_quota_defaults_are_chv_brokers(tmp_path):
    from chv_guest.broker.config import DEFAULTS

    cfg = tmp_path / "broker.json"
    cfg.write_text(json.dumps({"max_connections_per_slot": 7}))
    got = audit.broker_limits(str(cfg))
    assert (got["max_connections_per_slot"], got["read_timeout"]) == (7, DEFAULTS["read_timeout"])
    missing = audit.broker_limits(str(tmp_path / "missing.json"))
    assert "the defaults" in missing["config"]
    assert missing["max_connections_per_slot"] == DEFAULTS["max_connections_per_slot"]


def test_cell_a_arriving_at_cell_b_is_net_02s_failure_not_the_doors(facts):
    facts["a"]["tcp"]["cell_b"] = "connected: hello"
    facts["guest"]["b_listener_seen"] = [facts["slot_a"]["address"]]
    assert not_passing(catalog.judge(facts)) == {"NET-02": "fail"}


def test_a_dropped_capability_in_a_set_fails_that_set(facts):
    facts["a"]["CapEff"] = _mask(set(policymod.CAP_NAMES))
    assert not_passing(catalog.judge(facts)) == {"ID-03": "fail"}
    facts["a"]["CapBnd"] = facts["a"]["CapEff"]
    assert not_passing(catalog.judge(facts)) == {"ID-03": "fail", "ID-04": "fail"}
    assert "CAP_SYS_ADMIN" in catalog.judge(facts)["ID-04"]["probe"]


def test_overlapping_uid_ranges_fail_id_02(facts):
    facts["b"]["uid_map"] = ["0", str(facts["slot_a"]["uid_base"] + 1000), "65536"]
    assert not_passing(catalog.judge(facts)) == {"ID-02": "fail"}


def test_an_unanswered_cell_ping_fails_ipc_01_and_errs_the_cases_it_controls(facts):
    facts["a"]["broker"]["ping"] = {"rc": 1, "out": "", "err": "ECONNREFUSED"}
    assert not_passing(catalog.judge(facts)) == {"IPC-01": "fail", "IPC-02": "error", "IPC-03": "error"}


# a broken control: (where, value, the cases it controls, which turn to errors)
CONTROL_FAILURES = [
    (("a", "read", "os_release"), "ENOENT", {"FS-01"}),
    (("a", "read", "ordinary"), "EACCES", {"FS-02"}),
    (("a", "write", "workspace"), "EROFS", {"FS-07", "FS-08", "FS-09", "TEN-09"}),
    (("guest", "workspace_write_seen"), False, {"FS-07", "FS-08", "FS-09", "TEN-09"}),
    (("a", "uid"), 65534, {"ID-01"}),
    (("a", "CapEff"), "", {"ID-03"}),
    (("a", "kernel", "syscall_getpid"), "bad", {"ID-06"}),
    (("a", "kernel", "unshare_none"), "EPERM", {"ID-07"}),
    (("a", "kernel", "mkfifo"), "EROFS", {"ID-09"}),
    (("a", "kernel", "dgram_socket"), "EAFNOSUPPORT", {"ID-10"}),
    (("a", "kernel", "kill0_own_child"), "EPERM", {"ID-11"}),
    (("a", "kernel", "nsenter_version"), {"rc": None, "err": "FileNotFoundError"}, {"ID-12"}),
    (("guest", "marker_alive"), False, {"ID-13"}),
    (("a", "kernel", "ip_route_show"), {"rc": None, "err": "FileNotFoundError"}, {"ID-15"}),
    (("guest", "reach", "10.99.20.1:18770"), "ECONNREFUSED", {"NET-01"}),
    (("b", "self"), "TimeoutError", {"NET-02", "BRW-03"}),
    (("a", "neigh_out"), "", {"NET-03", "NET-06"}),
    (("guest", "reach", "metadata"), "TimeoutError", {"NET-04"}),
    (("a", "resolv"), "ENOENT", {"NET-07"}),
    (("a", "broker", "ping_after"), {"rc": 1, "out": "", "err": "EPIPE"}, {"IPC-04"}),
    (("guest", "b_seen_running"), False, {"LIFE-01"}),
    (("a", "browser", "allowed"), {"rc": 2, "err": "ConnectionRefusedError", "out": ""},
     {"BRW-01", "BRW-02", "BRW-03", "BRW-04"}),
    (("a", "browser", "allowed"), {"rc": 0, "err": "", "out": json.dumps(
        {"ok": True, "result": {"title": "other", "aria_snapshot": '- heading "another page"'}})}, {"BRW-04"}),
    (("guest", "sigkill"), {"started": False, "after_rc": 0}, {"LIFE-04"}),
    (("guest", "runtime"), {"control_rc": 125, "limited_rc": 124}, {"LIM-01"}),
    (("guest", "tasks"), {"limit": 64, "control": 0, "started": 0}, {"LIM-02"}),
    (("a", "sync", "replies", "clean"), {"rc": 1, "err": "", "out": json.dumps(
        {"ok": False, "error": "sync rejected: repo has no .git directory"})}, {"TEN-01"}),
    (("a", "sync", "setup", "packed_refs"), "git init: rc 127 not found", {"TEN-01"}),
    (("guest", "b_files_readable"), False, {"TEN-01"}),
    (("a", "quota", "still_held"), 0, {"TEN-02"}),
    (("a", "quota", "ping_after"), {"rc": 1, "err": "", "out": '{"ok": false, "error": "busy: slot slot0"}'},
     {"TEN-02"}),
    (("a", "cookie", 1), {"rc": 0, "err": "", "out": json.dumps({"ok": True, "result": {
        "title": "chv-audit-cookie", "aria_snapshot": '- heading "sent:[]"'}})}, {"TEN-03"}),
    (("run2", "open"), {"rc": 1, "err": "", "out": '{"ok": false, "error": "browser unavailable"}'}, {"TEN-03"}),
    (("run2",), None, {"TEN-03"}),
    (("a", "kernel", "families", "allowed", "AF_NETLINK"), "EAFNOSUPPORT", {"TEN-04"}),
    (("a", "disk", "small"), "ENOSPC", {"TEN-05"}),
    (("guest", "disk", "own_device"), False, {"TEN-05"}),
    (("guest", "reach", "special"), "TimeoutError", {"TEN-06"}),
    (("guest", "busy", "extra_record"), None, {"TEN-07"}),
    (("guest", "read", "file"), {"rc": 66, "out": "", "err": "no such file", "seconds": 0.05}, {"TEN-08"}),
    (("a", "plant", "fifo"), "EPERM", {"TEN-08"}),
    (("guest", "slot_dirs", 1), {"path": "/var/lib/chv-fleet/agent-state/slot0", "error": "No such file"},
     {"TEN-09"}),
]


@pytest.mark.parametrize("path,value,cases", CONTROL_FAILURES, ids=lambda x: x if isinstance(x, str) else None)
def test_a_failed_control_is_an_error_even_when_the_probe_was_stopped(facts, path, value, cases):
    _set(facts, path, value)
    results = catalog.judge(facts)
    assert not_passing(results) == dict((c, "error") for c in cases)
    for c in cases:
        assert results[c]["control"].startswith("CONTROL FAILED")
    assert audit.verdict_of(results)[:2] == ("error", audit.EXIT_ERROR)


def test_a_failed_control_beside_a_probe_that_got_through_is_still_an_error(facts):
    facts["a"]["kernel"]["raw_socket"] = "ok"
    facts["a"]["kernel"]["dgram_socket"] = "EPERM"
    assert not_passing(catalog.judge(facts)) == {"ID-10": "error"}


@pytest.mark.parametrize("case,counter", sorted(catalog.DROP_COUNTERS.items()))
def test_a_timeout_without_its_drop_counter_moving_is_no_drop(facts, proxy_facts, case, counter):
    """A connect can time out for other reasons (a cell without a route):
    the drop must be the ruleset's, by its own counter."""
    mode = catalog.BY_ID[case].mode or "cidr"
    facts = proxy_facts if mode == "proxy" else facts
    del facts["guest"]["counters_moved"][counter]
    results = catalog.judge(facts)
    assert not_passing(results) == dict((c, "fail") for c, name in catalog.DROP_COUNTERS.items()
                                        if name == counter and catalog.BY_ID[c].applies(mode))
    assert "%s +0" % counter in results[case]["probe"]


def test_a_refused_connect_is_not_a_drop(facts):
    """The ruleset drops: a refusal means the packet got through to a
    closed port, so only a timeout counts as the boundary."""
    facts["a"]["tcp"]["guest:10.99.20.2"] = "ECONNREFUSED"
    assert not_passing(catalog.judge(facts)) == {"NET-03": "fail"}


@pytest.mark.parametrize("drop,case,needle", [
    (("guest", "tasks"), "LIM-02", "pids"),
    (("guest", "busy"), "LIFE-03", "idle"),
])
def test_what_the_guest_lacks_is_a_skip_with_its_requirement(facts, drop, case, needle):
    del facts[drop[0]][drop[1]]
    facts["guest"]["tasks_skip"] = "the pids cgroup controller delegated to the cells"
    facts["guest"]["busy_skip"] = "every slot idle (busy: slot1)"
    results = catalog.judge(facts)
    # TEN-07's control is LIFE-03's busy run
    assert not_passing(results) == dict((c, "skip") for c in [case] + (["TEN-07"] if case == "LIFE-03" else []))
    assert needle in results[case]["probe"]
    assert audit.verdict_of(results)[:2] == ("passed", 0)
    assert audit.verdict_of(results, strict_skips=True)[:2] == ("failed", audit.EXIT_FAILED)


def test_one_slot_and_no_destinations_skip_what_needs_them(facts):
    facts["slot_b"] = facts["b"] = None
    for key in ("other_workspace", "other_shots"):
        del facts["a"]["read"][key]
    for key in [k for k in facts["a"]["tcp"] if k.startswith(("allow:", "deny:", "metadata", "cell_b"))]:
        del facts["a"]["tcp"][key]
    del facts["a"]["broker"]
    del facts["a"]["browser"]
    facts["sync_skip"] = facts["quota_skip"] = "a second slot"
    del facts["guest"]["read"]["other_slot"]
    del facts["a"]["tcp"]["special"]
    results = catalog.judge(facts)
    assert sorted(not_passing(results)) == ["BRW-01", "BRW-02", "BRW-03", "BRW-04", "FS-03", "FS-04", "ID-02",
                                            "IPC-01", "IPC-02", "IPC-03", "IPC-04", "NET-01", "NET-02", "NET-04",
                                            "NET-05", "TEN-01", "TEN-02", "TEN-03", "TEN-06"]
    assert set(not_passing(results).values()) == {"skip"}
    assert "--allow" in results["NET-01"]["probe"]


def test_the_report_lists_every_case_in_catalog_order_with_its_evidence(facts):
    facts["a"]["kernel"]["raw_socket"] = "ok"
    rep = audit.report(catalog.judge(facts), {"guest": "g1", "policy_sha256": "ab" * 32, "commit": "abc1234"})
    assert [c["id"] for c in rep["cases"]] == CIDR_CASES
    assert rep["verdict"] == "failed" and rep["exit"] == audit.EXIT_FAILED
    assert rep["counts"] == {"pass": len(CIDR_CASES) - 1, "fail": 1, "error": 0, "skip": 0}
    by_id = dict((c["id"], c) for c in rep["cases"])
    assert by_id["ID-10"]["probe"] == "raw_socket: ok" and by_id["ID-10"]["control"] == "dgram_socket: ok"
    md = audit.to_markdown(rep)
    assert "| ID-10 | No raw sockets | FAIL | raw_socket: ok | dgram_socket: ok |" in md
    assert "- commit: abc1234" in md
    assert json.loads(json.dumps(rep)) == rep


def test_markdown_cells_stay_one_row(facts):
    facts["a"]["kernel"]["ip_addr_add"] = {"rc": 0, "err": "line one\nline | two"}
    rep = audit.report(catalog.judge(facts), {"guest": "g1"})
    row = [line for line in audit.to_markdown(rep).splitlines() if line.startswith("| ID-14 |")]
    assert row == ["| ID-14 | No address change in the cell | FAIL | ip_addr_add: rc 0 line one / line / two "
                   "| ip_addr_show: rc 0 |"]


def test_junit_counts_and_elements(facts, tmp_path):
    facts["a"]["kernel"]["raw_socket"] = "ok"
    facts["a"]["kernel"]["kill0_own_child"] = "EPERM"
    del facts["guest"]["tasks"]
    facts["guest"]["tasks_skip"] = "pids"
    rep = audit.report(catalog.judge(facts), {"guest": "g1", "kernel": "6.1"})
    audit.write_reports(rep, str(tmp_path / "r"))
    assert sorted(os.listdir(str(tmp_path / "r"))) == ["audit.json", "audit.md", "audit.xml"]
    suite = ET.parse(str(tmp_path / "r" / "audit.xml")).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == \
        (str(len(CIDR_CASES)), "1", "1", "1")
    cases = suite.findall("testcase")
    assert len(cases) == len(CIDR_CASES)
    tags = dict((c.get("name").split()[0], [e.tag for e in c]) for c in cases)
    assert tags["ID-10"] == ["failure"] and tags["ID-11"] == ["error"] and tags["LIM-02"] == ["skipped"]
    assert tags["FS-01"] == ["system-out"]
    props = dict((p.get("name"), p.get("value")) for p in suite.find("properties"))
    assert props == {"guest": "g1", "kernel": "6.1"}
    assert json.load(open(str(tmp_path / "r" / "audit.json")))["counts"]["fail"] == 1


def test_the_docs_carry_the_catalog_as_the_code_has_it():
    """docs/isolation-cases.md's table is the objects' (hack/isolation_cases_doc.py writes it)."""
    with open(os.path.join(ROOT, "docs", "isolation-cases.md")) as fh:
        doc = fh.read()
    assert catalog.catalog_markdown() in doc
    for c in catalog.CASES:
        assert "| %s | %s | %s | %s | %s |" % (c.id, c.label, c.probe, c.control, c.counter_proof()) in doc, c.id
    for cid, reason in counterproof.NOT_COUNTER_PROVABLE.items():
        assert "none here: %s" % reason in doc, cid


# ------------------------------------------------------------- counter-proofs

def test_every_case_is_counter_proven_or_says_why_not():
    loosened = [cid for lo in counterproof.LOOSENINGS for cid in lo.cases]
    assert len(loosened) == len(set(loosened))
    assert set(loosened) | set(counterproof.NOT_COUNTER_PROVABLE) == set(catalog.BY_ID)
    assert not set(loosened) & set(counterproof.NOT_COUNTER_PROVABLE)
    assert all(counterproof.NOT_COUNTER_PROVABLE.values())


def _ctx(policy, tmp_path, **opts):
    return {"pol": policy, "slot_a": policy["slots"][0], "slot_b": policy["slots"][1],
            "opts": dict({"metadata_stand_in": True, "deny": ["192.168.254.254:18771"],
                          "allow_url": "http://10.99.20.1:18771/"}, **opts)}


@pytest.mark.parametrize("name", [lo.name for lo in counterproof.LOOSENINGS if lo.edit])
def test_each_loosened_policy_passes_the_launchers_policy_check_and_loosens_one_thing(
        raw_policy, policy, tmp_path, name):
    lo = next(lo for lo in counterproof.LOOSENINGS if lo.name == name)
    raw_policy["drop_capabilities"] = policy["drop_capabilities"] + ["CAP_SYS_NICE"]
    before = copy.deepcopy(raw_policy)
    ctx = _ctx(policymod.merged(raw_policy), tmp_path)
    loose = counterproof.loosened_policy(raw_policy, lo, ctx)
    assert raw_policy == before
    assert policymod.validate(loose) == []
    changed = sorted(k for k in set(loose) | set(raw_policy) if loose.get(k) != raw_policy.get(k))
    assert 1 <= len(changed) <= 2, changed


def test_the_ruleset_loosenings_match_cell_a_and_the_audits_destinations_only(policy, tmp_path):
    ctx = _ctx(dict(policy, dns_servers=["192.0.2.53"]), tmp_path, allow_name=["10.99.20.1:18770"])
    a, b = policy["slots"][0], policy["slots"][1]
    rules = dict((lo.name, lo.rules(ctx)) for lo in counterproof.LOOSENINGS if lo.rules)
    assert rules == {
        "NET-02": [("forward", 'iifname "%s" ip daddr %s accept' % (a["host_ifname"], b["address"])),
                   ("forward", 'iifname "%s" ip daddr %s accept' % (b["host_ifname"], a["address"]))],
        "NET-03": [("input", 'iifname "%s" ip daddr != 169.254.169.254 accept' % a["host_ifname"])],
        "NET-04": [("input", 'iifname "%s" ip daddr 169.254.169.254 accept' % a["host_ifname"])],
        "NET-05": [("forward", 'iifname "%s" ip daddr 192.168.254.254 accept' % a["host_ifname"])],
        "BRW-01": [("output", "meta skuid @door_uids ip daddr != 169.254.169.254 tcp dport 18798 accept")],
        "BRW-02": [("output", "meta skuid @door_uids ip daddr 169.254.169.254 tcp dport 18798 accept")],
        "BRW-03": [("output", "meta skuid @door_uids ip daddr %s tcp dport 18799 accept" % b["address"])],
        "EGR-05": [("forward", 'iifname "%s" ip daddr 192.0.2.53 udp dport 53 accept' % a["host_ifname"])],
        "EGR-06": [("forward", 'iifname "%s" ip daddr 10.99.20.1 tcp dport 18770 accept' % a["host_ifname"])],
    }


def test_the_special_range_loosening_is_one_element_of_the_carve_out_set(policy, tmp_path, monkeypatch):
    """TEN-06's loosening: the --special stand-in as a /32 of carve_nets, with
    the counter-proof's comment; removal deletes only elements carrying it."""
    lo = next(lo for lo in counterproof.LOOSENINGS if lo.name == "TEN-06")
    ctx = _ctx(policy, tmp_path, special="198.18.254.254:18772")
    assert lo.elements(ctx) == [("carve_nets", "198.18.254.254")] and lo.rules is None and lo.edit is None
    assert "--special" in lo.needs(_ctx(policy, tmp_path))
    calls = []

    class Done(object):
        def __init__(self, rc=0, out=""):
            self.returncode, self.stdout, self.stderr = rc, out, "Error: conflicting intervals" if rc else ""

    listed = {"nftables": [{"set": {"name": "carve_nets", "elem": [
        "10.99.20.1", {"elem": {"val": "198.18.254.254", "comment": counterproof.COMMENT}},
        {"elem": {"val": "198.18.0.9", "comment": "the operator's"}}]}}]}

    def nft(pol, *args):
        calls.append(args)
        return Done(out=json.dumps(listed)) if args[0] == "-j" else Done()
    monkeypatch.setattr(counterproof, "_nft", nft)
    counterproof.insert_elements(policy, lo.elements(ctx))
    assert calls[-1] == ("add", "element", "inet", "chv_cell", "carve_nets",
                         '{ 198.18.254.254 comment "%s" }' % counterproof.COMMENT)
    assert counterproof.remove_elements(policy) == 1
    assert calls[-1] == ("delete", "element", "inet", "chv_cell", "carve_nets", "{ 198.18.254.254 }")
    monkeypatch.setattr(counterproof, "_nft", lambda pol, *args: Done(rc=1))
    with pytest.raises(RuntimeError, match="conflicting intervals"):
        counterproof.insert_elements(policy, lo.elements(ctx))


def test_a_loosening_this_guest_cannot_show_says_why(policy, tmp_path):
    ctx = _ctx(policy, tmp_path, metadata_stand_in=False, deny=[])
    by_name = dict((lo.name, lo) for lo in counterproof.LOOSENINGS)
    assert "--metadata-stand-in" in by_name["NET-04"].needs(ctx)
    assert "--deny" in by_name["NET-05"].needs(ctx)
    assert by_name["NET-03"].needs is None
    ctx["slot_b"] = None
    assert "one slot" in by_name["NET-02"].needs(ctx)


def test_a_loosening_whose_cases_were_skipped_before_is_not_applicable(policy, tmp_path):
    """A guest without chv-browser skips the BRW cases: loosening the door
    rules cannot make them fail, so they are not applicable, not unproven."""
    by_name = dict((lo.name, lo) for lo in counterproof.LOOSENINGS)
    before = _rep({"BRW-01": "skip", "BRW-02": "skip", "BRW-03": "skip", "BRW-04": "skip"})
    ctx = _ctx(policy, tmp_path)
    assert counterproof.not_applicable(by_name["BRW-01"], ctx, before) == "skipped in the run before: p BRW-01"
    assert counterproof.not_applicable(by_name["NET-02"], ctx, before) is None
    ctx["opts"]["allow_url"] = None
    assert "--allow-url" in counterproof.not_applicable(by_name["BRW-03"], ctx, _rep({}))


def test_readable_by_others_follows_every_directory():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as top:  # pytest's tmp_path lies under a 0700 directory
        _readable_checks(pathlib.Path(top))


def _readable_checks(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    f = d / "f"
    f.write_text("x")
    os.chmod(str(tmp_path), 0o755)
    os.chmod(str(f), 0o644)
    os.chmod(str(d), 0o755)
    assert loosen.readable_by_others(str(f)) and loosen.readable_by_others(str(d))
    os.chmod(str(d), 0o750)
    assert not loosen.readable_by_others(str(f)) and not loosen.readable_by_others(str(d))
    os.chmod(str(d), 0o711)
    assert loosen.readable_by_others(str(f)) and not loosen.readable_by_others(str(d))
    os.chmod(str(f), 0o600)
    assert not loosen.readable_by_others(str(f))
    assert not loosen.readable_by_others(str(tmp_path / "missing"))


def _rep(verdicts):
    return {"cases": [{"id": c.id, "verdict": verdicts.get(c.id, "pass"), "probe": "p %s" % c.id,
                       "control": "c %s" % c.id} for c in catalog.CASES]}


@pytest.mark.parametrize("verdicts,expected", [
    ({"ID-03": "fail", "ID-04": "fail"}, "proven"),
    ({"ID-03": "fail"}, "not proven"),
    ({}, "not proven"),
    ({"ID-03": "fail", "ID-04": "fail", "ID-07": "fail"}, "not proven"),
    ({"ID-03": "fail", "ID-04": "fail", "FS-01": "error"}, "error"),
    ({"ID-03": "fail", "ID-04": "fail", "LIM-02": "skip"}, "proven"),
])
def test_a_loosening_is_proven_only_when_exactly_its_cases_fail(verdicts, expected):
    lo = next(lo for lo in counterproof.LOOSENINGS if lo.name == "ID-03/04")
    out = counterproof.outcome(lo, _rep(verdicts))
    assert out["verdict"] == expected
    # the loosening's cases, and what an errored case's control saw
    errored = set(k for k, v in verdicts.items() if v == "error")
    assert set(out["evidence"]) == {"ID-03", "ID-04"} | errored
    assert all(out["evidence"][k] == "p %s | control: c %s" % (k, k) for k in errored)


def _run(verdict):
    counts = {"pass": 1, "fail": int(verdict == "failed"), "error": int(verdict == "error"), "skip": 0}
    return {"verdict": verdict, "counts": counts, "header": {"guest": "g1"}, "cases": []}


@pytest.mark.parametrize("before,after,loosenings,expected", [
    ("passed", "passed", ["proven", "proven"], ("proven", 0)),
    ("passed", "passed", ["proven", "not proven"], ("not proven", counterproof.EXIT_NOT_PROVEN)),
    ("passed", "passed", ["proven", "error"], ("error", counterproof.EXIT_ERROR)),
    ("error", "passed", ["proven"], ("error", counterproof.EXIT_ERROR)),
    ("passed", "error", ["proven"], ("error", counterproof.EXIT_ERROR)),
    ("failed", "passed", ["proven"], ("failed", counterproof.EXIT_NOT_PROVEN)),
    ("passed", "failed", ["proven"], ("failed", counterproof.EXIT_NOT_PROVEN)),
])
def test_the_counter_proof_passes_only_when_the_runs_beside_it_pass(before, after, loosenings, expected):
    results = [{"name": "x%d" % i, "how": "h", "expected": ["FS-02"], "failed": ["FS-02"], "errors": [],
                "verdict": v, "evidence": {"FS-02": "read: ok"}} for i, v in enumerate(loosenings)]
    rep = counterproof.summary(_run(before), _run(after), results, [])
    assert (rep["verdict"], rep["exit"]) == expected
    md = counterproof.to_markdown(rep)
    assert md.count("| x") == len(loosenings)


def test_the_snapshot_keys_are_what_chv_browser_returns():
    """BRW-04's allow-list against chv-browser's source: the keys of the
    dict _describe returns and those op_open adds."""
    import ast

    from testpaths import SRC

    with open(os.path.join(SRC, "chv_guest", "browser", "server.py")) as fh:
        tree = ast.parse(fh.read())
    funcs = dict((f.name, f) for f in ast.walk(tree) if isinstance(f, ast.AsyncFunctionDef))
    keys = set()
    for node in ast.walk(funcs["_describe"]):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            keys |= set(k.value for k in node.value.keys)
    for node in ast.walk(funcs["op_open"]):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            keys.add(node.targets[0].slice.value)
    assert keys == factsmod.SNAPSHOT_KEYS


def test_the_probe_reports_errno_names_not_exit_codes(tmp_path):
    assert audit_probe._try(lambda: open(str(tmp_path / "missing"))) == "ENOENT"
    assert audit_probe._try(lambda: None) == "ok"
    (tmp_path / "f").write_text("x")
    assert audit_probe._try(lambda: audit_probe._write(audit_probe.APPEND + str(tmp_path / "f"))) == "ok"
    assert (tmp_path / "f").read_text() == "x"


def test_connect_tells_a_drop_from_a_refusal_and_an_answer():
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def serve():
        conn, dummy = srv.accept()
        conn.sendall(b"hello\n")
        conn.close()
    t = threading.Thread(target=serve)
    t.start()
    assert audit_probe.connect("127.0.0.1", port) == "connected: hello"
    t.join()
    srv.close()
    assert audit_probe.connect("127.0.0.1", port) == "ECONNREFUSED"


# ------------------------------------------------------------- the command line

def test_audit_list_prints_the_catalog_for_anyone(capsys):
    from chv_guest.cell import cli

    assert cli.main(["audit", "--list"], euid=1000) == 0
    assert capsys.readouterr().out == counterproof.catalog_markdown()


@pytest.mark.parametrize("argv,needle", [
    (["audit"], "runs as root only"),
])
def test_audit_is_roots_only(capsys, argv, needle):
    from chv_guest.cell import cli

    assert cli.main(argv, euid=1000) == exits.EXIT_CONFIG
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--allow-url", "ftp://10.0.0.1/"], "--allow-url must be an http:// or https:// URL, got 'ftp://10.0.0.1/'"),
    (["--allow", "example.org"], "example.org"),
    (["--label", "novalue"], "--label 'novalue' is not KEY=VALUE"),
    (["--runs", "0"], "--runs must be at least 1, got 0"),
])
def test_bad_audit_arguments_are_named_and_nothing_runs(capsys, tmp_path, raw_policy, extra, needle):
    from chv_guest.cell import cli

    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw_policy))
    assert cli.main(["--policy", str(path), "audit"] + extra, euid=0) == exits.EXIT_CONFIG
    assert needle in capsys.readouterr().err


def test_the_counter_proof_runs_before_each_loosening_and_after(monkeypatch, raw_policy, tmp_path):
    """The flow, with the cell runs and nft replaced: the whole catalog
    once (as asked, --strict-skips included), one cells-only run per
    loosening that applies (never strict: the lifecycle cases are not run
    there), the cells again; a rule nft refuses is an error, not a crash."""
    raw_policy["state_dir"] = str(tmp_path)
    raw_policy["drop_capabilities"] = sorted(policymod.REQUIRED_DROPPED_CAPS | {policymod.USERNS_GUARD_CAP,
                                                                                "CAP_SYS_NICE"})
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw_policy))
    runs = []

    def fake_run(policy_path, opts):
        runs.append(opts)
        if opts.get("broker_socket"):
            with open(opts["cell_policy"]) as fh:
                binds = json.load(fh)["writable_binds"]
            assert {"source": str(tmp_path / "build" / "run"), "target": "/run/chv", "optional": False} in binds
        return dict(_rep({}), verdict="passed", exit=0, header={"guest": "g1"},
                    counts={"pass": len(catalog.CASES), "fail": 0, "error": 0, "skip": 0})

    def refuse(pol, rules):
        raise RuntimeError("nft insert rule %s: Error: No such file or directory" % rules[0][0])

    class Doors(object):
        """The doors' test builds: recorded, their directories real (the copy's bind must name one)."""
        started, stopped = [], []

        def __init__(self, systemd_run, cell_gid):
            self.broker_socket = str(tmp_path / "build" / "run" / "broker.sock")
            self.browser_socket = None

        def start(self, doors):
            Doors.started.append(tuple(doors))
            if ("browser", "raw-html") in doors:
                self.browser_socket = str(tmp_path / "build-b" / "browser.sock")

        def paths(self):
            return {"broker_socket": self.broker_socket, "browser_socket": self.browser_socket,
                    "cell_run_dir": os.path.dirname(self.broker_socket)}

        def stop(self):
            Doors.stopped.append(self.broker_socket)
    monkeypatch.setattr(counterproof.doorbuild, "DoorBuilds", Doors)
    monkeypatch.setattr(counterproof.doorbuild, "remove_stale", lambda systemctl: 0)
    monkeypatch.setattr(audit, "run", fake_run)
    monkeypatch.setattr(counterproof, "insert_rules", refuse)
    monkeypatch.setattr(counterproof, "remove_rules", lambda pol: 0)
    monkeypatch.setattr(counterproof, "remove_elements", lambda pol: 0)
    monkeypatch.setattr(counterproof, "insert_elements", lambda pol, elements: refuse(pol, elements))
    opts = {"slot": None, "metadata_stand_in": True, "deny": [], "allow_url": "http://10.0.0.1:1/",
            "strict_skips": True, "special": "198.18.254.254:18772"}
    rep = counterproof.run(str(path), opts)
    applicable = [lo for lo in counterproof.LOOSENINGS if lo.name not in [r["name"] for r in rep["not_applicable"]]]
    # every loosening by ruleset was refused by the fake nft before its run
    assert len(runs) == 1 + len([lo for lo in applicable if not lo.rules and not lo.elements]) + 1
    assert set(r["name"] for r in rep["loosenings"]) == set(lo.name for lo in applicable)
    assert runs[0]["strict_skips"] is True and runs[0].get("lifecycle", True) is True
    assert all(r["lifecycle"] is False and r["strict_skips"] is False for r in runs[1:])
    by_name = dict((r["name"], r) for r in rep["loosenings"])
    assert by_name["NET-03"]["verdict"] == "error" and "nft insert rule input" in by_name["NET-03"]["evidence"][
        "loosening"]
    assert by_name["ID-07"]["verdict"] == "not proven"  # the fake cells failed nothing
    assert by_name["TEN-06"]["verdict"] == "error" and "carve_nets" in by_name["TEN-06"]["evidence"]["loosening"]
    assert (rep["verdict"], rep["exit"]) == ("error", counterproof.EXIT_ERROR)
    assert not [n for n in os.listdir(str(tmp_path)) if n.startswith("audit-policy-")]  # the copies are gone
    # the doors' loosenings: their builds started for their run only and stopped after it; the run's
    # cells started with a copy that binds the build's directory, the guest's pings sent to its socket
    assert Doors.started == [(("broker", "any-peer"),), (("broker", "any-op"),), (("browser", "raw-html"),)]
    assert len(Doors.stopped) == 3
    door_runs = [r for r in runs if r.get("broker_socket")]
    assert len(door_runs) == 3 and all(r["broker_socket"] == str(tmp_path / "build" / "run" / "broker.sock")
                                       for r in door_runs)
    assert [r for r in runs if r not in door_runs and r.get("broker_socket")] == []


def test_a_fixture_file_never_follows_a_link_planted_at_its_name(tmp_path):
    """The audit writes its fixtures as root into directories cells write: a link an earlier
    task left at the name (here towards a file outside, as towards /etc/nologin) is refused and
    its target untouched; the cleanup removes only what the audit made. Control: a free name
    gets the file with its mode and owner."""
    target = tmp_path / "outside"
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / ".git-credentials").symlink_to(target)
    fix = audit.Fixtures()
    with pytest.raises(OSError):
        fix.file(str(slot / ".git-credentials"), "https://audit:audit@example.invalid\n", 0o644)
    assert not target.exists()
    fix.file(str(slot / "mark"), "own\n", 0o640, os.getuid(), os.getgid())
    st = os.stat(slot / "mark")
    assert (slot / "mark").read_text() == "own\n" and stat.S_IMODE(st.st_mode) == 0o640
    fix.cleanup()
    assert not (slot / "mark").exists() and (slot / ".git-credentials").is_symlink() and not target.exists()


def test_ten_05_looks_at_the_image_a_loop_device_reads_and_nothing_else(tmp_path):
    """TEN-05's guest side: / of this machine is no loop device (None: nothing to weigh), and a
    file's allocation is what the guest's disk gives it (0 for no image)."""
    assert audit.loop_backing_file(os.stat("/").st_dev) is None
    img = tmp_path / "slot.img"
    img.write_bytes(b"x" * 65536)
    assert audit._allocated(str(img)) >= 65536  # pylint: disable=protected-access
    assert audit._allocated(None) == 0  # pylint: disable=protected-access


@pytest.mark.parametrize("runs,verdict,earlier", [
    ([{"ID-03": "fail", "ID-04": "fail"}], "proven", 0),
    ([{"ID-03": "fail", "ID-04": "fail", "TEN-03": "error"}, {"ID-03": "fail", "ID-04": "fail"}], "proven", 1),
    ([{"TEN-03": "error"}, {"FS-01": "error"}], "error", 1),
    ([{"ID-03": "fail"}], "not proven", 0),  # a result, not run again
])
def test_a_loosened_run_whose_control_failed_is_run_once_more_and_the_first_errors_kept(runs, verdict, earlier):
    lo = next(lo for lo in counterproof.LOOSENINGS if lo.name == "ID-03/04")
    seen = []

    def run_cells():
        seen.append(1)
        return _rep(runs[len(seen) - 1])
    out = counterproof.attempt(lo, run_cells)
    assert out["verdict"] == verdict and len(seen) == len(runs)
    assert len(out.get("earlier_errors", [])) == earlier
    if earlier:
        first = out["earlier_errors"][0]
        assert first["errors"] == sorted(k for k, v in runs[0].items() if v == "error")
        assert "control: c" in "".join(first["evidence"].values())
        assert "run again after a control failed" in counterproof.to_markdown(
            {"verdict": verdict, "header": {}, "before": {"verdict": "passed", "counts": _counts0()},
             "after": {"verdict": "passed", "counts": _counts0()}, "loosenings": [out], "not_applicable": []})


def _counts0():
    return {"pass": 0, "fail": 0, "error": 0, "skip": 0}


# ------------------------------------------------------------- --case and --keep

@pytest.mark.parametrize("extra,needle", [
    (["--case", "NOPE-99"], "--case NOPE-99: no such case (chv-cell audit --list)"),
    (["--case", "FS-06", "--counter-proof"], "--counter-proof --case FS-06: not counter-provable here"),
    (["--case", "EGR-02"], "--case EGR-02: not judged on this guest, whose egress mode is cidr"),
])
def test_bad_case_arguments_are_named_and_nothing_runs(capsys, tmp_path, raw_policy, extra, needle):
    from chv_guest.cell import cli

    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw_policy))
    assert cli.main(["--policy", str(path), "audit"] + extra, euid=0) == exits.EXIT_CONFIG
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("cases, lifecycle_ran", [
    (["FS-01", "NET-01"], False),
    (["FS-01", "LIFE-02"], True),
    ([], True),
])
def test_case_reports_the_named_cases_only_and_runs_the_lifecycle_only_for_one_of_its_own(
        monkeypatch, tmp_path, raw_policy, facts, cases, lifecycle_ran):
    """--case: the cells' probes run once (the sections the named cases
    read), the lifecycle only when a lifecycle case is named; the report
    holds exactly the named cases."""
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw_policy))
    calls = []

    def probes(pol, policy_path, slot_a, slot_b, opts, fix, got):
        calls.append("probes")
        assert opts["probes"] == (sorted(set(p for cid in cases for p in catalog.BY_ID[cid].probes)) if cases
                                  else None)
        got.update(dict((k, v) for k, v in facts.items() if k not in ("guest", "policy", "slot_a", "slot_b")))
        got["guest"].update(facts["guest"])

    monkeypatch.setattr(audit, "_cell_probes", probes)
    monkeypatch.setattr(audit, "_lifecycle", lambda *a: calls.append("lifecycle"))
    monkeypatch.setattr(audit, "_left_behind", lambda pol, slots: [])
    monkeypatch.setattr(audit, "header", lambda policy_path, labels: {"guest": "g1"})
    rep = audit.run(str(path), {"slot": None, "broker_client": "", "cases": cases, "keep": False})
    assert calls == ["probes"] + (["lifecycle"] if lifecycle_ran else [])
    ids = [c["id"] for c in rep["cases"]]
    assert ids == ([c for c in CIDR_CASES if c in cases] if cases else CIDR_CASES)
    assert sum(rep["counts"].values()) == len(ids)


# what every report of cell A has, whatever sections it ran
CELL_A_ALWAYS = ("uid", "pid", "uid_map", "CapEff", "CapBnd", "NoNewPrivs", "neigh_out", "resolv")


@pytest.mark.parametrize("cid", [c.id for c in catalog.CASES])
def test_each_case_is_judged_from_the_sections_of_cell_as_report_it_names(facts, proxy_facts, cid):
    """A --case run asks cell A for the sections its cases name (Case.probes)
    only: each case's verdict from those is the verdict from the whole report."""
    case = catalog.BY_ID[cid]
    facts = proxy_facts if case.mode == "proxy" else facts
    assert set(case.probes) <= set(audit_probe.SECTIONS)
    whole = case.verdict(copy.deepcopy(facts))
    facts["a"] = dict((k, v) for k, v in facts["a"].items() if k in CELL_A_ALWAYS + case.probes)
    assert case.verdict(facts) == whole


def test_a_case_run_asks_the_cell_for_its_sections_only():
    request = {"read": {}, "write": {}, "tcp": {}, "tcp6": {}, "families": {}, "browser": {}, "cookie": "u",
               "sync": {}, "quota": {}, "disk": "/workspace", "plant": {}, "broker_client": "c"}
    audit.compose(request, catalog.BY_ID["TEN-03"].probes)
    assert request["probes"] == ["browser", "cookie"]
    # the doors' and run 2's requests stay, the sync, quota, disk, plant and families ones go
    assert sorted(request) == ["broker_client", "browser", "cookie", "probes", "read", "tcp", "tcp6", "write"]
    assert set(audit.SECTION_KEYS) <= set(audit_probe.SECTIONS)


def test_keep_leaves_the_fixture_files_and_still_undoes_the_rest(tmp_path):
    """--keep: the files and directories the audit put down stay (and are
    named); its processes end and its guest changes are undone all the same."""
    undone = []
    fix = audit.Fixtures()
    fix.directory(str(tmp_path / "d"), 0o700)
    fix.file(str(tmp_path / "d" / "f"), "x", 0o600)
    fix.undo.append(lambda: undone.append(1))
    kept = fix.cleanup(keep_files=True)
    assert sorted(kept) == sorted([str(tmp_path / "d" / "f"), str(tmp_path / "d")])
    assert (tmp_path / "d" / "f").exists() and undone == [1]
    fix2 = audit.Fixtures()
    fix2.directory(str(tmp_path / "e"), 0o700)
    fix2.file(str(tmp_path / "e" / "f"), "x", 0o600)
    assert fix2.cleanup() == [] and not (tmp_path / "e").exists()
