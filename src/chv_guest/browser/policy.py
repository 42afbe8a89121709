"""Pure request checks, output shaping and the screenshot quota of chv-browser (no Playwright needed)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from ..wire.protocol import PROXY_URL_RE, URL_SCHEMES

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10: only in annotations, which are never evaluated

    from ..wire.protocol import Actions

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLOT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Refused(Exception):
    """A request chv-browser will not carry out; the message goes back to the cell."""


def check_url(url: object) -> str:
    if not isinstance(url, str) or not url or len(url) > 8192:
        raise Refused("url must be a non-empty string of at most 8192 characters")
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        raise Refused("url does not parse") from None
    if parts.scheme.lower() not in URL_SCHEMES or not parts.hostname:
        raise Refused("only %s URLs with a host may be opened" % " and ".join(URL_SCHEMES))
    return url.strip()


def url_allowed(url: object) -> bool:
    try:
        check_url(url)
        return True
    except Refused:
        return False


def check_slot(slot: object) -> str:
    if not isinstance(slot, str) or not _SLOT.fullmatch(slot) or ".." in slot:
        raise Refused("invalid slot")
    return slot


def _name_ok(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and ".." not in name


def check_name(name: object) -> str:
    if not _name_ok(name):
        raise Refused("screenshot name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63} without '..'")
    return name


def is_shot_file(filename: object) -> bool:
    """Whether ``filename`` is one chv-browser may have written as a screenshot: ``<name>.png``
    with a name check_name accepts (its temporary files, ``.<name>.png.tmp``, are not)."""
    return isinstance(filename, str) and filename.endswith(".png") and _name_ok(filename[:-len(".png")])


def shots_to_prune(shots: Sequence[Tuple[str, int, float]], keep: int, max_bytes: int,
                   incoming: Optional[int] = None) -> List[str]:
    """Names of a slot's screenshots to remove for it to be within its quota, oldest first.

    ``shots`` is the slot's screenshots as (name, size, mtime); oldest means
    the smallest mtime (then name). The quota is at most ``keep`` screenshots
    and ``max_bytes`` bytes. ``incoming`` is the size of a screenshot about to
    be written (not in ``shots``): room is made for it, so that with it the
    slot is within the quota (at most keep - 1 others, and max_bytes -
    incoming bytes; every other one when it alone is over max_bytes).
    """
    max_count, budget = keep, max_bytes
    if incoming is not None:
        max_count, budget = keep - 1, max_bytes - incoming
    count = len(shots)
    total = sum(shot[1] for shot in shots)
    remove: List[str] = []
    for name, size, dummy_mtime in sorted(shots, key=lambda shot: (shot[2], shot[0])):
        if count <= max_count and total <= budget:
            break
        remove.append(name)
        count -= 1
        total -= size
    return remove


# The check of each request field named in protocol.BROWSER_ACTIONS: value -> checked value, or Refused.
FIELD_CHECKS: Dict[str, Callable[[object], str]] = {"url": check_url, "name": check_name}


def truncate(text: str, max_lines: int, max_bytes: int) -> Tuple[str, bool]:
    """Cut ``text`` to at most ``max_lines`` lines and ``max_bytes`` UTF-8 bytes.

    Returns (text, truncated).  Cuts never split a UTF-8 character.
    """
    truncated = False
    lines = text.split("\n")
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        truncated = True
    out = "\n".join(lines)
    raw = out.encode("utf-8")
    if len(raw) > max_bytes:
        out = raw[:max_bytes].decode("utf-8", "ignore")
        truncated = True
    return out, truncated


# ---------------------------------------------------------------- the end of a cell's run
# Operations only guest root outside every cell may ask for (chv-cell's launcher, after a
# cell ended and before its slot can be claimed again; chv_cell/doors.py). chv-broker never
# forwards them: it forwards only protocol.BROWSER_ACTIONS, and these are not among them.
ADMIN_ACTIONS: Actions = {"end": ()}

_CELL = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,127}")


def check_cell(cell: object) -> Optional[str]:
    """The identity of the cell incarnation a request is for (opaque to chv-browser, e.g. the
    cell leader's pid and pid namespace inode as chv-broker's peer check saw them), or None
    when the request names none."""
    if cell is None:
        return None
    if not isinstance(cell, str) or not _CELL.fullmatch(cell):
        raise Refused("cell must match [A-Za-z0-9][A-Za-z0-9:._-]{0,127}")
    return cell


def check_proxy(proxy: object) -> Optional[str]:
    """The egress proxy the slot's context must use (proxy mode: chv-broker passes the cell record's
    egress_proxy, ``http://<the slot's gateway>:<port>``), or None when the request names none."""
    if proxy is None:
        return None
    if not isinstance(proxy, str) or not PROXY_URL_RE.fullmatch(proxy):
        raise Refused("proxy must be http://<IPv4 address>:<port>")
    return proxy


def admin_peer_problem(uid: int, own_uid_map: str) -> Optional[str]:
    """Why a peer with SO_PEERCRED ``uid`` may not ask for an ADMIN_ACTIONS operation, or None.

    Only uid 0 of the guest's own user namespace may: the kernel reports a peer's uid as seen
    from chv-browser's user namespace, and a cell's processes (nspawn --private-users, the
    slot's uid range, never starting at 0) are never uid 0 there. ``own_uid_map`` is the text
    of chv-browser's /proc/self/uid_map: it must be the initial user namespace's identity map,
    else a uid 0 seen here could be anybody's.
    """
    if own_uid_map.split() != ["0", "0", "4294967295"]:
        return "chv-browser does not run in the initial user namespace (uid_map %r)" % own_uid_map.strip()
    if uid != 0:
        return "only root outside every cell may end a slot's browser state (peer uid %d)" % uid
    return None


def admit_page(open_pages: int, cap: int, request_running: bool) -> bool:
    """Whether a page a slot's context just opened (a popup, window.open, target=_blank) may stay
    open: only while one of the slot's requests runs and while the slot has fewer than ``cap``
    pages open (``open_pages``, its own page included, the new one not). A page opened by a page
    when no request of its slot runs is never needed (operations act on the slot's own page)."""
    return request_running and open_pages < cap
