"""The far ends and the client of the egress proxy's netns tests
(tests/integration/netns/test_egress_proxy_netns.py).

target LOG ADDR:PORT...
        Listens on each ADDR:PORT; for every connection appends
        "<local addr>:<port> <peer>" to LOG (before reading a byte), reads
        the request head and answers "HTTP/1.0 200 OK" with the body
        "hello from <local addr>:<port>". Prints READY when bound.
files LOG ADDR:PORT DIR
        A static HTTP server of DIR on ADDR:PORT (git's dumb HTTP protocol
        reads a bare repository so); logs each connection to LOG as target
        does, before reading a byte. Prints READY when bound.
connect PROXY_HOST PROXY_PORT HOST PORT
        CONNECT HOST:PORT through the proxy, then a plain HTTP request
        through the tunnel. Prints one JSON object: proxy (the proxy's
        status line), body (the far end's answer, "" when none).
get PROXY_HOST PROXY_PORT URL
        A plain HTTP request for URL through the proxy; prints the same JSON
        (proxy: the status line, body: the body).
hold PROXY_HOST PROXY_PORT HOST PORT
        CONNECT HOST:PORT through the proxy and print the proxy's status
        line; after a line on stdin, a request through the same tunnel:
        prints the far end's answer's body ("" when none).
bench HOST PORT COUNT SIZE [PROXY_HOST PROXY_PORT]
        COUNT connections, each to its first answer (connect, and through a
        proxy the CONNECT, then a request), then one transfer of SIZE bytes
        (the target's /bytes/SIZE); directly, or through the proxy. Prints
        JSON: latency_ms (one per connection), mbytes_per_s.
"""

import json
import socket
import sys
import threading
import time

TIMEOUT = 5.0
SERVER_TIMEOUT = 30.0  # a held tunnel's far end waits this long for its request


def _head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _sep, rest = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def _answer(conn, local):
    """One connection: the request head, then the bytes asked for or the greeting."""
    try:
        conn.settimeout(SERVER_TIMEOUT)
        head, _rest = _head(conn)
        path = (head.split(" ") + ["", ""])[1]
        if path.startswith("/bytes/"):
            size = int(path[len("/bytes/"):])
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            block = b"\0" * 65536
            while size > 0:
                conn.sendall(block[:size])
                size -= len(block)
        else:
            body = ("hello from %s" % local).encode()
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        conn.close()


def _serve(sock, log, lock):
    """Log each connection before reading a byte of it, answer it in a thread of its own."""
    local = "%s:%d" % sock.getsockname()[:2]
    while True:
        conn, peer = sock.accept()
        with lock, open(log, "a") as out:
            out.write("%s %s\n" % (local, peer[0]))
        threading.Thread(target=_answer, args=(conn, local), daemon=True).start()


def target(log, specs):
    lock = threading.Lock()
    threads = []
    for spec in specs:
        host, port = spec.rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(16)
        threads.append(threading.Thread(target=_serve, args=(sock, log, lock), daemon=True))
    for thread in threads:
        thread.start()
    print("READY", flush=True)
    for thread in threads:
        thread.join()


def files(log, spec, directory):
    import functools
    import http.server

    host, port = spec.rsplit(":", 1)
    local = "%s:%s" % (host, port)

    class Server(http.server.ThreadingHTTPServer):
        def verify_request(self, request, client_address):  # accepted, nothing read yet
            with open(log, "a") as out:
                out.write("%s %s\n" % (local, client_address[0]))
            return True

    server = Server((host, int(port)), functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory))
    print("READY", flush=True)
    server.serve_forever()


def _read_all(sock, keep=True):
    """What the peer sends until it closes; with keep=False only how many
    bytes (nothing is kept: the bench's transfers are large)."""
    data, count = bytearray(), 0
    try:
        while True:
            chunk = sock.recv(262144)
            if not chunk:
                break
            count += len(chunk)
            if keep:
                data += chunk
    except OSError:
        pass
    return bytes(data) if keep else count


def _through(proxy_host, proxy_port, exchange):
    """{"proxy": status line, "body": ...} of ``exchange(sock, result)`` on a
    connection to the proxy; "ERROR ..." when the proxy cannot be reached."""
    result = {"proxy": "", "body": ""}
    try:
        sock = socket.create_connection((proxy_host, int(proxy_port)), timeout=TIMEOUT)
    except OSError as exc:
        result["proxy"] = "ERROR %s" % exc
        return result
    with sock:
        exchange(sock, result)
    return result


def connect(proxy_host, proxy_port, host, port):
    def exchange(sock, result):
        sock.sendall(("CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n" % (host, port, host, port)).encode())
        head, rest = _head(sock)
        result["proxy"] = head.split("\r\n", 1)[0]
        if " 200 " in result["proxy"] + " ":
            sock.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % host).encode())
            answer = rest + _read_all(sock)
            result["body"] = answer.partition(b"\r\n\r\n")[2].decode("latin-1")
    return _through(proxy_host, proxy_port, exchange)


def get(proxy_host, proxy_port, url):
    def exchange(sock, result):
        host = url.split("//", 1)[1].split("/", 1)[0]
        sock.sendall(("GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" % (url, host)).encode())
        head, _sep, body = _read_all(sock).partition(b"\r\n\r\n")
        result["proxy"] = head.decode("latin-1").split("\r\n", 1)[0]
        result["body"] = body.decode("latin-1")
    return _through(proxy_host, proxy_port, exchange)


def _open(host, port, proxy):
    """A socket to host:port, directly or through a CONNECT tunnel of ``proxy`` (host, port)."""
    if not proxy:
        return socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock = socket.create_connection((proxy[0], int(proxy[1])), timeout=TIMEOUT)
    sock.sendall(("CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n" % (host, port, host, port)).encode())
    head, _rest = _head(sock)
    if " 200 " not in head.split("\r\n", 1)[0] + " ":
        raise OSError("proxy refused: %s" % head.split("\r\n", 1)[0])
    return sock


def hold(proxy_host, proxy_port, host, port):
    sock = socket.create_connection((proxy_host, int(proxy_port)), timeout=TIMEOUT)
    with sock:
        sock.sendall(("CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\n\r\n" % (host, port, host, port)).encode())
        head, rest = _head(sock)
        print(head.split("\r\n", 1)[0], flush=True)
        sys.stdin.readline()
        try:
            sock.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % host).encode())
            answer = rest + _read_all(sock)
        except OSError:
            answer = b""
        print(answer.partition(b"\r\n\r\n")[2].decode("latin-1"), flush=True)


def bench(host, port, count, size, *proxy):
    latency = []
    for _i in range(int(count)):
        start = time.perf_counter()
        with _open(host, port, proxy) as sock:
            sock.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % host).encode())
            _read_all(sock)
        latency.append((time.perf_counter() - start) * 1000.0)
    start = time.perf_counter()
    with _open(host, port, proxy) as sock:
        sock.sendall(("GET /bytes/%d HTTP/1.0\r\nHost: %s\r\n\r\n" % (int(size), host)).encode())
        got = _read_all(sock, keep=False)
    seconds = time.perf_counter() - start
    return {"latency_ms": latency, "mbytes_per_s": got / seconds / 1e6, "bytes": got}


if __name__ == "__main__":
    if sys.argv[1] == "target":
        target(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "files":
        files(*sys.argv[2:5])
    elif sys.argv[1] == "hold":
        hold(*sys.argv[2:6])
    elif sys.argv[1] == "bench":
        print(json.dumps(bench(*sys.argv[2:])))
    elif sys.argv[1] == "connect":
        print(json.dumps(connect(*sys.argv[2:6])))
    else:
        print(json.dumps(get(*sys.argv[2:5])))
