"""Egress by name on real guests (issue 33, docs/network.md "The catalog in
proxy mode"): the names, ports, site.yml variables and audit command of
molecule/shared/tests/test_proxy_mode.py (the trixie scenario's guest, which
molecule/shared/tests/test_faults.py's last converges put in proxy mode), and
the checks of the audit's report. The names resolve only at the lab's
resolver stand-in (docs/lab.md; molecule/trixie/molecule.yml names them), to
the lab host's listeners on the guest's link (allowed, denied, the git
server) and to the guest's loopback (inside); nothing leaves the lab."""

import json
import secrets

from chv_guest.cell import audit

ALLOW_PORT, DENY_PORT, INSIDE_PORT = 18770, 18771, 18798
ALLOWED, DENIED, INSIDE = "allowed.chv-lab.test", "denied.chv-lab.test", "inside.chv-lab.test"
# the lab host's git server (tests/helpers/gitserver.py) of the sync door's test, by its name, and its
# account's password: this run's (test_faults.py's converge writes it to the guest, test_proxy_mode.py's
# server takes it; both import this module in the one pytest process)
GIT, GIT_PORT = "git.chv-lab.test", 18773
GIT_USER, GIT_PASSWORD = "executor", secrets.token_hex(12)
AUDIT = ("chv-cell audit --json --runs 3 --metadata-stand-in --allow-name %s:%d --deny-name %s:%d --inside-name %s "
         "--allow-url http://%s:%d/" % (ALLOWED, ALLOW_PORT, DENIED, DENY_PORT, INSIDE, ALLOWED, ALLOW_PORT))
EGR = ["EGR-0%d" % i for i in range(1, 7)]
# the cases of cidr mode that proxy mode has not (its kernel lets a cell reach the proxy only)
CIDR_ONLY = ("NET-01", "NET-05", "NET-07", "TEN-06")


def resolver_names(lab_host):
    """The stand-in's names (lab_resolver_names) for a lab host at ``lab_host``."""
    return {ALLOWED: lab_host, DENIED: lab_host, GIT: lab_host, INSIDE: "127.0.0.1"}


def site_vars():
    """site.yml's variables of proxy mode for these tests: the allowed name,
    the git server's and the inside name (a name that resolves to the
    guest's loopback, which the proxy must refuse all the same) on the list,
    the denied name not. The sync door over plain HTTP to the git server and
    to the denied name: both pass chv-broker's own host list, so that the
    proxy is what refuses the denied one; the git server's account in the
    guest's credential file (the role writes it)."""
    return {"chv_cell_egress_mode": "proxy",
            "cell_nat_egress_names": [{"name": ALLOWED, "port": ALLOW_PORT}, {"name": GIT, "port": GIT_PORT},
                                      {"name": INSIDE, "port": INSIDE_PORT}],
            "chv_broker_sync_protocols": ["http", "https"],
            "chv_broker_sync_hosts": ["%s:%d" % (GIT, GIT_PORT), "%s:%d" % (DENIED, DENY_PORT)],
            "chv_broker_sync_credentials": "http://%s:%s@%s:%d\n" % (GIT_USER, GIT_PASSWORD, GIT, GIT_PORT)}


def audit_guest(run, address, lab_host, extra=""):
    """The audit's JSON report of the guest at ``address`` (``run``: a
    callable that runs a command on it and returns a CompletedProcess-like
    result), run with the lab host's listeners up, and the peers that
    reached the denied name's listener."""
    with audit.Listener(lab_host, ALLOW_PORT), audit.Listener(lab_host, DENY_PORT) as deny:
        p = run(AUDIT + extra)
        seen = [s["peer"] for s in deny.seen]
    try:
        return json.loads(p.stdout), seen
    except ValueError:
        raise AssertionError("no report from %s: %s" % (address, p.stdout[-2000:] + p.stderr[-2000:]))


def check_report(rep, distro, address, seen):
    """A proxy-mode guest's audit: every case passes beside its control, the
    EGR ones among them (the allowed name tunnelled and logged; the denied
    name, the IP literal and the name of the guest's loopback refused and
    logged; DNS and a direct connection dropped); the browser door's
    refusals are the proxy's; the denied name's listener saw the guest's own
    control connection only (nothing of the cell's attempt reached it)."""
    cases = dict((c["id"], c) for c in rep["cases"])
    assert rep["header"]["egress_mode"] == "proxy" and distro in rep["header"]["os"].lower(), rep["header"]
    assert rep["verdict"] == "passed", [c for c in rep["cases"] if c["verdict"] not in ("pass", "skip")]
    assert sorted(c for c in cases if c.startswith("EGR")) == EGR
    assert not [c for c in cases if c in CIDR_ONLY]
    assert all(cases[c]["verdict"] == "pass" for c in EGR), cases
    assert "refused by the proxy" in cases["BRW-01"]["probe"], cases["BRW-01"]
    # skipped here: every slot at once (the audit runs without --exclusive) and the pids controller
    assert sorted(c for c in cases if cases[c]["verdict"] == "skip") == ["LIFE-03", "LIM-02"]
    assert seen == [address], seen
