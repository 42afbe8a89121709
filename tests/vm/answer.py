"""qemu's guestfwd command (conftest.GUESTFWD): libslirp starts it for each
connection a guest opens to a forwarded address, with that connection on
its standard input and output, and this answers it as chv-cell audit's own
listener answers (an HTTP/1.0 page: BRW-04's)."""

import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))
from chv_guest.cell.audit import Listener  # noqa: E402  # pylint: disable=wrong-import-position

Listener._answer(socket.socket(fileno=0))  # pylint: disable=protected-access
