"""Pure request checks, output shaping and the screenshot quota of chv-browser (no Playwright needed)."""
import re
from urllib.parse import urlsplit

from .protocol import URL_SCHEMES

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLOT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Refused(Exception):
    """A request chv-browser will not carry out; the message goes back to the cell."""


def check_url(url):
    if not isinstance(url, str) or not url or len(url) > 8192:
        raise Refused("url must be a non-empty string of at most 8192 characters")
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        raise Refused("url does not parse") from None
    if parts.scheme.lower() not in URL_SCHEMES or not parts.hostname:
        raise Refused("only %s URLs with a host may be opened" % " and ".join(URL_SCHEMES))
    return url.strip()


def url_allowed(url):
    try:
        check_url(url)
        return True
    except Refused:
        return False


def check_slot(slot):
    if not isinstance(slot, str) or not _SLOT.fullmatch(slot) or ".." in slot:
        raise Refused("invalid slot")
    return slot


def _name_ok(name):
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and ".." not in name


def check_name(name):
    if not _name_ok(name):
        raise Refused("screenshot name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63} without '..'")
    return name


def is_shot_file(filename):
    """Whether ``filename`` is one chv-browser may have written as a screenshot: ``<name>.png``
    with a name check_name accepts (its temporary files, ``.<name>.png.tmp``, are not)."""
    return isinstance(filename, str) and filename.endswith(".png") and _name_ok(filename[:-len(".png")])


def shots_to_prune(shots, keep, max_bytes, incoming=None):
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
    remove = []
    for name, size, dummy_mtime in sorted(shots, key=lambda shot: (shot[2], shot[0])):
        if count <= max_count and total <= budget:
            break
        remove.append(name)
        count -= 1
        total -= size
    return remove


# The check of each request field named in protocol.BROWSER_ACTIONS: value -> checked value, or Refused.
FIELD_CHECKS = {"url": check_url, "name": check_name}


def truncate(text, max_lines, max_bytes):
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
