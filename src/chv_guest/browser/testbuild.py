"""chv-browser's test build, for `chv-cell audit --counter-proof` only
(BRW-04; docs/isolation-cases.md "Counter-proofs").

The installed server (server.main) whose replies carry the page's HTML
beside its snapshot (RawHtmlEngine: exactly the one thing chv-browser
never returns), with a configuration whose socket and screenshots lie
inside the counter-proof's own directory. The guard (wire/testbuild.py)
refuses every start but the counter-proof's, as root; the build then
drops to chv-browser's user (whose sockets the ruleset's door_uids holds,
so its pages get the cells' egress policy as the installed one's do), and
stops when the counter-proof is gone. chv-browser's entry point and unit
never import this module.

    VENV/bin/python -I -c 'import sys; sys.path.insert(0, INSTALL_DIR); from chv_guest.browser.testbuild import main; sys.exit(main())' \\
        --run-dir /run/chv-audit-build.XXXX --variant raw-html --user chv-browser --config browser.json
"""
from __future__ import annotations

import os
import pwd
from typing import TYPE_CHECKING, Dict, List, Optional, Type

from ..wire import testbuild as guard
from .config import load_config
from .server import Engine, main as server_main

if TYPE_CHECKING:
    from playwright.async_api import Page


class RawHtmlEngine(Engine):
    """chv-browser whose open and snapshot replies carry the page's HTML
    (``html``) beside what the installed one returns."""

    async def _describe(self, page: Page) -> Dict[str, object]:
        out = await super()._describe(page)
        out["html"] = await page.content()
        return out


VARIANTS: Dict[str, Type[Engine]] = {"raw-html": RawHtmlEngine}


def drop_to(user: str) -> None:
    """Become ``user`` (its uid, gid and groups), as chv-browser.service's User= does."""
    pw = pwd.getpwnam(user)
    if pw.pw_uid == 0:
        raise SystemExit("chv-audit test build refused: %s is root; chv-browser never runs as root" % user)
    os.initgroups(user, pw.pw_gid)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def main(argv: Optional[List[str]] = None) -> int:
    ap = guard.parser("chv-browser test build", VARIANTS)
    ap.add_argument("--user", required=True)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    guard.enter(args.run_dir, [args.config, cfg["socket"], cfg["shots_dir"]])
    drop_to(args.user)  # the parent watch, a thread of this process, goes along
    return server_main(["--config", args.config], engine_class=VARIANTS[args.variant])
