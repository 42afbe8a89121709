"""What the guest side of `chv-cell audit` and the cases' judges share: the
facts of one run (JSON objects: cell A's and B's reports, the guest's
observations, the options), the constants both sides name, and readers of
the replies the cells recorded."""

from __future__ import annotations

import json
from typing import Any, Dict

# One key per fact, read where each case is judged (docs/architecture.md).
Facts = Dict[str, Any]

DROPPED = ("TimeoutError", "ETIMEDOUT")  # a connect the ruleset drops gets no answer
METADATA = "169.254.169.254"
SHOTS_DIR = "/run/chv-shots"  # chv-browser's screenshots, a directory per slot (FS-04)
RAW_MARKER = "chv-audit-raw-html"
# what chv-browser's open returns to a cell (roles/browser: chv_browser/server.py, Engine.op_open and
# _describe; tests/unit/cell_runtime/test_audit.py compares the two), and nothing else
SNAPSHOT_KEYS = frozenset(["title", "url", "aria_snapshot", "truncated", "status"])
# TEN-03: the Listener's page that sets a cookie (its value from the query's v) and shows the Cookie
# header chromium sent
COOKIE_PATH = "/chv-audit-cookie"
COOKIE_NAME = "chv_audit"
QUOTA_EXTRA = 2  # TEN-02: connections past the quota that must be refused
DISK_FULL = ("ENOSPC", "EDQUOT")
NO_BROWSER = "--allow-url URL, a page cells may open through chv-browser (and chv-broker's client)"
NO_BROWSER_OP = "chv-browser (this guest's broker has no browser op)"


def marker(kind: str, nonce: str) -> str:
    """The text of a file of slot B (or /etc/shadow's stand-in words) that no reply may carry."""
    return "chv-audit-%s-%s" % (kind, nonce)


def cookie_sent(nonce: str) -> str:
    return "%s=%s-kept" % (COOKIE_NAME, nonce)


def denied(result: str) -> bool:
    return result not in ("ok",)


def dropped(result: str) -> bool:
    return result in DROPPED


def answer(reply: Facts) -> Any:
    """The broker's JSON reply of a client run, or None."""
    try:
        return json.loads(reply.get("out") or "null")
    except ValueError:
        return None


def reply_text(reply: Facts) -> str:
    return "%s %s" % (reply.get("out", ""), reply.get("err", ""))


def short(reply: Facts, n: int = 120) -> str:
    return (reply.get("out") or reply.get("err") or "no reply")[:n]


def result_of(reply: Facts) -> Dict[str, Any]:
    """The ``result`` object of a reply, or {}."""
    got = (answer(reply) or {}).get("result")
    return got if isinstance(got, dict) else {}


def snapshot_text(reply: Facts) -> str:
    """What an open's reply showed: the snapshot's text, or the reply itself."""
    return (str(result_of(reply).get("aria_snapshot", "")) or short(reply, 200))[:200]


def workspace_written(facts: Facts) -> bool:
    """Cell A's workspace write reached the guest (the control of FS-07 to FS-09 and TEN-09)."""
    return facts["a"]["write"].get("workspace") == "ok" and facts["guest"].get("workspace_write_seen") is True
