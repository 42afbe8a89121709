"""A real git server for the tests: smart HTTP (``git http-backend`` as a
CGI of Debian's lighttpd) with basic authentication, in a network
namespace of its own, reached from this machine over a veth pair, or
(``address``) on an address this machine already has, in its own network
namespace: Molecule's executor tests bind it to a lab guest's gateway on
the lab host (molecule/shared/tests/test_executor_tasks.py).

Names (prefix ``tt``, this suite's own): the namespace ``tt<pid>``, the
host's end of the veth ``ttg<pid % 10**6>``.  Addresses: a /30 of
10.232.77.0/24 (the server at .2).  Every push and fetch needs the user and
password; without them lighttpd answers 401."""

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

LIGHTTPD = "/usr/sbin/lighttpd"
MODEL_PORT = 8090  # the stand-in model endpoint (tests/probes/model_standin.py)
BACKEND = "/usr/lib/git-core/git-http-backend"
PORT = 8080
HOST_ADDR, SERVER_ADDR = "10.232.77.1", "10.232.77.2"

CONF = """
server.modules = ("mod_alias", "mod_auth", "mod_authn_file", "mod_cgi", "mod_setenv", "mod_accesslog")
server.document-root = "{root}/docroot"
server.bind = "{addr}"
server.port = {port}
server.errorlog = "{root}/logs/error.log"
accesslog.filename = "{root}/logs/access.log"
mimetype.assign = (".html" => "text/html")
server.username = "{user}"
server.groupname = "{user}"
auth.backend = "plain"
auth.backend.plain.userfile = "{root}/users"
auth.require = ("/git/" => ("method" => "basic", "realm" => "git", "require" => "valid-user"))
alias.url = ("/git" => "{backend}")
$HTTP["url"] =~ "^/git" {{
    cgi.assign = ("" => "")
    setenv.add-environment = ("GIT_PROJECT_ROOT" => "{root}/repos", "GIT_HTTP_EXPORT_ALL" => "")
}}
"""


def available():
    """Why the server cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "root is needed for network namespaces"
    for path, pkg in ((LIGHTTPD, "lighttpd"), (BACKEND, "git"), ("/usr/bin/ip", "iproute2")):
        if not os.path.exists(path):
            return "%s is missing (Debian package %s)" % (path, pkg)
    return None


def _run(*argv, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), r.stderr.strip()))
    return r


def git(cwd, *args, env=None):
    """git as root in the server's repositories (safe.directory), with an identity for commits."""
    return subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "safe.directory=*", "-c", "user.name=t",
                           "-c", "user.email=t@t", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          env=env).stdout


class GitServer:
    """``start()`` brings it up with one repository, ``proj.git`` (two
    commits on main: ``commits``), ``stop()`` removes everything again."""

    def __init__(self, user="executor", password=None, address=None, port=PORT, model_port=MODEL_PORT):
        n = os.getpid()
        # address: bound there, no namespace of its own
        self.ns = None if address else "tt%d" % n
        self.host_if = None if address else "ttg%d" % (n % 1000000)
        self.address = address or SERVER_ADDR
        self.port, self.model_port = port, model_port
        self.user = user
        self.password = password or base64.b32encode(os.urandom(15)).decode().lower()
        self.root = None
        self.proc = None
        self.model = None
        self.commits = []
        self.url = "http://%s:%d/git/proj.git" % (self.address, port)

    def start(self):
        self.root = tempfile.mkdtemp(prefix="chv-gitserver-")
        os.chmod(self.root, 0o755)
        try:
            self._repo()
            if self.ns:
                self._network()
            self._lighttpd()
        except BaseException:
            self.stop()
            raise
        return self

    def _repo(self):
        repos = os.path.join(self.root, "repos")
        os.makedirs(os.path.join(self.root, "docroot"))
        os.makedirs(os.path.join(self.root, "logs"))  # lighttpd opens its logs as www-data
        bare = os.path.join(repos, "proj.git")
        os.makedirs(bare)
        git(bare, "init", "-q", "--bare")
        git(bare, "config", "http.receivepack", "true")
        work = os.path.join(self.root, "seed")
        os.makedirs(work)
        git(work, "init", "-q")
        for i in (1, 2):
            with open(os.path.join(work, "README.md"), "a") as fh:
                fh.write("line %d of the project\n" % i)
            git(work, "add", "README.md")
            git(work, "commit", "-q", "-m", "commit %d" % i)
            self.commits.append(git(work, "rev-parse", "HEAD").strip())
        git(work, "push", "-q", bare, "main")
        shutil.rmtree(work)
        subprocess.run(["chown", "-R", "www-data:www-data", repos, os.path.join(self.root, "logs")], check=True)
        with open(os.path.join(self.root, "users"), "w") as fh:
            fh.write("%s:%s\n" % (self.user, self.password))
        os.chmod(os.path.join(self.root, "users"), 0o640)
        subprocess.run(["chgrp", "www-data", os.path.join(self.root, "users")], check=True)

    def _network(self):
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _run("ip", "addr", "add", HOST_ADDR + "/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "link", "set", "lo", "up", ns=self.ns)
        _run("ip", "addr", "add", SERVER_ADDR + "/30", "dev", "eth0", ns=self.ns)
        _run("ip", "link", "set", "eth0", "up", ns=self.ns)
        # replies to the cells' subnets (their traffic reaches the server through this machine)
        _run("ip", "route", "add", "default", "via", HOST_ADDR, ns=self.ns)

    def _lighttpd(self):
        conf = os.path.join(self.root, "lighttpd.conf")
        with open(conf, "w") as fh:
            fh.write(CONF.format(root=self.root, addr=self.address, port=self.port, user="www-data", backend=BACKEND))
        _run(LIGHTTPD, "-tt", "-f", conf)
        # another server on the address and port (one a killed test left) would answer for this one, with
        # its own account: refuse to start instead
        if not self.ns and self.status(auth=False) is not None:
            raise RuntimeError("%s:%d already answers (a server left running?)" % (self.address, self.port))
        log = open(os.path.join(self.root, "lighttpd.out"), "wb")
        self.proc = subprocess.Popen(self._in_ns(LIGHTTPD, "-D", "-f", conf),
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is None and self.status(auth=False) == 401:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("lighttpd did not come up: %s" % self.log())

    def _in_ns(self, *argv):
        return (["ip", "netns", "exec", self.ns] if self.ns else []) + list(argv)

    def start_model(self, token):
        """The stand-in model endpoint beside the server (its namespace or
        its address), accepting ``token`` (handed over on stdin); its URL."""
        from testpaths import PROBES

        log = os.path.join(self.root, "model.log")
        self.model = subprocess.Popen(self._in_ns("/usr/bin/python3", "-I", os.path.join(PROBES, "model_standin.py"),
                                                  self.address, str(self.model_port), log),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.model.stdin.write(token + "\n")
        self.model.stdin.close()
        if self.model.stdout.readline().strip() != "ready":
            raise RuntimeError("the model stand-in did not start")
        return "http://%s:%d/v1/edit" % (self.address, self.model_port)

    def model_requests(self):
        """What the model stand-in was asked: [{"path", "authorized"}, ...]."""
        try:
            with open(os.path.join(self.root, "model.log")) as fh:
                return [json.loads(line) for line in fh]
        except FileNotFoundError:
            return []

    def status(self, auth=True):
        """The HTTP status of the repository's upload-pack advertisement (None: no answer)."""
        req = urllib.request.Request(self.url + "/info/refs?service=git-upload-pack")
        if auth:
            req.add_header("Authorization", "Basic " + base64.b64encode(
                ("%s:%s" % (self.user, self.password)).encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=3) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def credential_line(self):
        """The git-credential-store line of the server's account (the guest's credential file)."""
        return "http://%s:%s@%s:%d\n" % (self.user, self.password, self.address, self.port)

    def ref(self, name):
        """The commit of ref ``name`` in the server's repository (read on disk), or None."""
        r = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "--verify", "--quiet", name],
                           cwd=os.path.join(self.root, "repos", "proj.git"), capture_output=True, text=True,
                           check=False)
        return r.stdout.strip() or None

    def show(self, spec):
        """``git show SPEC`` (e.g. ``branch:path``) in the server's repository."""
        return git(os.path.join(self.root, "repos", "proj.git"), "show", spec)

    def log(self):
        out = []
        for name in ("lighttpd.out", "logs/error.log"):
            try:
                with open(os.path.join(self.root, name)) as fh:
                    out.append(fh.read()[-2000:])
            except OSError:
                pass
        return "\n".join(out)

    def stop(self):
        if self.model is not None and self.model.poll() is None:
            self.model.kill()
            self.model.wait()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.ns:
            _run("ip", "link", "del", self.host_if, check=False)
            _run("ip", "netns", "del", self.ns, check=False)
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
