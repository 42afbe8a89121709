"""Egress by name (issue 33), the cell's side: in proxy mode (policy
egress_proxy) a cell gets the proxy variables pointing at its own gateway
and no resolver; the policy checks the key; chv-cell egress-log counts the
proxy's audit log per slot and verdict."""

import io
import json

import pytest

from chv_guest.cell import argv as argvmod
from chv_guest.cell import cli
from chv_guest.cell import egresslog
from chv_guest.cell import policy as policymod
from cellrt import BASE_POLICY

NONE = frozenset()
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


def env_of(policy, slot=1):
    argv = argvmod.build_argv(policy, policy["slots"][slot], ["true"],
                              argvmod.HostFacts(scope="standalone", existing=NONE, shared_network=False))
    out = {}
    for arg in argv[:argv.index("--")]:
        if arg.startswith("--setenv="):
            key, _sep, value = arg[len("--setenv="):].partition("=")
            out[key] = value
    return out


def merged(**kw):
    raw = dict(BASE_POLICY, **kw)
    assert policymod.validate(raw) == []
    return policymod.merged(raw)


def test_proxy_mode_points_every_proxy_variable_at_the_slots_own_gateway():
    policy = merged(egress_proxy={"port": 3128}, setenv={"HTTPS_PROXY": "http://evil:1", "FOO": "bar"})
    env = env_of(policy, slot=1)
    gateway = policy["slots"][1]["gateway"]
    for name in PROXY_VARS:
        assert env[name] == "http://%s:3128" % gateway, name      # the policy's setenv cannot change it
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    assert env["FOO"] == "bar"


def test_the_doors_get_the_cells_own_proxy_url_through_its_record():
    """argv.proxy_url is the cell's HTTPS_PROXY and its record's egress_proxy (Runner.write_record),
    in the form chv-broker reads back (wire.protocol.PROXY_URL_RE) and chv-browser takes (policy.check_proxy)."""
    from chv_guest.wire import protocol
    from chv_guest.browser import policy as browser_policy

    policy = merged(egress_proxy={"port": 3128})
    for index, slot in enumerate(policy["slots"]):
        url = argvmod.proxy_url(policy, slot)
        assert url == env_of(policy, slot=index)["HTTPS_PROXY"]
        assert protocol.PROXY_URL_RE.fullmatch(url) and browser_policy.check_proxy(url) == url
    assert argvmod.proxy_url(merged(), policy["slots"][0]) is None          # control: cidr mode, none


def test_cidr_mode_sets_no_proxy_variable():
    """Control: without egress_proxy (the default) a cell gets none of them."""
    env = env_of(merged())
    assert not [name for name in env if name.lower().endswith("_proxy")]


@pytest.mark.parametrize("value", [{"port": 0}, {"port": "3128"}, {"port": True}, {"port": 3128, "host": "x"},
                                   [3128], "proxy"])
def test_a_bad_egress_proxy_is_refused_naming_the_role_variables(value):
    errors = policymod.validate(dict(BASE_POLICY, egress_proxy=value))
    assert [e for e in errors if e.startswith("egress_proxy: %r must be null or" % (value,))
            and "chv_cell_egress_mode" in e], errors


def test_macos_has_no_proxy_mode():
    raw = dict(BASE_POLICY, egress_proxy={"port": 3128}, platform="darwin")
    assert "egress_proxy: the proxy mode is not implemented on macOS (role variable chv_cell_egress_mode)" \
        in policymod.validate(raw)


# ---------------------------------------------------------------- the log

ALLOWED = ("ts=1764761234.567 slot=slot0 src=10.200.0.2 method=CONNECT host=allowed.test port=443 "
           "dst=198.20.1.1 status=TCP_TUNNEL/200 bytes_out=80 bytes_in=512 ms=4")
DENIED = ("ts=1764761235.001 slot=slot0 src=10.200.0.2 method=CONNECT host=denied.test port=443 "
          "dst=- status=TCP_DENIED/403 bytes_out=120 bytes_in=3900 ms=0")
FAILED = ("ts=1764761236.001 slot=slot1 src=10.200.1.2 method=GET host=down.test port=80 "
          "dst=198.20.3.1 status=TCP_MISS/503 bytes_out=90 bytes_in=4000 ms=2")


def test_a_line_parses_with_its_verdict():
    rec = egresslog.parse_line(ALLOWED)
    assert rec["slot"] == "slot0" and rec["host"] == "allowed.test" and rec["port"] == "443"
    assert rec["dst"] == "198.20.1.1" and rec["bytes_in"] == 512 and rec["verdict"] == "allowed"
    assert egresslog.parse_line(DENIED)["verdict"] == "denied"
    assert egresslog.parse_line(FAILED)["verdict"] == "failed"
    assert egresslog.verdict("TCP_TUNNEL/503") == "failed" and egresslog.verdict("NONE_NONE/000") == "failed"
    assert egresslog.parse_line("1764761234.567 4 10.200.0.2 TCP_TUNNEL/200 512 CONNECT x:443 - HIER/1.2.3.4 -") \
        is None
    assert egresslog.parse_line(ALLOWED + " extra=1") is None


def test_counters_per_slot_and_verdict():
    table, other = egresslog.counters([ALLOWED, ALLOWED, DENIED, FAILED, "garbage", ""])
    assert other == 1
    assert table == {("slot0", "allowed"): {"attempts": 2, "bytes_out": 160, "bytes_in": 1024},
                     ("slot0", "denied"): {"attempts": 1, "bytes_out": 120, "bytes_in": 3900},
                     ("slot1", "failed"): {"attempts": 1, "bytes_out": 90, "bytes_in": 4000}}


def test_chv_cell_egress_log_prints_the_counters(tmp_path, capsys, monkeypatch):
    log = tmp_path / "access.log"
    log.write_text("\n".join([ALLOWED, DENIED, FAILED]) + "\n")
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    assert cli.main(["egress-log", "--log", str(log), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["counters"]
    assert [(r["slot"], r["verdict"], r["attempts"]) for r in rows] == [
        ("slot0", "allowed", 1), ("slot0", "denied", 1), ("slot1", "failed", 1)]
    assert cli.main(["egress-log", "--log", str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["slot0", "allowed", "1", "80", "512"]
    assert cli.main(["egress-log", "--log", str(tmp_path / "missing.log")]) == 78
    assert "cannot read" in capsys.readouterr().err


def test_report_counts_lines_of_another_format():
    text, other = egresslog.report(io.StringIO(ALLOWED + "\nnot ours\n"), as_json=False)
    assert other == 1 and "(1 line(s) of another format skipped)" in text
