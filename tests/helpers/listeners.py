"""TCP listeners that say "hello": the far end of the cells' reachability
checks (tests/integration/cells and molecule/shared/tests)."""

import socket
import threading

from chv_guest.cell import audit

IP_FREEBIND = 15


def hello_listener(address, timeout=20, freebind=False):
    """Listen on (address, a free port), answer the first connection with
    b"hello" from a daemon thread; the caller closes the returned socket.
    freebind: bind before the address exists (a slot's gateway, before its
    cell's veth is up)."""
    srv = socket.socket()
    if freebind:
        srv.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
    srv.bind((address, 0))
    srv.listen(4)
    srv.settimeout(timeout)

    def serve():
        try:
            conn, dummy = srv.accept()
            conn.sendall(b"hello")
            conn.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return srv


# A listener that answers every connection until closed (a context manager):
# the launcher's own, which chv-cell audit runs on the guest.
HelloServer = audit.Listener
