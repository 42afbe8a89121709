#!/usr/bin/python3 -I
"""chv-broker's sync worker: runs as the workspace owner, never as root.

chv-broker starts this file as the unprivileged identity the sync runs as
(in a transient systemd service via setpriv, or as its own child with
``user=``/``group=``), with one JSON argument (the spec) and the credentials
on stdin.  Everything that
touches the cell-writable workspace happens here, with that identity's
permissions only:

1. resolve the requested repository (symlinks followed, strictly) and refuse
   anything outside the slot's workspace (../, absolute paths elsewhere,
   symlinks that leave it);
2. chdir into it, so the directory is pinned against later symlink swaps;
3. for git: refuse repositories whose git dir lies outside the workspace and
   repositories whose local config holds any key outside a short allow-list
   (filter/merge/diff drivers, hooks paths, ssh commands, url rewrites,
   includes... would run code or redirect credentials), then run git with
   hooks, fsmonitor, pager and every protocol but the allowed ones disabled,
   no system or global config, and the credential helper of chv-broker only;
4. with a host allow-list (``hosts`` in the spec, the role's
   chv_broker_sync_hosts): work out, from the configuration just read, the
   remote(s) the git command would contact and refuse the sync unless every
   one of their URLs names an allowed host (see ``check_remote``);
5. exec the configured argument vector (never a shell).

A rejection is one JSON line on stdout and exit status REJECT_STATUS.
Standard library only; importable for unit tests.
"""
import ipaddress
import json
import os
import re
import subprocess
import sys

REJECT_STATUS = 120

GIT_CONFIG_ALLOWED = [re.compile(p) for p in (
    r"core\.(repositoryformatversion|filemode|bare|logallrefupdates|ignorecase"
    r"|precomposeunicode|symlinks|autocrlf|eol|safecrlf|quotepath|compression)",
    r"remote\..+\.(url|pushurl|fetch|push|tagopt|prune|mirror)",
    r"branch\..+\.(remote|merge|rebase|pushremote)",
    r"user\.(name|email)",
    r"pull\.(rebase|ff)",
    r"push\.(default|autosetupremote)",
    r"fetch\.prune",
    r"init\.defaultbranch",
    r"merge\.ff",
    r"extensions\.objectformat",
    r"(advice|color)\.[a-z0-9.-]+",
)]


class Rejected(Exception):
    pass


# ------------------------------------------------------------------ host allow-list
HOSTS_VAR = "chv_broker_sync_hosts"
# URL schemes git handles itself (or through git-remote-http[s]) and the protocol each one is
URL_SCHEMES = {"https": "https", "http": "http", "ssh": "ssh", "git+ssh": "ssh", "ssh+git": "ssh", "git": "git"}
DEFAULT_PORTS = {"https": 443, "http": 80, "ssh": 22, "git": 9418}
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_][A-Za-z0-9_-]*)*\.?")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_ENTRY_PORT_RE = re.compile(r"[1-9][0-9]{0,4}")
_URL_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.S)       # git's is_url()
_HELPER_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*::")                  # <transport>::<address>
_SCP_RE = re.compile(r"(?:([^@\[\]/:]*)@)?(\[[^\]/]*\]|[^\[\]@/:]*):(.*)", re.S)


def _host(text):
    """Normalised host: lower-case name without its trailing dot, or "[<compressed IPv6>]"."""
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        if "%" in inner:  # zone ids: refused, like everything ambiguous
            raise ValueError("IPv6 zone ids are not supported")
        try:
            return "[%s]" % ipaddress.IPv6Address(inner).compressed
        except ValueError:
            raise ValueError("not an IPv6 address") from None
    if not _NAME_RE.fullmatch(text):
        raise ValueError("not a host name or IP address")
    return text.lower().rstrip(".")


def _port(text, strict=False):
    if not (_ENTRY_PORT_RE if strict else _PORT_RE).fullmatch(text) or not 0 < int(text) < 65536:
        raise ValueError("not a port number")
    return int(text)


def parse_host_entry(entry):
    """One chv_broker_sync_hosts entry -> (host, port or None). Raises ValueError.

    ``host``, ``host:port``, ``1.2.3.4``, ``1.2.3.4:22``, ``2001:db8::1``,
    ``[2001:db8::1]`` and ``[2001:db8::1]:22``.
    """
    if not isinstance(entry, str):
        raise ValueError("not a string")
    m = re.fullmatch(r"(\[[^\]]*\])(?::([^:]*))?", entry)
    if m:
        return _host(m.group(1)), (_port(m.group(2), True) if m.group(2) is not None else None)
    if entry.count(":") >= 2:
        return _host("[%s]" % entry), None
    host, sep, port = entry.partition(":")
    return _host(host), (_port(port, True) if sep else None)


def parse_remote_url(url):
    """A remote URL as git reads it -> (protocol, host, port, display).

    ``display`` is the URL without user name, password, query or fragment.
    Raises ValueError (message says why) for local paths, file:// URLs,
    remote-helper syntax and everything not clearly one host.
    """
    if not isinstance(url, str) or not url or any(ord(c) < 33 or c in "\\\x7f" for c in url):
        raise ValueError("unparseable (empty, blanks, control characters or backslashes)")
    if _HELPER_RE.match(url):
        raise ValueError("remote helper (<transport>::<address>) URLs are not supported")
    m = _URL_RE.fullmatch(url)
    if m:
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme == "file":
            raise ValueError("file:// URLs (local repositories) are refused")
        if scheme not in URL_SCHEMES:
            raise ValueError("URL scheme %s:// is not supported" % scheme)
        authority, slash, path = rest.partition("/")
        # git decodes %XX in ssh:// and git:// URLs before it splits them (curl differs):
        # anything that could be read two ways is refused
        if authority.count("@") > 1 or any(c in authority for c in "?#%"):
            raise ValueError("unparseable authority")
        hostport = authority.rpartition("@")[2]
        hm = re.fullmatch(r"(\[[^\]]*\]|[^\[\]:]*)(?::([^:]*))?", hostport)
        if not hm:
            raise ValueError("unparseable host")
        host = _host(hm.group(1))
        port = _port(hm.group(2)) if hm.group(2) else None  # "host:" means the default port
        proto = URL_SCHEMES[scheme]
        display = "%s://%s%s%s%s" % (scheme, hm.group(1), ":%d" % port if port else "", slash,
                                     re.split(r"[?#]", path, maxsplit=1)[0])
        return proto, host, port or DEFAULT_PORTS[proto], display
    colon, slash = url.find(":"), url.find("/")
    if colon < 0 or 0 <= slash < colon:  # git's url_is_local_not_ssh()
        raise ValueError("local paths are refused")
    m = _SCP_RE.fullmatch(url)  # scp-like [user@]host:path, git runs ssh
    if not m:
        raise ValueError("unparseable scp-like address")
    host = _host(m.group(2))
    return "ssh", host, DEFAULT_PORTS["ssh"], "%s:%s" % (m.group(2), re.split(r"[?#]", m.group(3), maxsplit=1)[0])


def redact(url):
    """``url`` for messages: no user name, password, query or fragment, printable, bounded."""
    url = str(url)
    m = _URL_RE.match(url)
    prefix, rest = (m.group(1) + "://", m.group(2)) if m else ("", url)
    rest = rest.rpartition("@")[2]
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    out = "".join(c if c.isprintable() and c != "\\" else "?" for c in prefix + rest)
    return out if len(out) <= 200 else out[:197] + "..."


def check_remote(remote, url, hosts):
    """Refuse (Rejected) unless ``url`` of ``remote`` names a host:port in ``hosts``.

    ``remote`` is the remote's name (None when the name *is* the URL);
    ``hosts`` the chv_broker_sync_hosts entries. Host names compare
    case-insensitively and without a trailing dot, IPv6 addresses by value;
    an entry without a port allows every port. Messages never hold the URL's
    credentials.
    """
    label = ("remote %r (%s)" % (remote, redact(url))) if remote is not None else ("remote %s" % redact(url))
    try:
        _proto, host, port, display = parse_remote_url(url)
    except ValueError as exc:
        raise Rejected("%s: %s while %s is set" % (label, exc, HOSTS_VAR)) from None
    if remote is not None:
        label = "remote %r (%s)" % (remote, redact(display))
    else:
        label = "remote %s" % redact(display)
    for entry in hosts:
        ehost, eport = parse_host_entry(entry)
        if ehost == host and eport in (None, port):
            return
    raise Rejected("%s: host %s port %d is not in %s" % (label, host, port, HOSTS_VAR))


# git subcommands that never contact a remote (in a repository the config allow-list
# accepted: no aliases, no partial clones, no promisor remotes)
LOCAL_GIT_COMMANDS = frozenset((
    "status", "log", "diff", "show", "rev-parse", "describe", "ls-files", "ls-tree", "cat-file",
    "branch", "tag", "shortlog", "rev-list", "merge-base", "for-each-ref", "show-ref", "symbolic-ref",
    "blame", "grep", "reflog", "count-objects", "diff-index", "diff-files", "diff-tree", "commit",
    "add", "rm", "mv", "merge", "rebase", "reset", "checkout", "switch", "restore", "stash", "version",
    "gc", "fsck",
))
REMOTE_GIT_COMMANDS = frozenset(("fetch", "pull", "push", "ls-remote"))
_GIT_GLOBAL_VALUE_OPTS = frozenset(("-c", "--config-env", "--exec-path", "--namespace", "--list-cmds"))
_GIT_REPO_OPTS = ("-C", "--git-dir", "--work-tree", "--super-prefix")
_VALUE_OPTS = frozenset((
    "--depth", "--deepen", "--shallow-since", "--shallow-exclude", "--upload-pack", "--receive-pack",
    "--exec", "--refmap", "--server-option", "--push-option", "--jobs", "--negotiation-tip",
    "--strategy", "--strategy-option", "--filter", "--repo", "-o", "-j", "-s", "-X",
))


def config_key(name):
    """git's canonical key: section and variable lower-case, subsection as written."""
    section, rest = name.partition(".")[::2]
    sub, var = rest.rpartition(".")[::2]
    return "%s.%s%s" % (section.lower(), sub + "." if sub else "", var.lower())


def _valid_nick(name):  # git's valid_remote_nick()
    return bool(name) and name not in (".", "..") and "/" not in name


def sync_remotes(argv, config, branch):
    """The remotes a git argument vector would contact: [(name or None, [url, ...]), ...].

    Pure: ``config`` is the repository's (key, value) list in file order (what
    ``git config --local --list`` printed), ``branch`` the checked-out branch
    or None. Mirrors git's choice of remote (an explicit argument, then
    branch.<b>.pushRemote / remote.pushDefault for push, branch.<b>.remote,
    then origin, or the only remote); url values (pushurl for push when it
    has one) are all checked. Raises Rejected when it cannot tell.
    """
    if not argv or os.path.basename(argv[0]) != "git":
        raise Rejected("the sync command is not git, so its remote cannot be checked against " + HOSTS_VAR)
    config = [(config_key(k), v) for k, v in config]
    args, i, sub = list(argv[1:]), 0, None
    while i < len(args):  # git's global options
        a = args[i]
        if a in _GIT_REPO_OPTS or any(a.startswith(o + "=") for o in _GIT_REPO_OPTS[1:]):
            raise Rejected("git %s in the sync command: its remote cannot be checked against %s" % (a, HOSTS_VAR))
        if a == "-c" and i + 1 < len(args):
            key, value = args[i + 1].partition("=")[::2]
            config.append((config_key(key), value))
        if a in _GIT_GLOBAL_VALUE_OPTS:
            i += 2
            continue
        if not a.startswith("-"):
            sub = a
            break
        i += 1
    rest = args[i + 1:]
    if sub in LOCAL_GIT_COMMANDS:
        return []
    if sub not in REMOTE_GIT_COMMANDS:
        raise Rejected("cannot tell which remote 'git %s' contacts while %s is set" % (sub, HOSTS_VAR))

    positional, fetch_all, multiple, repo_opt, j = [], False, False, None, 0
    while j < len(rest):
        a = rest[j]
        if a == "--":
            positional += rest[j + 1:]
            break
        if a.startswith("--recurse-submodules") and a not in (
                "--recurse-submodules=no", "--recurse-submodules=false", "--recurse-submodules=off"):
            raise Rejected("%s in the sync command: submodule remotes are not checked against %s"
                           % (a, HOSTS_VAR))
        if a in _VALUE_OPTS:
            if a == "--repo" and j + 1 < len(rest):
                repo_opt = rest[j + 1]
            j += 2
            continue
        if a.startswith("--repo="):
            repo_opt = a[len("--repo="):]
        elif a == "--all" and sub in ("fetch", "pull"):
            fetch_all = True
        elif a == "--multiple" and sub == "fetch":
            multiple = True
        elif not a.startswith("-") or a == "-":
            positional.append(a)
        j += 1

    def values(key):
        return [v for k, v in config if k == key]

    def last(key):
        found = values(key)
        return found[-1] if found else None

    push = sub == "push"
    if fetch_all:
        names = []
        for k, _v in config:
            if k.startswith("remote.") and k.count(".") >= 2:
                name = k[len("remote."):k.rindex(".")]
                if name not in names:
                    names.append(name)
        if not names:
            return []  # git fetch --all with no remote fetches nothing
    elif positional and multiple:
        names = positional
    elif positional:
        names = positional[:1]
    elif push and repo_opt:
        names = [repo_opt]
    else:
        names = None
        if branch is not None and push:
            names = [last("branch.%s.pushremote" % branch) or last("remote.pushdefault")]
        elif push:
            names = [last("remote.pushdefault")]
        if not names or names[0] is None:
            names = [last("branch.%s.remote" % branch)] if branch is not None else [None]
        if names[0] is None:  # not explicit: origin, or (newer git) the only remote
            remotes = {k[len("remote."):k.rindex(".")] for k, _v in config
                       if k.startswith("remote.") and k.count(".") >= 2}
            names = ["origin"] + sorted(remotes - {"origin"} if len(remotes) == 1 else ())
    out = []
    for name in names:
        urls = values("remote.%s.url" % name)
        if push and values("remote.%s.pushurl" % name):
            urls = values("remote.%s.pushurl" % name)
        if urls:
            out.append((name, urls))
        elif _valid_nick(name):
            raise Rejected("remote %r has no url in the repository config (chv-broker reads no .git/remotes "
                           "or .git/branches files) while %s is set" % (redact(name), HOSTS_VAR))
        else:
            out.append((None, [name]))  # git uses the name itself as the URL
    return out


def confine(workspace, repo):
    """Resolve ``repo`` (relative to ``workspace`` or absolute) strictly; it must stay inside.

    Returns the resolved absolute path of an existing directory.
    """
    if not isinstance(repo, str) or not repo or "\0" in repo or len(repo) > 4096:
        raise Rejected("repo must be a non-empty path string")
    try:
        ws_real = os.path.realpath(workspace, strict=True)
    except OSError:
        raise Rejected("slot workspace does not exist") from None
    candidate = os.path.join(ws_real, repo)  # an absolute repo replaces ws_real
    try:
        real = os.path.realpath(candidate, strict=True)
    except OSError:
        raise Rejected("repo does not exist or cannot be resolved") from None
    if os.path.commonpath([ws_real, real]) != ws_real:
        raise Rejected("repo resolves outside the slot's workspace")
    if not os.path.isdir(real):
        raise Rejected("repo is not a directory")
    return real


def inside(root, path):
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def disallowed_git_keys(names):
    """Config keys (lower-case names as git prints them) that are not on the allow-list."""
    return sorted({n for n in names if not any(p.fullmatch(n) for p in GIT_CONFIG_ALLOWED)})


def git_env(base_env, ws_real):
    env = {k: v for k, v in base_env.items() if k in ("PATH", "LANG", "LC_ALL", "TZ", "CHV_BROKER_CRED_FD")}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update({
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
        "SSH_ASKPASS": "/bin/false",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes",
        "GIT_CEILING_DIRECTORIES": os.path.dirname(ws_real),
        "GIT_OPTIONAL_LOCKS": "0",
    })
    return env


def git_prefix(protocols, credential_helper, hosts=()):
    argv = ["git",
            "-c", "core.hooksPath=/dev/null",
            "-c", "core.fsmonitor=false",
            "-c", "core.pager=cat",
            "-c", "credential.helper=",
            "-c", "protocol.allow=never"]
    for proto in protocols:
        argv += ["-c", "protocol.%s.allow=always" % proto]
    if credential_helper:
        argv += ["-c", "credential.helper=" + credential_helper]
    if hosts:  # submodules' remotes come from files the host check does not read
        argv += ["-c", "submodule.recurse=false", "-c", "fetch.recurseSubmodules=false",
                 "-c", "push.recurseSubmodules=no"]
    return argv


def _git_out(prefix, env, *args):
    proc = subprocess.run(prefix + list(args), env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)
    if proc.returncode != 0:
        raise Rejected("git refused the repository: " + proc.stderr.decode("utf-8", "replace").strip()[:200])
    return proc.stdout


def parse_config_list(data):
    """``git config --list --null`` output -> [(name, value)] in file order (a bare key has value None)."""
    out = []
    for item in data.split(b"\0"):
        if item:
            name, nl, value = item.decode("utf-8", "surrogateescape").partition("\n")
            out.append((name, value if nl else None))
    return out


def current_branch(prefix, env):
    """The checked-out branch (also unborn), or None when HEAD is detached."""
    proc = subprocess.run(prefix + ["symbolic-ref", "--quiet", "HEAD"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)
    if proc.returncode == 1:
        return None
    if proc.returncode != 0:
        raise Rejected("git refused the repository: " + proc.stderr.decode("utf-8", "replace").strip()[:200])
    ref = proc.stdout.decode("utf-8", "surrogateescape").strip()
    return ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else None


def prepare(spec, environ):
    """Everything but the exec: returns (argv, env).  Raises Rejected."""
    ws_real = os.path.realpath(spec["workspace"])
    real = confine(spec["workspace"], spec["repo"])
    os.chdir(real)
    if not inside(ws_real, os.getcwd()):  # the pinned cwd is what the command sees
        raise Rejected("repo resolves outside the slot's workspace")
    argv = list(spec["argv"])
    env = dict(environ)
    hosts = list(spec.get("hosts") or ())
    if os.path.basename(argv[0]) == "git":
        env = git_env(environ, ws_real)
        prefix = git_prefix(spec.get("protocols", ["https"]), spec.get("credential_helper") or "", hosts)
        # config first: any other git command would already honour include.path & co.
        config = parse_config_list(_git_out(prefix, env, "config", "--local", "--no-includes", "--list", "--null"))
        bad = disallowed_git_keys(n.lower() for n, _v in config)
        if bad:
            raise Rejected("repository config keys not allowed by chv-broker: " + ", ".join(bad[:10]))
        dirs = _git_out(prefix, env, "rev-parse", "--absolute-git-dir", "--git-common-dir")
        for d in dirs.decode("utf-8", "replace").splitlines():
            if not inside(ws_real, d):
                raise Rejected("the repository's git directory lies outside the slot's workspace")
        if hosts:
            for name, urls in sync_remotes(argv, [(k, v or "") for k, v in config], current_branch(prefix, env)):
                for url in urls:
                    check_remote(name, url, hosts)
        argv = prefix + argv[1:]
    elif hosts:
        sync_remotes(argv, [], None)  # refuses: not git
    return argv, env


def credentials_fd(stream):
    """chv-broker writes the credential file's content to our stdin; keep it
    in an unnamed memfd that git's credential helper inherits (CHV_BROKER_CRED_FD)."""
    data = stream.read(1 << 20)
    if not data:
        return None
    fd = os.memfd_create("chv-broker-credentials", 0)
    os.write(fd, data)
    os.set_inheritable(fd, True)
    return fd


def main(args):
    spec = json.loads(args[0])
    fd = credentials_fd(sys.stdin.buffer)
    if fd is not None:
        os.environ["CHV_BROKER_CRED_FD"] = str(fd)
    try:
        argv, env = prepare(spec, os.environ)
    except Rejected as exc:
        sys.stdout.write(json.dumps({"rejected": str(exc)}) + "\n")
        sys.stdout.flush()
        return REJECT_STATUS
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
