"""Tiny TCP/UDP peer-echo servers and probes for the cell_nat netns tests.

serve SPEC...   SPEC = tcp:ADDR:PORT or udp:ADDR:PORT (ADDR may be '::' for
                dual stack). Every connection/datagram is answered with the
                peer's address as the server sees it. Prints READY when bound.
probe PROTO HOST PORT TIMEOUT [SOURCE]
                Prints the echoed peer address and exits 0, or prints
                TIMEOUT/REFUSED/ERROR and exits 1.
"""

import socket
import sys
import threading


def _peer(addr):
    host = addr[0]
    return host[7:] if host.startswith("::ffff:") else host


def _family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind(kind, host, port):
    sock = socket.socket(_family(host), socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if _family(host) == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, int(port)))
    if kind == "tcp":
        sock.listen(64)
    return sock


def _serve_tcp(sock):
    while True:
        conn, addr = sock.accept()
        try:
            conn.sendall((_peer(addr) + "\n").encode())
        finally:
            conn.close()


def _serve_udp(sock):
    while True:
        _data, addr = sock.recvfrom(2048)
        sock.sendto((_peer(addr) + "\n").encode(), addr)


def serve(specs):
    threads = []
    for spec in specs:
        kind, rest = spec.split(":", 1)
        host, port = rest.rsplit(":", 1)
        sock = _bind(kind, host, port)
        target = _serve_tcp if kind == "tcp" else _serve_udp
        threads.append(threading.Thread(target=target, args=(sock,), daemon=True))
    for thread in threads:
        thread.start()
    print("READY", flush=True)
    for thread in threads:
        thread.join()


def probe(proto, host, port, timeout, source=None):
    fam = _family(host)
    sock = socket.socket(fam, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
    sock.settimeout(float(timeout))
    if source:
        sock.bind((source, 0))
    try:
        if proto == "tcp":
            sock.connect((host, int(port)))
            data = sock.recv(200)
        else:
            sock.sendto(b"q", (host, int(port)))
            data, _addr = sock.recvfrom(200)
    except socket.timeout:
        print("TIMEOUT")
        return 1
    except ConnectionRefusedError:
        print("REFUSED")
        return 1
    except OSError as exc:
        print("ERROR %s" % exc)
        return 1
    finally:
        sock.close()
    print(data.decode().strip())
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2:])
    else:
        sys.exit(probe(*sys.argv[2:]))
