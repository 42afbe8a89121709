"""What chv-broker and chv-browser accept, defined once for both services.

Both services import it from chv_guest.wire (as they do wire.py), so the
operations, the browser actions, the URL rule and the audit line below
exist in one place.

Each service carries out a name through a method ``op_<name>`` (chv-broker:
``Broker.op_ping``, ``Broker.op_sync``, ...; chv-browser:
``Engine.op_open``, ...), looked up once at start by ``handlers``; a name
not in these tables is refused.
"""
from __future__ import annotations

import json
import re
from typing import IO, Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, TypedDict
from urllib.parse import urlsplit

from .. import journal

# an action's table: action -> the string fields it requires
Actions = Dict[str, Tuple[str, ...]]


class OpSpec(TypedDict):
    actions: Optional[Actions]
    switch: Optional[str]


# chv-browser actions -> the string fields each one requires (besides "slot",
# which chv-broker fills in with the slot its peer check matched).
BROWSER_ACTIONS: Actions = {"open": ("url",), "snapshot": (), "screenshot": ("name",), "close": ()}

# sync actions -> required fields ("repo" is optional, default ".").
SYNC_ACTIONS: Actions = {"status": (), "pull": (), "push": ()}

# chv-broker operations: "actions" is the op's table of actions (None: the op
# takes none); "switch" the config section whose "enabled" turns the op on
# (None: always on).
OPS: dict[str, OpSpec] = {
    "ping": {"actions": None, "switch": None},
    "sync": {"actions": SYNC_ACTIONS, "switch": "sync"},
    "browser": {"actions": BROWSER_ACTIONS, "switch": "browser"},
}

# The only URL schemes a cell may have the browser open.
URL_SCHEMES = ("http", "https")

# Proxy mode (docs/network.md "Egress by name"): a cell's egress proxy as the
# launcher writes it into the cell's record (chv_guest.cell.argv.proxy_url),
# chv-broker reads it (peer.load_cells) and chv-browser takes it (check_proxy).
PROXY_URL_RE = re.compile(r"http://[0-9]{1,3}(\.[0-9]{1,3}){3}:[0-9]{1,5}")


def known(table: Mapping[str, object], name: object) -> bool:
    """Whether ``name`` (anything a client sent) is a key of ``table``."""
    return isinstance(name, str) and name in table


def handlers(obj: object, table: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """{name: obj.op_<name>} for every name in ``table``; raises TypeError when one has no handler."""
    missing = [name for name in table if not callable(getattr(obj, "op_" + name, None))]
    if missing:
        raise TypeError("%s has no op_ method for %s" % (type(obj).__name__, ", ".join(missing)))
    return {name: getattr(obj, "op_" + name) for name in table}


def url_scheme_allowed(url: str) -> bool:
    """Whether ``url`` starts with one of URL_SCHEMES and a colon (case-insensitive).

    urlsplit skips leading spaces and C0 controls before the scheme; a URL
    whose scheme shows only after that is refused, so that every reader of
    it agrees on the scheme. Raises ValueError when urlsplit does (e.g. an
    unclosed IPv6 bracket).
    """
    scheme = urlsplit(url).scheme.lower()
    return scheme in URL_SCHEMES and url[:len(scheme) + 1].lower() == scheme + ":"


def audit(stream: IO[str], event: str, **fields: object) -> None:
    """One JSON audit line {"event": event, **fields}: to the journal with
    its fields as CHV_* fields when ``stream`` is the service's journal
    stream (chv_guest/journal.py), else written to ``stream``; a closed
    stream is no error."""
    line = json.dumps({"event": event, **fields}, sort_keys=True)
    if journal.is_journal_stream(stream) and journal.send(journal.entry(line, event.split(".")[0], event, fields)):
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
