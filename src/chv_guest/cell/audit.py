"""`chv-cell audit`: the isolation case catalog, run on this guest
(docs/isolation-cases.md).

Each case names one boundary of a cell, the probe the boundary must stop,
and a control that must succeed in the same run. A case whose control did
not succeed is an error, never a pass: a cell that did not start, a
missing tool or a broken probe proves nothing. A case that needs what this
guest or this run lacks (a second slot, a delegated cgroup controller, a
destination to test) is skipped with the requirement named;
``--strict-skips`` makes a skip fail the run.

The probes run in real cells through ``chv-cell run``: cell A runs
audit_probe.py (every probe and its control, in one cell), cell B, in a
second slot, a listener A must not reach. This side prepares what the
probes look for (a root-only file in /etc/chv, a credentials file in the
slot's home, a listener on every guest address, a marked guest process),
checks afterwards what a cell must not have changed, runs the lifecycle
cases, removes what it made, and writes the report: JSON, JUnit XML and
Markdown. Exit 0: every case passed (or was skipped); 1: a case failed;
2: no case failed but a control did not succeed.

The cases themselves (each one's words, judge and counter-proof) are the
catalog package's objects (catalog/, one module per area); this module
is the guest side that gathers their facts and the reports."""

from __future__ import annotations

import hashlib
import html
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import argv as argvmod
from . import claim as claimmod
from . import audit_probe as probe
from . import disk as diskmod
from . import families as familiesmod
from . import health as healthmod
from . import policy as policymod
from . import records
from . import resolver as resolvermod
from . import egresslog
from .catalog import BY_ID, EXCLUSIVE_SKIP, LIFECYCLE_CASES, cases_for, judge
from .catalog.case import Result, egress_mode, error
from .catalog.facts import COOKIE_NAME, COOKIE_PATH, METADATA, QUOTA_EXTRA, RAW_MARKER, SHOTS_DIR, Facts, marker
from .catalog.fs import hidden_paths

EXIT_FAILED = 1
EXIT_ERROR = 2
PAGE = ("<!doctype html><html><head><title>chv-audit</title></head><body><h1>chv-audit</h1>"
        "<!-- %s --><script>var raw = '%s';</script></body></html>" % (RAW_MARKER, RAW_MARKER))
# TEN-02: chv-broker's configuration; what the file does not set, chv-broker's DEFAULTS
# (src/chv_guest/broker/config.py, read by broker_limits)
BROKER_CONFIG = "/etc/chv-fleet/broker.json"
BROKER_LIMITS = ("max_connections_per_slot", "read_timeout")  # what TEN-02 reads of chv-broker's configuration
CELL_BROKER_SOCKET = "/run/chv/broker.sock"  # where the cells have chv-broker (the client's default)
# TEN-04: families a cell of the default policy must not get, and how each is tried
# (socket type, protocol); families not named here are tried as datagram sockets
FAMILY_PROBES = ("AF_VSOCK", "AF_PACKET", "AF_XDP")
FAMILY_TYPES = {"AF_UNIX": (1, 0), "AF_INET": (1, 0), "AF_INET6": (1, 0), "AF_NETLINK": (3, 0), "AF_VSOCK": (1, 0),
                "AF_PACKET": (3, 0), "AF_XDP": (3, 0)}
# TEN-07: what the payload writes to stderr, a busy launcher's words (runner.Launcher)
FORGED_BUSY = "chv-cell: all 1 slot(s) busy (slot0) for 1s; giving up"


def loop_backing_file(dev: int) -> Optional[str]:
    """The file a loop device ``dev`` (st_dev) reads from, or None (not a loop device)."""
    try:
        with open("/sys/dev/block/%d:%d/loop/backing_file" % (os.major(dev), os.minor(dev))) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _allocated(path: Optional[str]) -> int:
    """Bytes of the guest's disk allocated to ``path`` (0 for None)."""
    return os.stat(path).st_blocks * 512 if path else 0


def _family_spec(name: str) -> List[int]:
    """[family number, socket type, protocol] of TEN-04's try of family ``name``."""
    return [familiesmod.FAMILIES[name]] + list(FAMILY_TYPES.get(name, (2, 0)))


def verdict_of(results: Mapping[str, Result], strict_skips: bool = False) -> Tuple[str, int, Dict[str, int]]:
    counts = dict((v, 0) for v in ("pass", "fail", "error", "skip"))
    for r in results.values():
        counts[r["verdict"]] += 1
    if counts["fail"] or (strict_skips and counts["skip"]):
        return "failed", EXIT_FAILED, counts
    if counts["error"]:
        return "error", EXIT_ERROR, counts
    return "passed", 0, counts


# ------------------------------------------------------------- reports

def report(results: Mapping[str, Result], header: Dict[str, str], strict_skips: bool = False,
           only: Optional[Sequence[str]] = None, mode: str = "cidr") -> Facts:
    """The report of every case of a guest in egress ``mode`` (or of the
    cases ``only`` names), in the catalog's order."""
    verdict, code, counts = verdict_of(results, strict_skips)
    cases: List[Facts] = []
    for c in cases_for(mode):
        if only is not None and c.id not in only:
            continue
        r = results.get(c.id) or error("the audit did not reach this case")
        cases.append(dict(r, id=c.id, area=c.area, title=c.title))
    return {"verdict": verdict, "exit": code, "counts": counts, "header": header, "cases": cases}


def to_markdown(rep: Facts) -> str:
    h = rep["header"]
    lines = ["# chv-cell audit: %s on %s" % (rep["verdict"].upper(), h.get("guest")), "",
             "%(pass)d passed, %(fail)d failed, %(error)d errors, %(skip)d skipped" % rep["counts"], ""]
    lines += ["- %s: %s" % (k, h[k]) for k in sorted(h)]
    lines += ["", "| id | boundary | verdict | probe | control |", "|---|---|---|---|---|"]
    for c in rep["cases"]:
        lines.append("| %s | %s | %s | %s | %s |" % (c["id"], c["title"], c["verdict"].upper(),
                                                     cell_text(c["probe"]), cell_text(c["control"])))
    return "\n".join(lines) + "\n"


def cell_text(text: str) -> str:
    """Evidence as one Markdown table cell: no row break, no column break."""
    return " / ".join(line.strip() for line in text.splitlines() if line.strip()).replace("|", "/")


def to_junit(rep: Facts) -> str:
    suite = ET.Element("testsuite", name="chv-cell audit %s" % rep["header"].get("guest"), tests=str(len(rep["cases"])),
                       failures=str(rep["counts"]["fail"]), errors=str(rep["counts"]["error"]),
                       skipped=str(rep["counts"]["skip"]))
    props = ET.SubElement(suite, "properties")
    for k in sorted(rep["header"]):
        ET.SubElement(props, "property", name=k, value=str(rep["header"][k]))
    for c in rep["cases"]:
        case = ET.SubElement(suite, "testcase", classname=c["area"], name="%s %s" % (c["id"], c["title"]))
        text = "probe: %s\ncontrol: %s" % (c["probe"], c["control"])
        if c["verdict"] in ("fail", "error", "skip"):
            tag = {"fail": "failure", "error": "error", "skip": "skipped"}[c["verdict"]]
            ET.SubElement(case, tag, message=(c["probe"] if c["verdict"] != "error" else c["control"])[:200]).text = text
        else:
            ET.SubElement(case, "system-out").text = text
    return ET.tostring(suite, encoding="unicode")


def write_files(directory: str, files: Mapping[str, str]) -> None:
    """{name: text} into `directory`, each file replaced whole."""
    os.makedirs(directory, exist_ok=True)
    for name, text in sorted(files.items()):
        tmp = os.path.join(directory, "." + name)
        with open(tmp, "w") as fh:
            fh.write(text)
        os.rename(tmp, os.path.join(directory, name))


def report_files(rep: Facts) -> Dict[str, str]:
    return {"audit.json": json.dumps(rep, indent=2, sort_keys=True) + "\n", "audit.xml": to_junit(rep) + "\n",
            "audit.md": to_markdown(rep)}


def write_reports(rep: Facts, directory: str) -> None:
    write_files(directory, report_files(rep))


# ------------------------------------------------------------- the guest side

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def _launcher_hash() -> str:
    """The digest of the launcher's files and the catalog's (catalog/), which judged the run."""
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    names = [n for n in os.listdir(here) if n.endswith(".py")]
    names += ["catalog/" + n for n in os.listdir(os.path.join(here, "catalog")) if n.endswith(".py")]
    for name in sorted(names):
        h.update(name.encode() + b"\0" + _sha256(os.path.join(here, name)).encode())
    return h.hexdigest()


def _first_line(argv: List[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
        return (p.stdout.splitlines() or [""])[0]
    except OSError:
        return ""


def _os_release() -> str:
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def header(policy_path: str, labels: Mapping[str, str]) -> Dict[str, str]:
    h = {"guest": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "policy": policy_path, "policy_sha256": _sha256(policy_path), "launcher_sha256": _launcher_hash(),
         "kernel": platform.release(), "systemd": _first_line(["systemctl", "--version"]), "os": _os_release()}
    h.update(labels)
    return h


class Listener(object):
    """A TCP listener (by default on every guest address, a free port) that
    answers every connection with PAGE over HTTP/1.0 (after the request, or
    half a second of silence) until closed, and records each connection's
    local and peer address in `seen`; a context manager. The page, opened
    through chv-browser, is BRW-04's: the heading must reach the cell's
    snapshot, the comment and script (RAW_MARKER) must not."""

    def __init__(self, address: str = "0.0.0.0", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.sock.settimeout(0.3)
        self.address, self.port = address, self.sock.getsockname()[1]
        self.seen: List[Dict[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            self.seen.append({"local": conn.getsockname()[0], "peer": peer[0]})
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.5)
            request = b""
            try:
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
            except OSError:
                pass
            body, extra = Listener.page(request)
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n%s"
                             b"Connection: close\r\n\r\n" % (len(body), extra) + body)
            except OSError:
                pass

    @staticmethod
    def page(request: bytes) -> Tuple[bytes, bytes]:
        """(body, extra header lines) for the raw request: PAGE, or for
        COOKIE_PATH?v=VALUE a page that sets the cookie COOKIE_NAME=VALUE-kept
        and shows, as a heading, the Cookie header it received (TEN-03)."""
        line = request.split(b"\r\n", 1)[0].decode("latin-1", "replace").split()
        target = line[1] if len(line) > 1 else "/"
        path, dummy, query = target.partition("?")
        if path != COOKIE_PATH:
            return PAGE.encode(), b""
        value = "".join(c for c in query.partition("v=")[2].split("&")[0] if c.isalnum())[:32]
        sent = ""
        for header in request.decode("latin-1", "replace").split("\r\n")[1:]:
            name, dummy, rest = header.partition(":")
            if name.strip().lower() == "cookie":
                sent = rest.strip()
        body = ("<!doctype html><html><head><title>chv-audit-cookie</title></head><body><h1>chv-audit-cookie</h1>"
                "<h2>sent:[%s]</h2></body></html>" % html.escape(sent)).encode()
        extra = ("Set-Cookie: %s=%s-kept; Path=/; Max-Age=3600\r\n" % (COOKIE_NAME, value)).encode() if value else b""
        return body, extra

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _guest_addresses(ip: str) -> Tuple[List[str], List[str]]:
    """The guest's IPv4 and global IPv6 addresses (no loopback, no link-local)."""
    v4: List[str] = []
    v6: List[str] = []
    for family, out in (("-4", v4), ("-6", v6)):
        proc = subprocess.run([ip, "-j", family, "addr", "show"], capture_output=True, text=True, check=False)
        try:
            links = json.loads(proc.stdout or "[]")
        except ValueError:
            links = []
        for link in links:
            for info in link.get("addr_info", []):
                local = info.get("local", "")
                if family == "-4" and local and not local.startswith("127."):
                    out.append(local)
                if family == "-6" and info.get("scope") == "global" and local:
                    out.append(local)
    return sorted(set(v4)), sorted(set(v6))


def _chv_cell(policy_path: str, *args: str) -> List[str]:
    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-I", os.path.join(lib, "chv-cell"), "--policy", policy_path] + list(args)


def _run_cell(policy_path: str, slot: str, payload: List[str], timeout: float,
              extra: Sequence[str] = ()) -> Tuple[int, str, str]:
    argv = _chv_cell(policy_path, "run", "--slot", slot, "--timeout", str(timeout), *extra) + ["--"] + payload
    p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout + 300)
    return p.returncode, p.stdout, p.stderr


def _cell_report(rc: int, out: str, err: str, keep: int) -> Tuple[Optional[Facts], str]:
    """The report of an audit_probe.py run in a cell (its last line of
    output, JSON), or None and why (the last ``keep`` characters it wrote)."""
    try:
        rep = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
    except (ValueError, IndexError):
        rep = None
    return rep, "" if rep is not None else "chv-cell run exited %s: %s" % (rc, (err or out).strip()[-keep:])


def _record_exists(pol: policymod.Policy, slot: policymod.Slot) -> bool:
    return os.path.exists(argvmod.cell_paths(pol, slot)["record"])


def _wait(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


class Fixtures(object):
    """What the guest side puts on the guest for one run, removed again."""

    def __init__(self) -> None:
        self.files: List[str] = []
        self.dirs: List[str] = []
        self.procs: List[subprocess.Popen[Any]] = []
        self.undo: List[Callable[[], object]] = []
        self.trees: List[str] = []

    def file(self, path: str, text: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        """A new file (never an existing one, never through a link: the audit runs as root in
        directories a cell writes, where an earlier task may have planted a link at the name)."""
        parent, name = os.path.split(path)
        dfd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        finally:
            os.close(dfd)
        self.files.append(path)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)

    def directory(self, path: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        os.mkdir(path, mode)
        os.chown(path, uid, gid)
        self.dirs.append(path)

    def cleanup(self, keep_files: bool = False) -> List[str]:
        """End the processes and undo the guest changes; remove the files,
        directories and trees unless ``keep_files`` (returns those kept)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if keep_files:
            for fn in self.undo:
                fn()
            return [p for p in self.files + self.dirs + self.trees if os.path.lexists(p)]
        for path in self.files:
            try:
                os.unlink(path)
            except OSError:
                pass
        for path in reversed(self.dirs):
            try:
                os.rmdir(path)
            except OSError:
                pass
        for path in self.trees:
            shutil.rmtree(path, ignore_errors=True)
        for fn in self.undo:
            fn()
        return []


def _broker_as(client: str, uid: Optional[int] = None, sock: Optional[str] = None) -> Facts:
    """A ping from the guest, outside every cell, as root or ``uid``, to chv-broker's
    socket or ``sock`` (a counter-proof's test build: doorbuild.py)."""
    kwargs: Dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    if sock:
        kwargs["env"] = dict(os.environ, CHV_BROKER_SOCKET=sock)
    try:
        p = subprocess.run([sys.executable, "-I", client, json.dumps({"op": "ping"})], capture_output=True,
                           text=True, timeout=30, check=False, **kwargs)
        return {"rc": p.returncode, "out": p.stdout.strip()[-300:], "err": p.stderr.strip()[-300:]}
    except OSError as exc:
        return {"rc": None, "out": "", "err": str(exc)}


def _cell_probes(pol: policymod.Policy, policy_path: str, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], opts: Facts, fix: Fixtures,
                 facts: Facts) -> None:
    """Cells A and B with their fixtures; fills facts["a"], ["b"] and the
    guest's observations."""
    g, nonce = facts["guest"], facts["nonce"]
    launch = opts.get("cell_policy") or policy_path  # a counter-proof's loosened copy
    paths_a = argvmod.cell_paths(pol, slot_a)
    uid_a = slot_a["uid_base"]
    home = pol["agent_state_mount"]
    mark = ".chv-audit-%s" % nonce
    read: Dict[str, str] = {}
    write: Dict[str, str] = {}
    # FS-01: a root-only file in /etc/chv
    if os.path.isdir("/etc/chv"):
        # readable by every guest user: only the cell's boundary keeps it out
        fix.file("/etc/chv/%s" % mark, "secret\n", 0o644)
        read["etc_chv"] = "/etc/chv/%s" % mark
        g["etc_chv_readable"] = os.access("/etc/chv/%s" % mark, os.R_OK)
    read["os_release"] = "/etc/os-release"
    # FS-02: the credentials file (an existing one is used as it is, never changed)
    cred = os.path.join(paths_a["agent_state"], ".git-credentials")
    if not os.path.lexists(cred):  # a link there (a cell's) is left as it is, never followed
        fix.file(cred, "https://audit:audit@example.invalid\n", 0o644, uid_a, uid_a)
    fix.file(os.path.join(paths_a["agent_state"], mark), "ordinary\n", 0o644, uid_a, uid_a)
    read["credentials"] = os.path.join(home, ".git-credentials")
    read["ordinary"] = os.path.join(home, mark)
    # FS-03: slot B's workspace by its guest path; the control in A's own
    fix.file(os.path.join(paths_a["workspace"], mark), "own\n", 0o644, uid_a, uid_a)
    read["own_workspace"] = os.path.join(pol["workspace_mount"], mark)
    if slot_b is not None:
        paths_b = argvmod.cell_paths(pol, slot_b)
        fix.file(os.path.join(paths_b["workspace"], mark), "other\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
        read["other_workspace"] = os.path.join(paths_b["workspace"], mark)
    # FS-04: screenshots, when chv-browser's directory is there
    shots = SHOTS_DIR
    if os.path.isdir(shots) and slot_b is not None:
        for s in (slot_a, slot_b):
            d = os.path.join(shots, s["name"])
            if not os.path.isdir(d):
                fix.directory(d, 0o755)
            fix.file(os.path.join(d, mark), "shot\n", 0o644)
        read["own_shots"] = "/run/chv/shots/%s" % mark
        read["other_shots"] = os.path.join(shots, slot_b["name"], mark)
    else:
        facts["shots_skip"] = "chv-browser's screenshots directory (%s) and a second slot" % shots
    # FS-05: every inaccessible path the guest has (FS-01, FS-02 and FS-04 have theirs)
    for path in hidden_paths(pol):
        if os.path.exists(path):
            read["hidden:" + path] = path
    read["env"] = "/usr/bin/env"
    read["state_dir"] = pol["state_dir"]
    read["run_chv"] = "/run/chv"
    write["workspace"] = os.path.join(pol["workspace_mount"], mark + ".w")
    write["usr"] = "/usr/%s" % mark
    write["etc"] = "/etc/%s" % mark
    here = os.path.dirname(os.path.abspath(__file__))
    trusted = [policy_path] + [os.path.join(here, name) for name in ("launcher.py", "runner.py", "checks.py", "policy.py")]
    if opts["broker_client"]:
        trusted.append(os.path.join(os.path.dirname(opts["broker_client"]), "peer.py"))
    trusted = [p for p in trusted + list(opts["trusted"]) if os.path.isfile(p)]
    for path in trusted:
        write["trusted:" + path] = probe.APPEND + path
    before = dict((p, _sha256(p)) for p in trusted)
    # the guest's listener, every guest address, the metadata stand-in
    listener = Listener(port=probe.GUEST_PORT)
    fix.undo.append(listener.close)
    ip = pol["ip"]
    v4, v6 = _guest_addresses(ip)
    if opts["metadata_stand_in"] and METADATA not in v4:
        subprocess.run([ip, "addr", "add", METADATA + "/32", "dev", "lo"], check=True)
        fix.undo.append(lambda: subprocess.run([ip, "addr", "del", METADATA + "/32", "dev", "lo"], check=False))
    gateways = [slot_a["gateway"]] + ([slot_b["gateway"]] if slot_b else [])
    tcp: Dict[str, List[Any]]
    tcp, g["reach"] = {}, {}
    for addr in sorted(set(v4 + gateways) - {METADATA}):
        tcp["guest:" + addr] = [addr, listener.port]
    if opts["metadata_stand_in"]:
        tcp["metadata"] = [METADATA, listener.port]
    if opts.get("special"):
        tcp["special"] = list(healthmod.parse_target(opts["special"]))
    for key, target in [("allow:" + t, t) for t in opts["allow"]] + [("deny:" + t, t) for t in opts["deny"]]:
        tcp[key] = list(healthmod.parse_target(target))
    if slot_b is not None:
        tcp["cell_b"] = [slot_b["address"], probe.LISTENER_PORT]
    tcp6 = dict((a, [a, listener.port]) for a in v6)
    tcp6["2001:db8::1"] = ["2001:db8::1", 80]
    # the marked guest process (ID-11, ID-12, ID-13)
    marker = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(600)", probe.MARKER])
    fix.procs.append(marker)
    request: Facts
    request = {"nonce": nonce, "read": read, "write": write, "tcp": tcp, "tcp6": tcp6, "guest_pid": marker.pid,
               "ip": ip, "cell_ifname": slot_a["cell_ifname"], "gateway": slot_a["gateway"],
               "broker_client": opts["broker_client"] if os.path.exists(opts["broker_client"] or "") else None}
    # the doors (BRW): chv-browser opens, for cell A, the allowed page and every target the cell may not reach
    if request["broker_client"] and opts.get("allow_url"):
        denied = dict((key, "http://%s:%s/chv-audit-door" % (host, port)) for key, (host, port) in tcp.items()
                      if key.startswith("guest:") or key in ("metadata", "cell_b"))
        denied["guest:127.0.0.1"] = "http://127.0.0.1:%d/chv-audit-door" % listener.port
        if "special" in tcp:
            denied["special"] = "http://%s:%s/chv-audit-door" % tuple(tcp["special"])
        request["browser"] = {"allowed": opts["allow_url"], "denied": denied}
        request["cookie"] = cookie_url(opts["allow_url"], nonce)
    if pol.get("egress_proxy"):
        request["egress"] = _egress_request(pol, opts, listener.port, g)
    _tenant_fixtures(pol, slot_a, slot_b, request, fix, facts, mark)
    if opts.get("probes") is not None:
        compose(request, opts["probes"])
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "audit_probe.py")
    # cell B first: its listener, its uid_map and its control
    b_proc = None
    if slot_b is not None:
        paths_b = argvmod.cell_paths(pol, slot_b)
        ready, done, seen = (os.path.join(paths_b["workspace"], mark + s) for s in (".ready", ".done", ".seen"))
        breq = dict((k, os.path.join(pol["workspace_mount"], mark + "." + k)) for k in ("ready", "done", "seen"))
        breq["address"] = slot_b["address"]
        fix.files += [ready, done, seen]
        if request.get("quota"):
            # TEN-02: B pings when the guest drops the ping file (A holds the door then)
            breq.update((k, os.path.join(pol["workspace_mount"], mark + "." + k)) for k in ("ping", "pinged"))
            breq["broker_client"] = request["broker_client"]
            fix.files += [os.path.join(paths_b["workspace"], mark + "." + k) for k in ("ping", "pinged")]
        b_proc = subprocess.Popen(_chv_cell(launch, "run", "--slot", slot_b["name"], "--timeout",
                                            str(opts["timeout"]), "--", "python3", "-I", script, "in-cell-listener",
                                            json.dumps(breq)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        fix.procs.append(b_proc)
        if _wait(lambda: os.path.exists(ready) or b_proc.poll() is not None, opts["timeout"] + 30) and \
                os.path.exists(ready):
            with open(ready) as fh:
                facts["b"] = json.load(fh)
            g["b_seen_running"] = _record_exists(pol, slot_b) and os.path.exists("/sys/class/net/%s"
                                                                                 % slot_b["host_ifname"])
        else:
            # stderr=PIPE: never None
            facts["b_error"] = "cell B did not start: %s" % (b_proc.stderr.read()[-400:]  # type: ignore[union-attr]
                                                             if b_proc.poll() is not None
                                                             else "no ready file")
    for key, (host, port) in tcp.items():
        if key.startswith(("guest:", "allow:", "deny:", "metadata", "special")) and \
                key != "guest:" + slot_a["gateway"]:
            g["reach"][key.split(":", 1)[1] if ":" in key else key] = probe.connect(host, int(port))
    g["marker_alive"] = marker.poll() is None
    relay = None
    if request.get("quota") and b_proc is not None and "b" in facts:
        relay = threading.Thread(target=_quota_relay, args=(pol, slot_a, slot_b, mark, g), daemon=True)
        relay.start()
    counters_before = healthmod.read_counters()
    log_before = _log_size(opts.get("egress_log") or egresslog.DEFAULT_LOG) if request.get("egress") else 0
    seen_before = len(listener.seen)
    image_before = _allocated(g["disk"].get("image")) if "disk" in g else 0
    rc, out, err = _run_cell(launch, slot_a["name"], ["python3", "-I", script, "in-cell", json.dumps(request)],
                             opts["timeout"])
    if "disk" in g:
        # what the guest's disk gives the slot's image (allocated, not free space: other work on the
        # guest moves that meanwhile)
        g["disk"]["image_grew"] = _allocated(g["disk"].get("image")) - image_before
    counters_after = healthmod.read_counters()
    if request.get("egress"):
        # squid writes a line when a connection ends: the last ones may come a moment after cell A's
        time.sleep(1)
        g["egress"]["log"] = _log_since(opts.get("egress_log") or egresslog.DEFAULT_LOG, log_before,
                                        slot_a["name"])
    if relay is not None:
        relay.join(60)
    g["listener_seen"] = listener.seen[seen_before:]  # what reached the guest's listener while cell A ran
    if counters_before is not None and counters_after is not None:
        g["counters_moved"] = dict((name, n - counters_before.get(name, 0)) for name, n in counters_after.items()
                                   if n != counters_before.get(name, 0))
    facts["a"], why = _cell_report(rc, out, err, 600)
    if facts["a"] is None:
        facts["a_error"] = why
    if b_proc is not None:
        with open(done, "w"):
            pass
        try:
            b_proc.wait(30)
        except subprocess.TimeoutExpired:
            b_proc.kill()
        try:
            with open(seen) as fh:
                g["b_listener_seen"] = json.load(fh)  # what reached cell B's listener after its control
        except (OSError, ValueError):
            pass
    if facts["a"] is not None:
        _after_cell_a(pol, policy_path, launch, slot_a, slot_b, request, script, opts, facts)
    g["workspace_write_seen"] = os.path.exists(os.path.join(paths_a["workspace"], mark + ".w"))
    if g["workspace_write_seen"]:
        fix.files.append(os.path.join(paths_a["workspace"], mark + ".w"))
    g["etc_write_seen"] = os.path.exists("/etc/%s" % mark)
    g["trusted_changed"] = [p for p in trusted if _sha256(p) != before[p]]
    if request["broker_client"]:
        g["broker_root"] = _broker_as(request["broker_client"], None, opts.get("broker_socket"))
        g["broker_cell_uid"] = _broker_as(request["broker_client"], uid_a, opts.get("broker_socket"))


def _resolve(name: str) -> str:
    """The guest's IPv4 address for ``name``, or "" (it does not resolve)."""
    try:
        return str(socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError, UnicodeError):
        return ""


def _egress_request(pol: policymod.Policy, opts: Facts, guest_port: int, g: Facts) -> Facts:
    """Proxy mode (EGR cases): what cell A asks through its proxy (each
    --allow-name and --deny-name, the first allowed name's address as an IP
    literal, each --inside-name on the guest's listener port), what it
    tries past the proxy (the allowed names' addresses) and the resolvers it
    queries (those a cell would get outside proxy mode); the guest's own
    connections to the same destinations and queries to the same resolvers
    (the controls) go into g["egress"]."""
    connect: Dict[str, List[Any]] = {}
    direct: Dict[str, List[Any]] = {}
    e: Facts = {"resolved": {}, "reach": {}, "dns": {}}
    for kind in ("allow", "deny"):
        for target in opts.get(kind + "_name") or []:
            host, port = healthmod.parse_target(target)
            addr = e["resolved"][host] = _resolve(host)
            connect["%s:%s:%d" % (kind, host, port)] = [host, port]
            e["reach"]["%s:%s:%d" % (kind, host, port)] = probe.connect(addr, port) if addr else "does not resolve"
            if kind == "allow" and addr:
                direct["%s:%d" % (addr, port)] = [addr, port]
                connect.setdefault("literal:%s:%d" % (addr, port), [addr, port])
    for name in opts.get("inside_name") or []:
        key = "inside:%s:%d" % (name, guest_port)
        connect[key] = [name, guest_port]
        addr = e["resolved"][name] = _resolve(name)
        e["reach"][key] = probe.connect(addr, guest_port) if addr else "does not resolve"
    names = [healthmod.parse_target(t)[0] for t in opts.get("allow_name") or []]
    qname = names[0] if names else "chv-audit.invalid"
    try:
        servers = resolvermod.host_upstream(pol["dns_servers"] or None)[0]
    except resolvermod.ResolverError:
        servers = []  # EGR-05: an error, nothing to query
    e["dns"] = dict((server, probe.dns_query(server, qname)) for server in servers)
    e["qname"] = qname
    g["egress"] = e
    return {"connect": connect, "direct": direct, "dns": sorted(servers), "qname": qname}


def _log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _log_since(path: str, offset: int, slot: str) -> List[Dict[str, object]]:
    """The proxy's log lines for ``slot`` written after ``offset`` (egresslog's fields)."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            fh.seek(offset)
            lines = fh.read().splitlines()
    except OSError:
        return []
    parsed = [egresslog.parse_line(line) for line in lines]
    return [p for p in parsed if p is not None and p["slot"] == slot]


# the keys of cell A's request that only a section of its report reads (the others every section may read)
SECTION_KEYS = {"browser": ("browser",), "cookie": ("cookie",), "sync": ("sync",), "quota": ("quota",),
                "disk": ("disk",), "plant": ("plant",), "kernel": ("families",), "egress": ("egress",)}


def compose(request: Facts, probes: Iterable[str]) -> None:
    """Cell A's request for the sections ``probes`` only (those the cases
    of a --case run read): what no such case needs is neither asked in the
    cell nor, for the doors' and the second run's, prepared on the guest."""
    wanted = set(probes)
    request["probes"] = sorted(wanted)
    for section, keys in SECTION_KEYS.items():
        if section not in wanted:
            for key in keys:
                request.pop(key, None)


def cookie_url(allow_url: str, nonce: str) -> str:
    """The Listener's cookie page (TEN-03) on the --allow-url's host."""
    scheme, dummy, rest = allow_url.partition("://")
    return "%s://%s%s?v=%s" % (scheme, rest.split("/", 1)[0], COOKIE_PATH, nonce)


def broker_limits(path: str = BROKER_CONFIG) -> Facts:
    """max_connections_per_slot and read_timeout of chv-broker's configuration
    (its defaults where the file does not set them), and the file read."""
    cfg: Facts = {}
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        pass
    try:  # chv-broker's defaults, installed beside the launcher with chv-broker
        from ..broker.config import DEFAULTS  # noqa: PLC0415 (only the audit needs them)
    except ImportError:
        DEFAULTS = {}
    out = dict((k, cfg.get(k, DEFAULTS.get(k))) for k in BROKER_LIMITS)
    out["config"] = path if cfg else "%s (not readable: the defaults)" % path
    return out


def _tenant_fixtures(pol: policymod.Policy, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], request: Facts, fix: Fixtures, facts: Facts,
                     mark: str) -> None:
    """What the TEN cases need in cell A's request and on the guest."""
    g, nonce = facts["guest"], facts["nonce"]
    paths_a = argvmod.cell_paths(pol, slot_a)
    ws = pol["workspace_mount"]
    paths_b = argvmod.cell_paths(pol, slot_b) if slot_b else None
    b_ws = os.path.join(paths_b["workspace"], mark + ".b-file") if paths_b else None
    b_state = os.path.join(paths_b["agent_state"], mark + ".b-state") if paths_b else None
    if slot_b:
        assert b_ws is not None and b_state is not None  # both set with slot_b
        fix.file(b_ws, marker("bws", nonce) + "\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
        fix.file(b_state, marker("bstate", nonce) + "\n", 0o644, slot_b["uid_base"], slot_b["uid_base"])
    # TEN-04: the policy's families (the controls) and those it leaves out
    fam = pol.get("socket_families", list(familiesmod.DEFAULT_FAMILIES))
    if fam == familiesmod.ANY:
        facts["families_skip"] = "a socket_families list in the policy (it has %r: no filter)" % fam
    else:
        request["families"] = {"allowed": dict((n, _family_spec(n)) for n in fam),
                               "denied": dict((n, _family_spec(n)) for n in FAMILY_PROBES if n not in fam)}
        g["vsock_guest"] = probe.vsock_bind() if "AF_VSOCK" not in fam else None
    # TEN-05: the slot's own file system
    if pol.get("disk_max"):
        request["disk"] = ws
        g["disk"] = {"limit": diskmod.parse_size(pol["disk_max"]), "disk_max": pol["disk_max"],
                     "own_device": os.stat(paths_a["workspace"]).st_dev != os.stat("/").st_dev,
                     "image": loop_backing_file(os.stat(paths_a["workspace"]).st_dev)}
    # TEN-08: what cell A plants for chv-cell read
    plant: Dict[str, List[Any]]
    plant = {"file": ["file", os.path.join(ws, mark + ".read-file"), marker("read", nonce)],
             "shadow": ["symlink", os.path.join(ws, mark + ".read-shadow"), "/etc/shadow"],
             "fifo": ["fifo", os.path.join(ws, mark + ".read-fifo"), None]}
    if slot_b:
        plant["other_slot"] = ["symlink", os.path.join(ws, mark + ".read-b"), b_ws]
    request["plant"] = plant
    fix.files += [os.path.join(paths_a["workspace"], os.path.basename(p)) for dummy, p, dummy2 in plant.values()]
    # TEN-09: the audited slots' directories
    g["slot_dirs"] = []
    for s in [slot_a] + ([slot_b] if slot_b else []):
        paths = argvmod.cell_paths(pol, s)
        for kind in ("workspace", "agent_state"):
            try:
                st = os.lstat(paths[kind])
                g["slot_dirs"].append({"path": paths[kind], "uid_base": s["uid_base"], "uid": st.st_uid,
                                       "gid": st.st_gid, "mode": "%04o" % (st.st_mode & 0o7777),
                                       "dir": os.path.isdir(paths[kind]) and not os.path.islink(paths[kind])})
            except OSError as exc:
                g["slot_dirs"].append({"path": paths[kind], "error": exc.strerror})
    client = request["broker_client"]
    # TEN-01: the sync door
    if not client:
        facts["sync_skip"] = "chv-broker's client (--broker-client)"
    elif not shutil.which("git"):
        facts["sync_skip"] = "git on the guest (the sync door's worker and the cell's git init)"
    elif not slot_b:
        facts["sync_skip"] = "a second slot"
    else:
        repos: Dict[str, Facts] = {}
        for name, extra in (("clean", {}), ("packed_refs", {"packed_refs_link": b_ws}),
                            ("alternates", {"alternates": b_state})):
            repo = "%s-sync-%s" % (mark, name)
            repos[name] = dict(extra, repo=repo, path=os.path.join(ws, repo))
            fix.trees.append(os.path.join(paths_a["workspace"], repo))
        request["sync"] = {"repos": repos}
        assert b_ws is not None and b_state is not None  # both set with slot_b
        g["b_files_readable"] = all(os.access(p, os.R_OK) for p in (b_ws, b_state))
    # TEN-02: the door quota
    if not client:
        facts["quota_skip"] = "chv-broker's client (--broker-client)"
    elif not slot_b:
        facts["quota_skip"] = "a second slot"
    else:
        limits = broker_limits()
        g["quota"] = limits
        request["quota"] = {"limit": int(limits["max_connections_per_slot"]), "extra": QUOTA_EXTRA,
                            "socket": CELL_BROKER_SOCKET, "wait": 30,
                            "ready": os.path.join(ws, mark + ".quota-ready"), "go": os.path.join(ws, mark + ".quota-go")}
        fix.files += [os.path.join(paths_a["workspace"], mark + k) for k in (".quota-ready", ".quota-go")]


def _quota_relay(pol: policymod.Policy, slot_a: policymod.Slot, slot_b: policymod.Slot, mark: str, g: Facts) -> None:
    """TEN-02 on the guest: once cell A holds the door (its ready file), cell
    B pings (its ping file) and its reply is kept; then A may let go."""
    ws_a, ws_b = (argvmod.cell_paths(pol, s)["workspace"] for s in (slot_a, slot_b))
    ready, go = os.path.join(ws_a, mark + ".quota-ready"), os.path.join(ws_a, mark + ".quota-go")
    ping, pinged = os.path.join(ws_b, mark + ".ping"), os.path.join(ws_b, mark + ".pinged")
    try:
        if not _wait(lambda: os.path.exists(ready), 120):
            return
        t0 = time.monotonic()
        with open(ping, "w"):
            pass
        if _wait(lambda: os.path.exists(pinged), 15):
            with open(pinged) as fh:
                g["quota_b_ping"] = json.load(fh)
            g["quota_b_ping_seconds"] = round(time.monotonic() - t0, 3)
    except (OSError, ValueError) as exc:
        g["quota_relay_error"] = str(exc)
    finally:
        try:
            with open(go, "w"):
                pass
        except OSError:
            pass


def _read_slot(policy_path: str, slot: str, path: str) -> Facts:
    """chv-cell read --slot SLOT PATH: exit code, stdout, seconds."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(_chv_cell(policy_path, "read", "--slot", slot, "--", path), capture_output=True,
                           timeout=30, check=False)
        rc, out, err = p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", "no answer within 30 s"
    return {"rc": rc, "out": out[:2000], "err": err.strip()[-200:], "seconds": round(time.monotonic() - t0, 3)}


def _after_cell_a(pol: policymod.Policy, policy_path: str, launch: str, slot_a: policymod.Slot, slot_b: Optional[policymod.Slot], request: Facts,
                  script: str, opts: Facts, facts: Facts) -> None:
    """What follows cell A's run: the reader of its files (TEN-08) and run 2
    of slot A (TEN-03)."""
    g = facts["guest"]
    g["read"] = dict((name, _read_slot(policy_path, slot_a["name"], path))
                     for name, (dummy, path, dummy2) in sorted(request.get("plant", {}).items()))
    try:
        with open("/etc/shadow") as fh:
            g["shadow_words"] = [line.split(":", 1)[0] + ":" for line in fh if line.strip()][:3]
    except OSError:
        g["shadow_words"] = []
    if request.get("cookie"):
        run2 = {"broker_client": request["broker_client"], "cookie": request["cookie"]}
        rc, out, err = _run_cell(launch, slot_a["name"], ["python3", "-I", script, "in-cell-run2", json.dumps(run2)],
                                 opts["timeout"])
        facts["run2"], why = _cell_report(rc, out, err, 300)
        if facts["run2"] is None:
            facts["run2_error"] = why


STATUS_FD = "{status-fd}"


def _run_status(policy_path: str, slot: str, payload: List[str], timeout: float,
                extra: Sequence[str] = ()) -> Tuple[int, str, Optional[Facts]]:
    """_run_cell with --status-fd: (exit code, stdout, the status record or
    None); STATUS_FD in ``payload`` stands for the fd's number."""
    rfd: Optional[int]
    wfd: Optional[int]
    rfd, wfd = os.pipe()
    try:
        argv = _chv_cell(policy_path, "run", "--slot", slot, "--timeout", str(timeout), "--status-fd", str(wfd),
                         *extra) + ["--"] + [str(wfd) if a == STATUS_FD else a for a in payload]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(wfd,))
        os.close(wfd)
        wfd = None
        with os.fdopen(rfd, "r") as fh:
            rfd = None
            text = fh.read()
        out, dummy = p.communicate(timeout=timeout + 300)
    finally:
        for fd in (rfd, wfd):
            if fd is not None:
                os.close(fd)
    try:
        record = json.loads(text.splitlines()[0])
    except (ValueError, IndexError):
        record = None
    return p.returncode, out, record


FORGE = ("import errno, os, sys\nsys.stderr.write(%r + '\\n')\n"
         "try:\n    os.write(int(sys.argv[1]), b'{\"exit\": 75, \"verdict\": \"busy\"}\\n')\n    print('ok')\n"
         "except OSError as exc:\n    print(errno.errorcode.get(exc.errno, exc.errno))\nsys.exit(75)\n") % FORGED_BUSY


def _lifecycle(pol: policymod.Policy, policy_path: str, slot_a: policymod.Slot, opts: Facts, facts: Facts) -> None:
    g, nonce = facts["guest"], facts["nonce"]
    name = slot_a["name"]
    g["runs"] = [_run_cell(policy_path, name, ["true"], opts["timeout"])[0] for dummy in range(opts["runs"])]
    g["runtime"] = {"control_rc": _run_cell(policy_path, name, ["true"], opts["timeout"], ["--runtime-max", "30"])[0],
                    "limited_rc": _run_cell(policy_path, name, ["sleep", "30"], opts["timeout"],
                                            ["--runtime-max", "1"])[0]}
    # LIM-02: threads up to TasksMax + 16, where the guest enforces it
    limit = str(pol["properties"].get("TasksMax", ""))
    controllers = ""
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as fh:
            controllers = fh.read()
    except OSError:
        pass
    if not limit.isdigit():
        g["tasks_skip"] = "a numeric TasksMax in the policy's properties (it has %r)" % (limit or None)
    elif "pids" not in controllers.split():
        g["tasks_skip"] = "the pids cgroup controller delegated to the cells (this guest's cgroup.controllers: %r)" \
            % controllers.strip()
    else:
        code = ("import threading, time, sys\nn = 0\nfor _ in range(int(sys.argv[1])):\n"
                "    try:\n        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
                "        n += 1\n    except RuntimeError:\n        break\nprint(n)\n")
        counts: List[int] = []
        for want in (4, int(limit) + 16):
            out = _run_cell(policy_path, name, ["python3", "-I", "-c", code, str(want)], opts["timeout"])[1]
            counts.append(int(out.split()[-1]) if out.split() and out.split()[-1].isdigit() else -1)
        g["tasks"] = {"limit": int(limit), "control": counts[0], "started": counts[1]}
    # LIFE-03: every slot at once, then one more; only on a guest the audit
    # may fill (--exclusive): a busy guest's agents would be refused meanwhile
    if opts.get("exclusive"):
        # warm cells being replaced after the runs above: wait until they wait
        _wait(lambda: not any(records.payload_running(pol, s) for s in pol["slots"]), 10)
    busy = [s for s in pol["slots"] if records.payload_running(pol, s)]
    if not opts.get("exclusive"):
        g["busy_skip"] = EXCLUSIVE_SKIP
        # TEN-07's control without every slot: a run in cell A's slot while
        # the audit itself holds that slot's claim lock is a real busy run
        try:
            held = claimmod.try_claim(argvmod.cell_paths(pol, slot_a)["lock"])
        except claimmod.SlotBusy:
            held = None
        if held is not None:
            try:
                extra, dummy, record = _run_status(policy_path, name, ["true"], 1)
            finally:
                held.release()
            g["busy_control"] = {"extra_rc": extra, "extra_record": record}
    elif busy:
        g["busy_skip"] = "every slot idle (busy: %s)" % ", ".join(s["name"] for s in busy)
    else:
        go = ".chv-audit-go-%s" % nonce
        gate = "until test -e %s/%s; do sleep 0.1; done" % (pol["workspace_mount"], go)
        procs = [subprocess.Popen(_chv_cell(policy_path, "run", "--slot", s["name"], "--timeout", str(opts["timeout"]),
                                            "--", "sh", "-c", gate), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for s in pol["slots"]]
        try:
            _wait(lambda: all(records.payload_running(pol, s) for s in pol["slots"]) or
                  any(p.poll() is not None for p in procs), opts["timeout"] + 30)
            running = sum(1 for s in pol["slots"] if records.payload_running(pol, s))
            extra, record = None, None
            if running == len(pol["slots"]):
                extra, dummy, record = _run_status(policy_path, name, ["true"], 1)
            g["busy"] = {"slots": len(pol["slots"]), "running": running, "all_ran": running == len(pol["slots"]),
                         "extra_rc": extra, "extra_record": record}
        finally:
            for s in pol["slots"]:
                path = os.path.join(argvmod.cell_paths(pol, s)["workspace"], go)
                with open(path, "w"):
                    pass
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for s in pol["slots"]:
                try:
                    os.unlink(os.path.join(argvmod.cell_paths(pol, s)["workspace"], go))
                except OSError:
                    pass
    # TEN-07: a payload that plays a busy launcher
    rc, out, record = _run_status(policy_path, name, ["python3", "-I", "-c", FORGE, STATUS_FD], opts["timeout"])
    g["forged"] = {"rc": rc, "write": (out.split() or ["no output"])[-1], "record": record,
                   "warm": name in pol.get("warm_slots", [])}
    # LIFE-04: SIGKILL a launcher whose cell runs; the slot is claimable again
    proc = subprocess.Popen(_chv_cell(policy_path, "run", "--slot", name, "--timeout", str(opts["timeout"]), "--",
                                      "sleep", "300"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = _wait(lambda: records.payload_running(pol, slot_a) or proc.poll() is not None, opts["timeout"] + 30) and \
        proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    g["sigkill"] = {"started": started, "after_rc": _run_cell(policy_path, name, ["true"], 30)[0]}


def _left_behind(pol: policymod.Policy, slots: Iterable[policymod.Slot]) -> List[str]:
    """What of the slots' cells is still there.  A slot whose warm cell waits
    for a payload holds that fresh cell's record, veth and machine, not a
    leftover (a warm cell listens only before its one payload)."""
    left: List[str] = []
    for s in slots:
        if records.warm_waiting(pol, s):
            continue
        if _record_exists(pol, s):
            left.append("record of %s" % s["name"])
        if os.path.exists("/sys/class/net/%s" % s["host_ifname"]):
            left.append("interface %s" % s["host_ifname"])
        if os.path.exists("/run/systemd/machines/%s" % s["machine"]):
            left.append("machine %s" % s["machine"])
    return left


def choose_slots(names: Sequence[str], busy: Sequence[str], slot: Optional[str] = None,
                 reserved: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """Cells A and B's slots (pure): ``slot`` (--slot) or the first free
    one for A, another free one for B (None when there is none).  Free: no
    cell in ``busy`` runs there; the health gate's ``reserved`` slot is
    taken last.  A guest with no free slot gets the policy's first slots
    (their runs then wait --timeout and report busy)."""
    order = [n for n in names if n != reserved] + [n for n in names if n == reserved]
    free = [n for n in order if n not in busy]
    a = slot if slot else (free[0] if free else order[0])
    others = [n for n in (free if free else order) if n != a]
    return a, (others[0] if others else None)


def run(policy_path: str, opts: Facts) -> Facts:
    """The whole catalog on this guest; returns the report."""
    pol = policymod.load(policy_path)
    slots = pol["slots"]
    busy = [s["name"] for s in slots if records.payload_running(pol, s)]
    name_a, name_b = choose_slots([s["name"] for s in slots], busy, opts.get("slot"), pol.get("health_slot"))
    slot_a = policymod.slot_by_name(pol, name_a)
    slot_b = policymod.slot_by_name(pol, name_b) if name_b else None
    facts: Facts
    facts = {"nonce": os.urandom(4).hex(), "guest": {}, "policy": pol, "slot_a": slot_a, "slot_b": slot_b,
             "broker_client": opts["broker_client"] or ""}
    fix = Fixtures()
    kept: List[str] = []
    # --case: cell A runs the sections of its probes that the named cases
    # read (one run gathers them all), the lifecycle runs only for a case of
    # its own; the cases named are judged and reported
    cases = list(opts.get("cases") or [])
    probes = sorted(set(p for cid in cases for p in BY_ID[cid].probes)) if cases else None
    try:
        _cell_probes(pol, policy_path, slot_a, slot_b, dict(opts, probes=probes), fix, facts)
    finally:
        # --keep: the fixtures the cells read and wrote stay for inspection
        # (their paths in the report's header); the audit's processes end
        kept = fix.cleanup(keep_files=bool(opts.get("keep")))
    lifecycle = bool(opts.get("lifecycle", True)) and (not cases or bool(set(cases) & set(LIFECYCLE_CASES)))
    if facts.get("a") is not None and lifecycle:
        _lifecycle(pol, policy_path, slot_a, opts, facts)
    facts["guest"]["lifecycle"] = lifecycle
    audited = [slot_a] + ([slot_b] if slot_b else [])
    _wait(lambda: not _left_behind(pol, audited), 10)
    facts["guest"]["left_behind"] = _left_behind(pol, audited)
    results = judge(facts, cases or None)
    head = header(policy_path, opts.get("labels", {}))
    head["egress_mode"] = egress_mode(pol)
    if opts.get("keep"):
        head["kept"] = " ".join(kept)
    return report(results, head, opts.get("strict_skips", False), cases or None, head["egress_mode"])
