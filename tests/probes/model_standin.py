#!/usr/bin/python3 -I
"""A stand-in for the model endpoint an agent calls (tests/helpers/gitserver.py
starts it in the git server's network namespace):

    model_standin.py ADDR PORT LOG < token

POST /v1/edit with ``Authorization: Bearer <token>`` (the token read from
stdin, never from the command line) answers {"line": ...}; any other
credential 401.  Each request is one JSON line in LOG: {"path", "authorized"}.
Standard library only."""

import hmac
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv):
    addr, port, log = argv[0], int(argv[1]), argv[2]
    token = sys.stdin.readline().strip()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            ok = hmac.compare_digest(self.headers.get("Authorization", ""), "Bearer " + token)
            with open(log, "a") as fh:
                fh.write(json.dumps({"path": self.path, "authorized": ok}) + "\n")
            data = json.dumps({"line": "model edit for turn %s" % body.get("turn")} if ok
                              else {"error": "unauthorized"}).encode()
            self.send_response(200 if ok and self.path == "/v1/edit" else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
