"""chv-broker's test builds, for `chv-cell audit --counter-proof` only
(IPC-02, IPC-03, IPC-04 and, in front of chv-browser's, BRW-04;
docs/isolation-cases.md "Counter-proofs").

The installed server (server.main) with exactly one check replaced
(VARIANTS), listening with --listen on a socket inside the counter-proof's
own directory; the guard (wire/testbuild.py) refuses every start but the
counter-proof's, as root, and the build stops when the counter-proof is
gone. chv-broker's entry point and unit never import this module.

    python3 -I -c 'import sys; sys.path.insert(0, INSTALL_DIR); from chv_guest.broker.testbuild import main; sys.exit(main())' \\
        --run-dir /run/chv-audit-build.XXXX --variant any-peer --config broker.json --listen .../run/broker.sock
"""
from __future__ import annotations

import socket
import sys
from typing import IO, Dict, List, Optional, Type

from ..wire import testbuild as guard
from ..wire import wire
from .peer import Cell, PeerChecker, PeerRejected
from .server import Broker, main as server_main

# the slot a peer that is no live cell's is served as by the any-peer build
UNCHECKED_SLOT = "chv-audit-unchecked-peer"


class AnyPeer(PeerChecker):
    """The peer check of the any-peer build: a cell's process is its cell's, as
    in the installed one; any other peer, which that one refuses, is let in
    as a slot of its own (UNCHECKED_SLOT) instead."""

    def identify(self, conn: socket.socket) -> Cell:
        try:
            return super().identify(conn)
        except PeerRejected as exc:
            return {"slot": UNCHECKED_SLOT, "pid": exc.pid or 0, "uid_base": exc.uid or 0, "uid_size": 1}


class AnyPeerBroker(Broker):
    """chv-broker with AnyPeer as its peer check (IPC-02, IPC-03)."""

    def __init__(self, config: wire.JSONObject, log: IO[str] = sys.stderr) -> None:
        super().__init__(config, log)
        self.peers = AnyPeer(config["cells_dir"])


class AnyOpBroker(Broker):
    """chv-broker whose dispatch answers an operation it does not know
    instead of refusing it (IPC-04); every known one as installed."""

    def dispatch(self, cell: Cell, req: wire.JSONObject) -> object:
        op = req.get("op")
        if isinstance(op, str) and op not in self.ops:
            return {"accepted": op, "slot": cell["slot"]}
        return super().dispatch(cell, req)


# variant -> the Broker it runs ("as-installed": none replaced, in front of chv-browser's test build)
VARIANTS: Dict[str, Type[Broker]] = {"any-peer": AnyPeerBroker, "any-op": AnyOpBroker, "as-installed": Broker}


def main(argv: Optional[List[str]] = None) -> int:
    ap = guard.parser("chv-broker test build", VARIANTS)
    ap.add_argument("--listen", required=True)
    args = ap.parse_args(argv)
    guard.enter(args.run_dir, [args.listen])
    return server_main(["--config", args.config, "--listen", args.listen], broker_class=VARIANTS[args.variant])
