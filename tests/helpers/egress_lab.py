"""Network-namespace lab of the egress proxy (proxy mode, docs/network.md
"Egress by name"): cellnat_lab's guest, outside and two cells, named
te-<pid>-*, with dnsmasq as the resolver stand-in on the outside network,
listeners that log every connection before they read a byte, and the real
squid with the role's rendered configuration, run in the guest as a door's
UID. Used by tests/integration/netns/test_egress_proxy_netns.py and
bench/bench_egress.py; every address lives only inside the namespaces.

    allowed.test, sub.wild.test, wild.test, group.test -> 198.20.1.1 (public space)
    denied.test                      -> 198.20.2.1 (public space, no entry lists it)
    private.test                     -> 10.77.1.1  (private use, 10/8)
    metadata.test                    -> 169.254.169.254 (link-local)
    guest.test                       -> 127.0.0.1 (the guest's loopback)
    git.test                         -> 198.20.3.1 (a static HTTP server of a bare git repository)
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cellnat_lab
from cellnat_lab import Lab, run
from egress_render import render_proxy
from testpaths import PROBES

from chv_guest.broker import peer
from chv_guest.cell import argv as argvmod
from chv_guest.cell import egresslog
from ansible_collections.chv.fleet.plugins.module_utils import egress_names

PROBE = Path(PROBES) / "egress_probe.py"
RESOLVER = "198.20.0.1"          # dnsmasq, on the outside network
SQUID = shutil.which("squid", path="/usr/sbin:/sbin:" + os.environ.get("PATH", "")) or "squid"
SQUID_UID = 4242                 # the proxy's user (door_uids by the drop-in, as the role writes it)
PORT = 3128
NAMES = {"allowed.test": "198.20.1.1", "wild.test": "198.20.1.1", "group.test": "198.20.1.1",
         "denied.test": "198.20.2.1", "private.test": "10.77.1.1", "metadata.test": "169.254.169.254",
         "guest.test": "127.0.0.1", "git.test": "198.20.3.1"}
GIT_ADDR = "198.20.3.1"
# every entry the ruleset and squid get (the names a cell may ask for)
ENTRIES = ["allowed.test", {"name": "allowed.test", "port": 80}, "*.wild.test", "private.test", "metadata.test",
           "guest.test", {"name": "group.test", "slot_group": "second"}, {"name": "git.test", "port": 80}]


@contextlib.contextmanager
def running_lab(door_drop_ins=None):
    """A ProxyLab up, its proxy-mode ruleset applied (with ``door_drop_ins``: {file name: nft text} in its
    door drop-in directory first, as a role writes one) and squid started; down afterwards."""
    lab = ProxyLab()
    try:
        lab.up()
        for name, text in (door_drop_ins or {}).items():
            (lab.door_dir / name).write_text(text)
        lab.apply_proxy()
        lab.start_squid()
        yield lab
    finally:
        lab.down()


def lab_available():
    """None when the lab can run here, else the reason to skip."""
    reason = cellnat_lab.lab_available()
    if reason:
        return reason
    for tool in ("squid", "dnsmasq", "setpriv", "curl"):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return "%s is not installed (make sysdeps installs it)" % tool
    return None



class ProxyLab(Lab):
    """cellnat_lab's guest, outside and two cells, named te-<pid>-*, with the
    resolver stand-in, recording listeners and squid."""

    def __init__(self):
        super().__init__()
        prefix = "te-%d-" % os.getpid()
        self.guest, self.outside = prefix + "guest", prefix + "out"
        self.cell_a, self.cell_b = prefix + "cella", prefix + "cellb"
        self.namespaces = [self.guest, self.outside, self.cell_a, self.cell_b]
        # squid, as SQUID_UID, reads its configuration here (pytest's tmp_path is root's only)
        self.work = Path(tempfile.mkdtemp(prefix="te-egress-"))
        self.work.chmod(0o755)
        self.door_dir = self.work / "door.d"
        self.targets_log = self.work / "targets.log"
        self.dns_log = self.work / "dnsmasq.log"
        self.squid_dir = self.work / "squid"
        self.git_dir = self.work / "git"        # what git.test serves: repo.git, a bare repository
        self.squid = None
        self.data = self.proxy = None

    def up(self):
        super().up()
        run("ip", "addr", "add", "10.77.1.1/32", "dev", "lo", ns=self.outside)
        self.targets_log.write_text("")
        self.spawn(self.outside, sys.executable, PROBE, "target", self.targets_log,
                   *["%s:%d" % (addr, port) for addr in ("198.20.1.1", "198.20.2.1", "10.77.1.1", "169.254.169.254")
                     for port in (443, 80)])
        self.spawn(self.guest, sys.executable, PROBE, "target", self.targets_log, "127.0.0.1:443")
        self._bare_repository(self.git_dir / "repo.git")
        self.spawn(self.outside, sys.executable, PROBE, "files", self.targets_log, GIT_ADDR + ":80", self.git_dir)
        dnsmasq = shutil.which("dnsmasq", path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
        argv = [dnsmasq, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                "--bind-interfaces", "--listen-address=" + RESOLVER, "--user=root", "--pid-file=",
                "--log-queries", "--log-facility=%s" % self.dns_log]
        argv += ["--address=/%s/%s" % (name, addr) for name, addr in NAMES.items()]
        self.spawn(self.outside, *argv, ready=None)
        self.door_dir.mkdir()
        (self.door_dir / "chv-egress-proxy.nft").write_text(
            "add element inet chv_cell door_uids { %d }\nadd element inet chv_cell proxy_uids { %d }\n" % (SQUID_UID, SQUID_UID))
        self.squid_dir.mkdir()
        os.chown(self.squid_dir, SQUID_UID, SQUID_UID)
        return self

    @staticmethod
    def _bare_repository(path):
        """A bare repository with one commit on main, ready for git's dumb HTTP protocol."""
        env = dict(os.environ, GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1",
                   GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
        src = path.parent / "src"
        for argv in (["git", "init", "-q", "-b", "main", str(src)],
                     ["git", "-C", str(src), "commit", "-q", "--allow-empty", "-m", "one"],
                     ["git", "clone", "-q", "--bare", str(src), str(path)],
                     ["git", "-C", str(path), "update-server-info"]):
            subprocess.run(argv, env=env, check=True, capture_output=True)

    def spawn(self, ns, *argv, ready="READY"):
        proc = subprocess.Popen(["ip", "netns", "exec", ns] + [str(a) for a in argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if ready:
            line = proc.stdout.readline().strip()
            if line != ready:
                proc.kill()
                raise AssertionError("%s in %s did not start: %s %s" % (argv[0], ns, line, proc.stderr.read()))
        self.servers.append(proc)
        return proc

    def plan_proxy(self, **params):
        params.setdefault("slots", self.slots)
        params.setdefault("egress_mode", "proxy")
        params.setdefault("dns_resolvers", [RESOLVER])
        params.setdefault("door_dir", str(self.door_dir))
        params.setdefault("slot_groups", {"second": ["slot1"]})
        params.setdefault("egress_names", {"": ENTRIES})
        route = run("ip", "-j", "-4", "route", "show", "default", ns=self.guest).stdout
        interfaces = set(run("ls", "/sys/class/net", ns=self.guest).stdout.split())
        return egress_names.plan(params, interfaces, route)

    def apply_proxy(self, **params):
        self.data, self.proxy = self.plan_proxy(**params)
        self.load_text(cellnat_lab.render(self.data))
        return self.data, self.proxy

    def _write_conf(self, proxy):
        """The rendered configuration, where squid (as SQUID_UID) reads it; its path."""
        conf = self.work / "squid.conf"
        conf.write_text(render_proxy(proxy, log=str(self.squid_dir / "access.log"),
                                     pid=str(self.squid_dir / "squid.pid"),
                                     cache_log=str(self.squid_dir / "cache.log")))
        run(SQUID, "-k", "parse", "-f", conf)
        return conf

    def _as_squid(self, *argv):
        """squid's command line as SQUID_UID in the guest."""
        return ["ip", "netns", "exec", self.guest, "setpriv", "--reuid=%d" % SQUID_UID, "--regid=%d" % SQUID_UID,
                "--clear-groups", SQUID] + [str(a) for a in argv]

    def _wait_accepting(self, count):
        """Until cache.log says squid accepts connections for the count-th time (False: it exited first)."""
        cache_log = self.squid_dir / "cache.log"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if cache_log.exists() and cache_log.read_text().count("Accepting HTTP Socket connections") >= count:
                return True
            if self.squid.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def start_squid(self, proxy=None):
        """squid -N with the rendered configuration, as SQUID_UID in the guest."""
        self.stop_squid()
        for name in ("access.log", "cache.log"):
            (self.squid_dir / name).unlink(missing_ok=True)
        conf = self._write_conf(proxy or self.proxy)
        self.squid = subprocess.Popen(self._as_squid("-N", "-f", conf), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        if not self._wait_accepting(1):
            cache_log = self.squid_dir / "cache.log"
            out = self.squid.stdout.read() if self.squid.poll() is not None else ""
            raise AssertionError("squid did not start: %s %s" % (out, cache_log.read_text() if cache_log.exists()
                                                                   else ""))

    def reconfigure_squid(self, proxy):
        """squid -k reconfigure (the unit's ExecReload) with a new rendering of the configuration."""
        before = (self.squid_dir / "cache.log").read_text().count("Accepting HTTP Socket connections")
        run(*self._as_squid("-k", "reconfigure", "-f", self._write_conf(proxy)))
        if not self._wait_accepting(before + 1):
            raise AssertionError("squid did not reconfigure: %s" % (self.squid_dir / "cache.log").read_text())

    def stop_squid(self):
        if self.squid is not None:
            self.squid.terminate()
            try:
                self.squid.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.squid.kill()
                self.squid.wait()
            self.squid = None

    def down(self):
        self.stop_squid()
        super().down()
        shutil.rmtree(self.work, True)

    # ------------------------------------------------------------ traffic
    def connect(self, cell, host, port=443):
        gateway = self.slots[[self.cell_a, self.cell_b].index(cell)]["gateway"]
        proc = run(sys.executable, PROBE, "connect", gateway, PORT, host, port, ns=cell)
        return json.loads(proc.stdout)

    def get(self, cell, url):
        gateway = self.slots[[self.cell_a, self.cell_b].index(cell)]["gateway"]
        return json.loads(run(sys.executable, PROBE, "get", gateway, PORT, url, ns=cell).stdout)

    def door_url(self, index):
        """The proxy URL of slot ``index`` as the launcher writes it into the cell's record
        (argv.proxy_url), read back as chv-broker reads records (peer.load_cells): what the
        doors acting for the slot get (Broker.op_sync's spec, op_browser's "proxy")."""
        slot = self.slots[index]
        cells = self.work / "cells"
        cells.mkdir(exist_ok=True)
        url = argvmod.proxy_url({"egress_proxy": {"port": PORT}}, slot)
        (cells / ("%s.json" % slot["name"])).write_text(json.dumps(
            {"slot": slot["name"], "pid": os.getpid(), "uid_base": slot["uid_base"], "uid_size": slot["uid_size"],
             "egress_proxy": url}))
        (cell,) = [c for c in peer.load_cells(str(cells)) if c["slot"] == slot["name"]]
        return cell["egress_proxy"]

    def reached(self, addr_port):
        """The connections the listener ADDR:PORT logged."""
        return [line for line in self.targets_log.read_text().splitlines() if line.split()[0] == addr_port]

    def queried(self, name):
        text = self.dns_log.read_text() if self.dns_log.exists() else ""
        return [line for line in text.splitlines() if "query[" in line and " %s from " % name in line]

    def log_lines(self):
        path = self.squid_dir / "access.log"
        text = path.read_text() if path.exists() else ""
        return [egresslog.parse_line(line) for line in text.splitlines() if line.strip()]
