"""`chv-cell health`: can this guest run an isolated cell right now?

site.yml runs it on every host of a batch before the next batch starts
(docs/operations.md, "The health gate"); ops and auditors can run it by hand.
The checks, each reported by name:

* ``unit <name>``: a unit the cells depend on (the broker socket, the browser
  service) is active, and its restart count did not move while the checks
  ran (no restart loop);
* ``cell runs``: a real cell starts through ``chv-cell run`` in a free slot
  and its probe reports back;
* ``broker ping``: from inside that cell, the broker answers a ping;
* ``egress <host:port>``: from inside the cell, an allowed destination
  accepts a TCP connection (through the NAT);
* ``refused <host:port>``: from inside the cell, a destination the policy
  denies gets no answer at all (the ruleset drops; a reset or an ICMP error
  would mean the packet got past it), and the ruleset's drop counters moved.
  The guest itself, at the cell's gateway on port 22, is always among them.

The defaults live here, derived from the policy, so that a call by hand
runs the gate's checks (site.yml passes only its destinations): the units
DEFAULT_UNITS, and chv-browser.service when the policy names chv-browser's
socket; the broker's client.py beside the launcher's package.

A busy guest is not an unhealthy one: the cell runs in a free slot (the
policy's ``health_slot`` when it reserves one); when every slot runs a
cell, the checks that need none still run and the verdict is "busy"
(exit EXIT_HEALTH_BUSY, ``"verdict": "busy"`` in --json), which the gate
reports per host and does not count as a failure.

The in-cell half of this file runs as a plain script inside the cell
(``python3 -I health.py in-cell ARGS``): standard library only, no imports
from the package."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, TypedDict

CONNECT_TIMEOUT = 3.0
TIMED_OUT = "TimeoutError"
GUEST_PROBE_PORT = 22
EXIT_UNHEALTHY = 1
EXIT_HEALTH_BUSY = 75  # exits.EXIT_BUSY (this file's in-cell half imports nothing of the package)
DEFAULT_UNITS = ("chv-cell-nat.service", "chv-broker.socket")
BROWSER_UNIT = "chv-browser.service"
BUSY = "busy, not unhealthy"


class Check(TypedDict):
    """One check of the verdict, as the health gate reports it."""
    check: str
    ok: bool
    detail: str


def default_gateway(route_text: str) -> Optional[str]:
    """The IPv4 default gateway in /proc/net/route text, or None."""
    for line in route_text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == "00000000" and fields[2] != "00000000":
            raw = int(fields[2], 16)
            return socket.inet_ntoa(raw.to_bytes(4, "little"))
    return None


def parse_target(text: str) -> Tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError names the text."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("%r is not host:port" % text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("%r: write an IPv6 address as [address]:port" % text)
    return host, int(port)


def connect(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str:
    """"connected" or the error text."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "connected"
    except OSError as exc:
        return "%s: %s" % (type(exc).__name__, exc)


def in_cell(request: Mapping[str, Any], route_path: str = "/proc/net/route") -> Dict[str, Any]:
    """Inside the cell: the probe. ``request``: {"broker_client": path or
    null, "allow": [host:port], "deny": [host:port]}. Returns the report."""
    with open(route_path) as fh:
        gateway = default_gateway(fh.read())
    report: Dict[str, Any] = {"gateway": gateway, "allow": {}, "deny": {}}
    if request.get("broker_client"):
        proc = subprocess.run([sys.executable, "-I", request["broker_client"], json.dumps({"op": "ping"})],
                              capture_output=True, text=True, timeout=30, check=False)
        report["broker"] = {"rc": proc.returncode, "out": proc.stdout.strip()[-500:], "err": proc.stderr.strip()[-500:]}
    for key in ("allow", "deny"):
        for target in request.get(key, []):
            report[key][target] = connect(*parse_target(target))
    if gateway:
        report["deny"]["gateway:%d" % GUEST_PROBE_PORT] = connect(gateway, GUEST_PROBE_PORT)
    return report


# ------------------------------------------------------------- the verdict

def _check(name: str, ok: object, detail: str) -> Check:
    return {"check": name, "ok": bool(ok), "detail": detail}


def unit_check(name: str, before: Mapping[str, str], after: Mapping[str, str]) -> Check:
    """``before``/``after``: the unit's ActiveState, SubState and NRestarts
    (systemctl show) read before and after the cell's probe."""
    state = "%s/%s" % (after.get("ActiveState", "?"), after.get("SubState", "?"))
    if after.get("LoadState") not in (None, "loaded"):
        return _check("unit " + name, False, "not loaded (%s)" % after.get("LoadState"))
    if after.get("ActiveState") != "active":
        return _check("unit " + name, False, "%s, not active" % state)
    if before.get("NRestarts") != after.get("NRestarts"):
        return _check("unit " + name, False, "%s, restarted while checked (NRestarts %s -> %s): a restart loop"
                      % (state, before.get("NRestarts"), after.get("NRestarts")))
    restarts = "" if after.get("NRestarts") is None else ", NRestarts %s" % after["NRestarts"]
    return _check("unit " + name, True, state + restarts)


def drops(counters: Mapping[str, int]) -> int:
    """The sum of the ruleset's drop_* counters (packets)."""
    return sum(v for k, v in counters.items() if k.startswith("drop_"))


def verdict(request: Mapping[str, Any], units: Mapping[str, Tuple[Mapping[str, str], Mapping[str, str]]],
            cell: Mapping[str, Any], counters_before: Optional[Mapping[str, int]],
            counters_after: Optional[Mapping[str, int]]) -> List[Check]:
    """The checks, in order. ``units``: name -> (before, after) properties;
    ``cell``: {"rc", "out", "err"} of the cell run; counters: name -> packets
    (None when the table could not be read)."""
    checks = [unit_check(name, before, after) for name, (before, after) in sorted(units.items())]
    try:
        report = json.loads(cell["out"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = None
    if cell["rc"] != 0 or report is None:
        checks.append(_check("cell runs", False, "chv-cell run exited %s: %s" % (cell["rc"], cell["err"].strip()[-600:])))
        return checks
    checks.append(_check("cell runs", True, "gateway %s" % report.get("gateway")))
    if request.get("broker_client"):
        b = report.get("broker", {})
        try:
            ok = b.get("rc") == 0 and json.loads(b.get("out") or "null").get("ok") is True
        except (ValueError, AttributeError):
            ok = False
        checks.append(_check("broker ping", ok, b.get("out") or b.get("err") or "no reply"))
    for target, result in sorted(report["allow"].items()):
        checks.append(_check("egress " + target, result == "connected", result))
    # The ruleset drops (never rejects): a refused probe times out. A reset or
    # an ICMP error means the packet reached something beyond the ruleset.
    refused = {t: r for t, r in report["deny"].items() if r.startswith(TIMED_OUT)}
    for target, result in sorted(report["deny"].items()):
        checks.append(_check("refused " + target, target in refused,
                             "dropped (no answer: %s)" % result if target in refused else
                             "connected" if result == "connected" else "reached: %s" % result))
    if counters_before is None or counters_after is None:
        checks.append(_check("refused by the ruleset", False, "table inet chv_cell could not be read"))
    elif refused:
        moved = drops(counters_after) - drops(counters_before)
        checks.append(_check("refused by the ruleset", moved >= len(refused),
                             "drop counters +%d for %d refused probe(s)" % (moved, len(refused))))
    return checks


def default_units(browser_socket: str) -> List[str]:
    """The units the checks need by default (pure): DEFAULT_UNITS, and
    chv-browser's when the policy names its socket (``browser_socket``)."""
    return list(DEFAULT_UNITS) + ([BROWSER_UNIT] if browser_socket else [])


def free_slots(names: Sequence[str], busy: Sequence[str], reserved: Optional[str] = None) -> List[str]:
    """The slots the health cell may take (pure), in the policy's order:
    the reserved one alone when there is one, else every slot not ``busy``."""
    if reserved:
        return [] if reserved in busy else [reserved]
    return [n for n in names if n not in busy]


def busy_check(busy: Sequence[str]) -> Check:
    """The ``cell runs`` check of a guest whose slots are all busy."""
    return _check("cell runs", False, "%s: every slot the check may use runs a cell (%s)" % (BUSY, ", ".join(busy)))


def outcome(checks: Sequence[Check]) -> str:
    """healthy, busy (only the cell could not run: every slot busy) or unhealthy (pure)."""
    bad = [c for c in checks if not c["ok"]]
    if not bad:
        return "healthy"
    if all(c["check"] == "cell runs" and c["detail"].startswith(BUSY) for c in bad):
        return "busy"
    return "unhealthy"


def exit_code(checks: Sequence[Check]) -> int:
    """0 healthy, EXIT_HEALTH_BUSY busy, EXIT_UNHEALTHY unhealthy."""
    return {"healthy": 0, "busy": EXIT_HEALTH_BUSY}.get(outcome(checks), EXIT_UNHEALTHY)


def summary(host: Optional[str], checks: Sequence[Check]) -> str:
    """One line: healthy, busy, or each failed check with what it saw (``host:`` first when given)."""
    bad = [c for c in checks if not c["ok"]]
    prefix = "" if host is None else "%s: " % host
    verdict_ = outcome(checks)
    if verdict_ == "healthy":
        return "%shealthy (%d checks)" % (prefix, len(checks))
    if verdict_ == "busy":
        return "%s%s (%d other checks ok; the cell's checks wait for a free slot)" % (
            prefix, bad[0]["detail"], len(checks) - len(bad))
    return "%sUNHEALTHY: %s" % (prefix, "; ".join("%s: %s" % (c["check"], c["detail"]) for c in bad))


# ------------------------------------------------------------- the guest side

def _unit_props(name: str) -> Dict[str, str]:
    out = subprocess.run(["systemctl", "show", "-p", "LoadState,ActiveState,SubState,NRestarts", "--", name],
                         capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def read_counters() -> Optional[Dict[str, int]]:
    proc = subprocess.run(["nft", "-j", "list", "counters", "table", "inet", "chv_cell"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None
    items = json.loads(proc.stdout).get("nftables", [])
    return {i["counter"]["name"]: i["counter"]["packets"] for i in items if "counter" in i}


def _lib() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_broker_client() -> str:
    """chv-broker's client.py beside the launcher's package (where the roles install both)."""
    return os.path.join(_lib(), "chv_guest", "broker", "client.py")


def run(policy_path: str, units: Optional[Sequence[str]], request: Mapping[str, Any],
        claim_timeout: float = 30.0) -> List[Check]:
    """The checks on this guest: units before, a cell with the probe in a
    free slot (none when every slot is busy: the busy verdict), counters
    around it, units after.  ``units`` None: the policy's defaults
    (default_units); ``request["broker_client"]`` None: default_broker_client."""
    from . import policy as policymod  # noqa: PLC0415 (the in-cell half imports nothing of the package)
    from . import records  # noqa: PLC0415

    pol = policymod.load(policy_path)
    units = default_units(pol["browser_socket"]) if units is None else list(units)
    request = dict(request)
    if request.get("broker_client") is None:
        request["broker_client"] = default_broker_client()
    before = {u: _unit_props(u) for u in units}
    busy = [s["name"] for s in pol["slots"] if records.payload_running(pol, s)]
    reserved = pol.get("health_slot")
    free = free_slots([s["name"] for s in pol["slots"]], busy, reserved)
    if not free:
        time.sleep(0.5)  # a unit in a restart loop moves NRestarts within this window too
        after = {u: _unit_props(u) for u in units}
        return [unit_check(u, before[u], after[u]) for u in sorted(units)] + [busy_check(busy)]
    counters_before = read_counters()
    argv = ([sys.executable, "-I", os.path.join(_lib(), "chv-cell"), "--policy", policy_path, "run",
             "--ignore-cordon", "--timeout", str(claim_timeout)] + (["--slot", reserved] if reserved else [])
            + ["--", "python3", "-I", os.path.abspath(__file__), "in-cell", json.dumps(request)])
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=claim_timeout + 120)
    counters_after = read_counters()
    time.sleep(0.5)  # a unit in a restart loop moves NRestarts within this window too
    after = {u: _unit_props(u) for u in units}
    if proc.returncode == EXIT_HEALTH_BUSY:  # the free slots were taken meanwhile
        busy = [s["name"] for s in pol["slots"] if records.payload_running(pol, s)] or free
        return [unit_check(u, before[u], after[u]) for u in sorted(units)] + [busy_check(busy)]
    cell = {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr}
    return verdict(request, {u: (before[u], after[u]) for u in units}, cell, counters_before, counters_after)


if __name__ == "__main__" and sys.argv[1:2] == ["in-cell"]:
    print(json.dumps(in_cell(json.loads(sys.argv[2]))))
    sys.stdout.flush()
