"""The egress proxy's audit log (docs/network.md "The proxy's audit log"):
one line per connection attempt, written by squid in the role's logformat
``chv_egress`` (roles/cell_nat/templates/egress-proxy.conf.j2)::

    ts=1764761234.567 slot=slot0 src=10.200.0.2 method=CONNECT host=pypi.org port=443
    dst=151.101.0.223 status=TCP_TUNNEL/200 bytes_out=812 bytes_in=5120 ms=311

(one line). ``chv-cell egress-log`` reads it and prints the counters per
slot and verdict: ``allowed`` (the proxy let it through and the far end
answered), ``denied`` (refused by the proxy: a name no entry allows for the
slot, or an address it never connects to), ``failed`` (allowed by name, but
no answer: the kernel refused the address, the name did not resolve, the far
end was down).
"""

from __future__ import annotations

import json
from typing import Dict, Iterable, Optional, TextIO, Tuple

DEFAULT_LOG = "/var/log/chv-egress-proxy/access.log"
# the proxy's unit, configuration and squid's own log (roles/cell_nat/vars/main.yml), for the
# counter-proof of chv-cell audit, which widens the list for one run (counterproof.py)
PROXY_UNIT = "chv-egress-proxy.service"
PROXY_CONF = "/etc/chv-fleet/egress-proxy/squid.conf"
CACHE_LOG = "/var/log/chv-egress-proxy/cache.log"
FIELDS = ("ts", "slot", "src", "method", "host", "port", "dst", "status", "bytes_out", "bytes_in", "ms")
VERDICTS = ("allowed", "denied", "failed")
_INTS = ("bytes_out", "bytes_in", "ms")


def parse_line(line: str) -> Optional[Dict[str, object]]:
    """The fields of one log line, with its verdict; None for a line of another
    format. Values squid has none for are "-" (``slot=-``: a client that is no
    cell)."""
    fields: Dict[str, object] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if not sep or key not in FIELDS:
            return None
        fields[key] = value
    if set(fields) != set(FIELDS):
        return None
    for key in _INTS:
        raw = str(fields[key])
        fields[key] = int(raw) if raw.isdigit() else 0
    fields["verdict"] = verdict(str(fields["status"]))
    return fields


def verdict(status: str) -> str:
    """``allowed``, ``denied`` or ``failed`` from squid's ``%Ss/%>Hs``."""
    code, _sep, http = status.partition("/")
    if code == "TCP_DENIED" or http == "403":
        return "denied"
    if http[:1] in ("1", "2", "3"):
        return "allowed"
    return "failed"


def counters(lines: Iterable[str]) -> Tuple[Dict[Tuple[str, str], Dict[str, int]], int]:
    """Per (slot, verdict): attempts, bytes_out, bytes_in; and how many lines
    were not the proxy's format."""
    out: Dict[Tuple[str, str], Dict[str, int]] = {}
    other = 0
    for line in lines:
        if not line.strip():
            continue
        rec = parse_line(line)
        if rec is None:
            other += 1
            continue
        key = (str(rec["slot"]), str(rec["verdict"]))
        c = out.setdefault(key, {"attempts": 0, "bytes_out": 0, "bytes_in": 0})
        c["attempts"] += 1
        c["bytes_out"] += int(str(rec["bytes_out"]))
        c["bytes_in"] += int(str(rec["bytes_in"]))
    return out, other


def report(stream: TextIO, as_json: bool) -> Tuple[str, int]:
    """The counters of the log read from ``stream``: a table (or JSON) and the
    number of lines of another format."""
    table, other = counters(stream)
    if as_json:
        rows = [dict(slot=slot, verdict=v, **c) for (slot, v), c in sorted(table.items())]
        return json.dumps({"counters": rows, "other_lines": other}, indent=1) + "\n", other
    lines = ["%-12s %-8s %9s %12s %12s" % ("slot", "verdict", "attempts", "bytes_out", "bytes_in")]
    lines += ["%-12s %-8s %9d %12d %12d" % (slot, v, c["attempts"], c["bytes_out"], c["bytes_in"])
              for (slot, v), c in sorted(table.items())]
    if other:
        lines.append("(%d line(s) of another format skipped)" % other)
    return "\n".join(lines) + "\n", other
