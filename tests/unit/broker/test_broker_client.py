"""chv_guest/broker/client.py, the in-cell client: what it says about itself (no broker needed)."""
import os
import socket
import subprocess
import sys
import threading
import time


from testpaths import ROOT

CLIENT = os.path.join(ROOT, "src", "chv_guest", "broker", "client.py")


def test_client_usage_names_the_installed_file(tmp_path):
    """client.py is installed as a file, not as a command: its usage text and errors say so."""
    usage = subprocess.run([sys.executable, "-I", CLIENT], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 2 and usage.stdout == ""
    assert "python3 /usr/lib/chv-fleet/chv_guest/broker/client.py '{\"op\": \"ping\"}'" in usage.stderr
    assert "chv-broker-client" not in usage.stderr
    gone = subprocess.run([sys.executable, "-I", CLIENT, '{"op": "ping"}'], capture_output=True, text=True,
                          timeout=30, check=False, env={"CHV_BROKER_SOCKET": str(tmp_path / "absent.sock")})
    assert gone.returncode == 2 and gone.stderr.startswith("chv_guest/broker/client.py: ")
    with open(CLIENT) as fh:
        assert fh.readline().startswith("#!")  # the role installs a "#!" file executable (mode 0755)



def _client_module():
    sys.path.insert(0, os.path.dirname(CLIENT))
    try:
        import client  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    return client


def test_a_request_returns_once_the_broker_has_closed_the_connection(tmp_path):
    """request() reads the reply line, then waits for the broker's close (the broker gives the
    slot's connection back before it), so back-to-back requests are never refused for the one
    before. The server here closes 0.3 s after its reply."""
    client = _client_module()
    path = str(tmp_path / "door.sock")
    events = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)

        def serve():
            conn, dummy = listener.accept()
            with conn:
                client.read_line(conn)
                conn.sendall(b'{"ok": true}\n')
                time.sleep(0.3)
                events.append("closed")
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert client.request('{"op": "ping"}', path, 30) == b'{"ok": true}\n'
        events.append("returned")
        t.join(30)
    assert events == ["closed", "returned"]


def test_waiting_for_the_close_is_bounded_and_a_reset_is_no_error():
    client = _client_module()
    mine, peer = socket.socketpair()
    with mine, peer:
        t0 = time.monotonic()
        client.wait_for_close(mine, timeout=0.2)  # the peer never closes: given up after the timeout
        assert 0.2 <= time.monotonic() - t0 < 5
    mine, peer = socket.socketpair()
    with mine:
        peer.sendall(b"x")
        mine.sendall(b"unread")
        peer.close()  # closed with unread data: a reset
        client.wait_for_close(mine, timeout=5)
