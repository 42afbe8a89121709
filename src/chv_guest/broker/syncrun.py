#!/usr/bin/python3 -I
"""chv-broker's sync worker: runs as the slot's own uid and gid, never as root.

chv-broker starts this file as the slot's identity (uid = gid = the slot's
uid_base, the cell's root; no supplementary groups) in a mount namespace
where the slot's workspace is the only slot directory there is: in a
transient systemd service (systemd-run with TemporaryFileSystem=,
BindPaths=, InaccessiblePaths=..., then setpriv), or as its own child,
started as root with ``--jail <json>``: the worker then makes the same
namespace itself (``jail_plan``/``enter_jail``: unshare(CLONE_NEWNS),
tmpfs and bind mounts) and drops to the slot's ids before it reads anything
of the workspace.  It gets one JSON argument (the spec) and the credentials
on stdin.  Everything that touches the cell-writable workspace happens
here, with that identity's permissions only:

1. resolve the requested repository (symlinks followed, strictly) and refuse
   anything outside the slot's workspace (../, absolute paths elsewhere,
   symlinks that leave it);
2. chdir into it, so the directory is pinned against later symlink swaps;
3. for git: refuse a repository whose ``.git`` is not a plain directory
   (a ``gitdir:`` file, a symbolic link), whose git directory holds a
   symbolic link, a special file, ``objects/info/alternates`` or a
   ``commondir`` file anywhere (``check_git_dir``: every path git would
   follow out of the repository), whose git dir lies outside the workspace,
   and repositories whose local config holds any key outside a short allow-list
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
from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import subprocess
import sys
from typing import Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Set, Tuple, TypedDict, Union, cast

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


def _host(text: str) -> str:
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


def _port(text: str, strict: bool = False) -> int:
    if not (_ENTRY_PORT_RE if strict else _PORT_RE).fullmatch(text) or not 0 < int(text) < 65536:
        raise ValueError("not a port number")
    return int(text)


def parse_host_entry(entry: object) -> Tuple[str, Optional[int]]:
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


def parse_remote_url(url: object) -> Tuple[str, str, int, str]:
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


def redact(url: object) -> str:
    """``url`` for messages: no user name, password, query or fragment, printable, bounded."""
    url = str(url)
    m = _URL_RE.match(url)
    prefix, rest = (m.group(1) + "://", m.group(2)) if m else ("", url)
    rest = rest.rpartition("@")[2]
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    out = "".join(c if c.isprintable() and c != "\\" else "?" for c in prefix + rest)
    return out if len(out) <= 200 else out[:197] + "..."


def check_remote(remote: Optional[str], url: str, hosts: Iterable[object]) -> None:
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


def config_key(name: str) -> str:
    """git's canonical key: section and variable lower-case, subsection as written."""
    section, rest = name.partition(".")[::2]
    sub, var = rest.rpartition(".")[::2]
    return "%s.%s%s" % (section.lower(), sub + "." if sub else "", var.lower())


def _valid_nick(name: str) -> bool:  # git's valid_remote_nick()
    return bool(name) and name not in (".", "..") and "/" not in name


def sync_remotes(argv: Sequence[str], config: List[Tuple[str, str]],
                 branch: Optional[str]) -> List[Tuple[Optional[str], List[str]]]:
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
    sub: Optional[str]
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

    positional: List[str]
    repo_opt: Optional[str]
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

    def values(key: str) -> List[str]:
        return [v for k, v in config if k == key]

    def last(key: str) -> Optional[str]:
        found = values(key)
        return found[-1] if found else None

    push = sub == "push"
    names: Optional[Sequence[Optional[str]]]
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
    out: List[Tuple[Optional[str], List[str]]] = []
    for name in cast("Sequence[str]", names):  # no None is left: the last branch falls back to origin
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


def confine(workspace: str, repo: object) -> str:
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


def inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, os.path.realpath(path)]) == root


# paths inside a git directory that make git read another directory or file:
# objects/info/alternates (and its dumb-http twin) add object stores, commondir
# makes the directory a linked worktree of another repository's
GIT_DIR_INDIRECTIONS = ("objects/info/alternates", "objects/info/http-alternates", "commondir")
GIT_DIR_MAX_ENTRIES = 500000


def _shown(rel: str) -> str:
    rel = "".join(c if c.isprintable() and c != "\\" else "?" for c in rel)
    return rel if len(rel) <= 120 else rel[:117] + "..."


def check_git_dir(repo: str) -> str:
    """Refuse (Rejected) a repository whose git directory could lead git out of it.

    ``repo`` is the (pinned) working tree. Its ``.git`` must be a directory
    (not a ``gitdir:`` file, not a symbolic link); nothing in it may be a
    symbolic link (refs/, objects/, packed-refs, HEAD, config, ...) or
    anything but a directory or regular file (FIFOs, sockets, devices); none
    of GIT_DIR_INDIRECTIONS may exist. Nothing is followed while walking.
    Returns the git directory's path. The walk is a front: the worker's
    mount namespace holds only the slot's workspace, so a link swapped in
    after the walk still finds nothing of another slot.
    """
    gd = os.path.join(repo, ".git")
    try:
        st = os.lstat(gd)
    except FileNotFoundError:
        raise Rejected("repo has no .git directory") from None
    if stat.S_ISLNK(st.st_mode):
        raise Rejected(".git is a symbolic link")
    if stat.S_ISREG(st.st_mode):
        raise Rejected(".git is a file (a gitdir: link to another git directory)")
    if not stat.S_ISDIR(st.st_mode):
        raise Rejected(".git is not a directory")
    for rel in GIT_DIR_INDIRECTIONS:
        if os.path.lexists(os.path.join(gd, rel)):
            raise Rejected(".git/%s is not allowed (git would read another directory)" % rel)
    todo, seen = [""], 0
    while todo:
        sub = todo.pop()
        try:
            with os.scandir(os.path.join(gd, sub)) as it:
                entries = list(it)
        except OSError as exc:
            raise Rejected(".git/%s cannot be read: %s" % (_shown(sub), exc.strerror)) from None
        for e in entries:
            seen += 1
            if seen > GIT_DIR_MAX_ENTRIES:
                raise Rejected("the git directory holds more than %d entries" % GIT_DIR_MAX_ENTRIES)
            rel = os.path.join(sub, e.name)
            if e.is_symlink():
                raise Rejected("symbolic link in the git directory: .git/%s" % _shown(rel))
            if e.is_dir(follow_symlinks=False):
                todo.append(rel)
            elif not e.is_file(follow_symlinks=False):
                raise Rejected("special file in the git directory: .git/%s" % _shown(rel))
    return gd


def disallowed_git_keys(names: Iterable[str]) -> List[str]:
    """Config keys (lower-case names as git prints them) that are not on the allow-list."""
    return sorted({n for n in names if not any(p.fullmatch(n) for p in GIT_CONFIG_ALLOWED)})


def git_env(base_env: Mapping[str, str], ws_real: str, repo: Optional[str] = None) -> Dict[str, str]:
    """git's environment: an allow-list of the broker's variables (so no
    GIT_DIR, GIT_ALTERNATE_OBJECT_DIRECTORIES, GIT_CONFIG_PARAMETERS... of
    anyone else) and, for ``repo``, GIT_DIR/GIT_WORK_TREE pinned to its
    ``.git`` and itself (no discovery, no core.worktree)."""
    env = {k: v for k, v in base_env.items() if k in ("PATH", "LANG", "LC_ALL", "TZ", "CHV_BROKER_CRED_FD")}
    env.setdefault("PATH", "/usr/bin:/bin")
    if repo is not None:
        env.update({"GIT_DIR": os.path.join(repo, ".git"), "GIT_WORK_TREE": repo})
    env.update({
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_PROTOCOL_FROM_USER": "0",
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


def git_prefix(protocols: Iterable[str], credential_helper: str, proxy: str = "") -> List[str]:
    """git and the options every sync runs it with; ``proxy`` (the spec's,
    in proxy mode: the slot's egress proxy) as http.proxy, so that git's
    http and https remotes go through the proxy with the slot's list (its
    other protocols have no path out: the kernel drops a door's direct
    connections in proxy mode)."""
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
    if proxy:
        argv += ["-c", "http.proxy=" + proxy]
    # never into submodules: their git directories (a sub/.git "gitdir:" file, their
    # config, alternates...) are outside what check_git_dir and the key allow-list read
    argv += ["-c", "submodule.recurse=false", "-c", "fetch.recurseSubmodules=false",
             "-c", "push.recurseSubmodules=no", "-c", "diff.ignoreSubmodules=all",
             "-c", "status.submoduleSummary=false"]
    return argv


def _git_out(prefix: List[str], env: Mapping[str, str], *args: str) -> bytes:
    proc = subprocess.run(prefix + list(args), env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)
    if proc.returncode != 0:
        raise Rejected("git refused the repository: " + proc.stderr.decode("utf-8", "replace").strip()[:200])
    return proc.stdout


def parse_config_list(data: bytes) -> List[Tuple[str, Optional[str]]]:
    """``git config --list --null`` output -> [(name, value)] in file order (a bare key has value None)."""
    out: List[Tuple[str, Optional[str]]] = []
    for item in data.split(b"\0"):
        if item:
            name, nl, value = item.decode("utf-8", "surrogateescape").partition("\n")
            out.append((name, value if nl else None))
    return out


def current_branch(prefix: List[str], env: Mapping[str, str]) -> Optional[str]:
    """The checked-out branch (also unborn), or None when HEAD is detached."""
    proc = subprocess.run(prefix + ["symbolic-ref", "--quiet", "HEAD"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)
    if proc.returncode == 1:
        return None
    if proc.returncode != 0:
        raise Rejected("git refused the repository: " + proc.stderr.decode("utf-8", "replace").strip()[:200])
    ref = proc.stdout.decode("utf-8", "surrogateescape").strip()
    return ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else None


# (protocol, host, port) of a remote URL the sync contacts, as checked
Target = Tuple[str, str, int]


class _SyncSpecRequired(TypedDict):
    workspace: str
    repo: str
    argv: List[str]


class SyncSpec(_SyncSpecRequired, total=False):
    """The worker's JSON argument, as chv-broker's op_sync writes it."""
    protocols: List[str]
    hosts: List[str]
    credential_helper: str
    rlimit_as: int
    rlimit_cpu: int
    clone: "CloneSpec"
    proxy: str


def prepare(spec: SyncSpec, environ: Mapping[str, str],
            targets: Optional[Set[Target]] = None) -> Tuple[List[str], Dict[str, str]]:
    """Everything but the exec: returns (argv, env).  Raises Rejected.

    ``targets`` (a set) gets the (protocol, host, port) of every remote URL
    the git command contacts, as checked: credential_lines keeps only theirs.
    """
    targets = set() if targets is None else targets
    ws_real = os.path.realpath(spec["workspace"])
    real = confine(spec["workspace"], spec["repo"])
    os.chdir(real)
    if not inside(ws_real, os.getcwd()):  # the pinned cwd is what the command sees
        raise Rejected("repo resolves outside the slot's workspace")
    argv = list(spec["argv"])
    env = dict(environ)
    hosts = list(spec.get("hosts") or ())
    if os.path.basename(argv[0]) == "git":
        check_git_dir(real)  # before any git command reads the directory
        env = git_env(environ, ws_real, real)
        prefix = git_prefix(spec.get("protocols", ["https"]), spec.get("credential_helper") or "", spec.get("proxy") or "")
        # config first: any other git command would already honour include.path & co.
        config = parse_config_list(_git_out(prefix, env, "config", "--local", "--no-includes", "--list", "--null"))
        bad = disallowed_git_keys(n.lower() for n, _v in config)
        if bad:
            raise Rejected("repository config keys not allowed by chv-broker: " + ", ".join(bad[:10]))
        dirs = _git_out(prefix, env, "rev-parse", "--absolute-git-dir", "--git-common-dir")
        for d in dirs.decode("utf-8", "replace").splitlines():
            if not inside(ws_real, d):
                raise Rejected("the repository's git directory lies outside the slot's workspace")
        remotes: Optional[List[Tuple[Optional[str], List[str]]]]
        try:
            remotes = sync_remotes(argv, [(k, v or "") for k, v in config], current_branch(prefix, env))
        except Rejected:
            if hosts:
                raise
            remotes = None  # cannot tell: no host check asked for, and no credentials (credential_lines)
        if hosts:
            for name, urls in cast("List[Tuple[Optional[str], List[str]]]", remotes):  # set: Rejected re-raised
                for url in urls:
                    check_remote(name, url, hosts)
        for _name, urls in remotes or ():
            for url in urls:
                try:
                    proto, host, port, _d = parse_remote_url(url)
                except ValueError:
                    continue
                targets.add((proto, host, port))
        argv = prefix + argv[1:]
    elif hosts:
        sync_remotes(argv, [], None)  # refuses: not git
    return argv, env


# ------------------------------------------------------------------ the mount namespace
# The systemd properties the worker's mount namespace is made of. In isolation
# "unit" systemd reads them; in "child" enter_jail() makes the same namespace.
MOUNT_PROPERTIES = ("TemporaryFileSystem", "InaccessiblePaths", "BindPaths", "ReadWritePaths",
                    "ProtectHome", "PrivateTmp")
_PATH_RE = re.compile(r"/[A-Za-z0-9._@+/-]*")
_TMPFS_OPT_RE = re.compile(r"ro|rw|mode=[0-7]{3,4}|size=[0-9]+[kmgKMG%]?|nr_inodes=[0-9]+[kmgKMG]?")


class JailError(Rejected):
    pass


# (kind, path, arg) of one mount of jail_plan: "tmpfs" (options, read only), "inaccessible"
# (optional), "bind" (source)
MountStep = Tuple[str, str, Union[Tuple[str, bool], bool, str]]


class JailSpec(TypedDict):
    """The worker's --jail argument (isolation "child"), as chv-broker's op_sync writes it."""
    uid: int
    gid: int
    workspace: str
    properties: List[str]


def _jail_path(text: str, what: str) -> str:
    if not _PATH_RE.fullmatch(text) or "/../" in text + "/" or "/./" in text + "/" or "//" in text:
        raise ValueError("%s: %r is not a plain absolute path" % (what, text))
    return text.rstrip("/") or "/"


def jail_plan(properties: Iterable[object]) -> List[MountStep]:
    """The mounts, in order, that ``properties`` (systemd ``Name=value`` strings) stand for.

    Pure. Returns [(kind, path, arg)] with kind "tmpfs" (arg: (options,
    read_only)), "inaccessible" (arg: optional) or "bind" (arg: the source),
    parents before children (systemd sorts its mounts the same way).
    Raises ValueError for a property it does not know (only those of
    MOUNT_PROPERTIES; ReadWritePaths= changes nothing here) and for paths
    that are not plain absolute paths.
    """
    steps: List[MountStep] = []
    for prop in properties:
        name, eq, value = str(prop).partition("=")
        if not eq or name not in MOUNT_PROPERTIES:
            raise ValueError("%r is not one of the mount properties %s" % (prop, ", ".join(MOUNT_PROPERTIES)))
        if name == "TemporaryFileSystem":
            for item in value.split():
                path, _sep, opts = item.partition(":")
                options = [o for o in opts.split(",") if o]
                bad = [o for o in options if not _TMPFS_OPT_RE.fullmatch(o)]
                if bad:
                    raise ValueError("TemporaryFileSystem=%s: option %r is not supported" % (item, bad[0]))
                ro = "ro" in options
                options = [o for o in options if o not in ("ro", "rw")]
                if not any(o.startswith("mode=") for o in options):
                    options.insert(0, "mode=0755")
                steps.append(("tmpfs", _jail_path(path, name), (",".join(options), ro)))
        elif name == "InaccessiblePaths":
            for item in value.split():
                optional = item.startswith("-")
                steps.append(("inaccessible", _jail_path(item.lstrip("-"), name), optional))
        elif name == "BindPaths":
            for item in value.split():
                src, _sep, dst = item.partition(":")
                if ":" in dst:
                    raise ValueError("BindPaths=%s: options are not supported" % item)
                steps.append(("bind", _jail_path(dst or src, name), _jail_path(src, name)))
        elif name == "ReadWritePaths":
            for item in value.split():
                _jail_path(item.lstrip("-"), name)
        elif name == "ProtectHome":
            if value in ("yes", "true"):
                steps += [("inaccessible", p, True) for p in ("/home", "/root", "/run/user")]
            elif value in ("read-only", "tmpfs"):
                steps += [("tmpfs", p, ("mode=0755", True)) for p in ("/home", "/root", "/run/user")]
            elif value not in ("no", "false"):
                raise ValueError("ProtectHome=%s is not supported" % value)
        elif name == "PrivateTmp":
            if value in ("yes", "true"):
                steps += [("tmpfs", "/tmp", ("mode=1777", False)), ("tmpfs", "/var/tmp", ("mode=1777", False))]
            elif value not in ("no", "false"):
                raise ValueError("PrivateTmp=%s is not supported" % value)
    kinds = {"tmpfs": 0, "inaccessible": 0, "bind": 1}
    order = sorted(range(len(steps)),
                   key=lambda i: (0 if steps[i][1] == "/" else steps[i][1].count("/"), kinds[steps[i][0]], i))
    return [steps[i] for i in order]


CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path.startswith(r.rstrip("/") + "/") for r in roots)


def enter_jail(jail: JailSpec) -> None:
    """As root (isolation "child"): make the worker's mount namespace, then become the slot.

    ``jail``: {"uid", "gid", "workspace", "properties"}. The workspace is
    opened (O_PATH, O_NOFOLLOW) in the new namespace before anything is
    mounted there, and bound from that descriptor; propagation is private, so nothing reaches the host.
    Mount points are only ever created inside tmpfs mounted here. Then
    supplementary groups, gid, uid (all three of each) and no_new_privs;
    checked afterwards, with the capability sets, which must be empty.
    Raises JailError (a Rejected) when any step fails: no sync without it.
    """
    import ctypes  # only here: the unit-mode worker never needs it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def call(what: str, rc: int) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            hint = (" (chv-broker needs CAP_SYS_ADMIN, mount(2) and unshare(2) for sync.isolation child)"
                    if err in (1, 13) else "")
            raise JailError("the sync worker's mount namespace could not be made: %s: %s%s"
                            % (what, os.strerror(err), hint))

    def enc(value: Optional[str]) -> Optional[bytes]:
        return value.encode() if isinstance(value, str) else value

    def mount(src: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
        call("mount %s" % target, libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)))

    uid, gid, workspace = int(jail["uid"]), int(jail["gid"]), jail["workspace"]
    if uid <= 0 or gid <= 0:
        raise JailError("the sync worker never runs as root")
    try:
        plan = jail_plan(jail["properties"])
    except ValueError as exc:
        raise JailError("sync.mounts: %s" % exc) from None
    call("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:  # in the new namespace (a bind's source must be one of its mounts), before any mount
        ws_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise JailError("slot workspace cannot be opened: %s" % exc.strerror) from None
    ours: List[str]
    read_only: List[Tuple[str, int]]
    ours, read_only = [], []
    for kind, path, arg in plan:
        if not os.path.lexists(path):
            if _under(path, ours) and kind in ("tmpfs", "bind"):
                os.makedirs(path, 0o755)
            elif kind == "inaccessible" and not arg:
                raise JailError("InaccessiblePaths=%s does not exist" % path)
            elif kind == "bind":
                raise JailError("BindPaths=%s: the mount point does not exist" % path)
            else:
                continue  # nothing there to hide
        if kind == "tmpfs":
            options, ro = cast("Tuple[str, bool]", arg)
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
            ours.append(path)
            if ro:
                read_only.append((path, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV))
        elif kind == "inaccessible":
            if os.path.isdir(path):
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=000,nr_inodes=1")
                read_only.append((path, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV))
            else:
                mount("/dev/null", path, None, MS_BIND)
                read_only.append((path, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV))
        else:  # bind: only the workspace, from the descriptor opened before any mount
            if arg != workspace:
                raise JailError("BindPaths=%s: only the slot's workspace is bound" % (arg,))
            mount("/proc/self/fd/%d" % ws_fd, path, None, MS_BIND)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    for path, flags in read_only:
        mount(None, path, None, flags)
    os.close(ws_fd)
    os.chdir("/")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    call("prctl(PR_SET_NO_NEW_PRIVS)", libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    with open("/proc/self/status", encoding="ascii") as fh:
        caps = [line.split()[1] for line in fh if line.startswith(("CapPrm:", "CapEff:", "CapAmb:"))]
    if (os.getresuid() != (uid,) * 3 or os.getresgid() != (gid,) * 3 or os.getgroups()
            or any(int(c, 16) for c in caps)):
        raise JailError("the sync worker did not become the slot's uid/gid")


def credential_lines(data: bytes, targets: Iterable[Target]) -> bytes:
    """The credential file's lines for the remotes the sync contacts, nothing else.

    ``data``: git-credential-store lines (bytes); ``targets``: (protocol, host,
    port) of the checked remote URLs. A line is kept when its scheme is the
    protocol and its host the host (its port, if it names one, the port).
    """
    from urllib.parse import urlsplit  # pylint: disable=import-outside-toplevel
    keep: List[bytes] = []
    for raw in data.splitlines():
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        try:
            u = urlsplit(line.decode("utf-8"))
            host, port = (u.hostname or "").lower().rstrip("."), u.port
        except (UnicodeDecodeError, ValueError):
            continue
        for proto, thost, tport in targets:
            if u.scheme == proto and _host_text(thost) == host and (port or DEFAULT_PORTS.get(proto)) == tport:
                keep.append(line)
                break
    return b"\n".join(keep) + b"\n" if keep else b""


def _host_text(host: str) -> str:
    return host[1:-1] if host.startswith("[") else host


def credentials_fd(data: bytes) -> Optional[int]:
    """The credentials git's helper may answer with, in an unnamed memfd (CHV_BROKER_CRED_FD).

    Inheritable: git starts the helper (credential.py) through git-remote-https,
    so git's process tree inherits it; the cell is frozen and the config checked,
    so no program of the cell's choosing runs in that tree, and the memfd holds
    only the lines of the host(s) checked (credential_lines)."""
    if not data:
        return None
    fd = os.memfd_create("chv-broker-credentials", 0)
    os.write(fd, data)
    os.set_inheritable(fd, True)
    return fd


def set_limits(spec: SyncSpec) -> None:
    """The worker's and git's address space and CPU time (setrlimit; chv-broker's sync.rlimit_*)."""
    import resource  # pylint: disable=import-outside-toplevel
    key: Literal["rlimit_as", "rlimit_cpu"]
    for key, res in (("rlimit_as", resource.RLIMIT_AS), ("rlimit_cpu", resource.RLIMIT_CPU)):
        value = int(spec.get(key) or 0)
        if value > 0:
            resource.setrlimit(res, (value, value))


# ------------------------------------------------------------------ clone (chv-cell task start --repo)
_REF_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}")


class CloneSpec(TypedDict, total=False):
    """spec["clone"]: the repository a task starts with (chv-cell's clone.py writes it)."""
    url: str
    ref: str


def check_clone(spec: SyncSpec, clone: CloneSpec, targets: Set[Target]) -> Tuple[str, Optional[str]]:
    """The clone's URL and ref, checked: a URL git can reach by one of the
    allowed protocols, without a user name, password, query or fragment
    (the credential comes from the guest's credential file, and what the
    workspace's .git/config keeps is the URL as given), naming a host of
    ``hosts`` when that list is set; a plain ref (branch, tag or commit,
    no leading '-', no '..').  Adds the URL's target to ``targets``."""
    url, ref = clone.get("url"), clone.get("ref")
    try:
        proto, host, port, display = parse_remote_url(url)
    except ValueError as exc:
        raise Rejected("clone URL %s: %s" % (redact(url), exc)) from None
    if _URL_RE.fullmatch(str(url)) and display != url:
        raise Rejected("clone URL %s: a URL with a user name, password, query or fragment (or an upper-case "
                       "scheme) is refused; the credential comes from the guest's credential file" % redact(url))
    if proto not in spec.get("protocols", ["https"]):
        raise Rejected("clone URL %s: protocol %s is not allowed (chv_broker_sync_protocols)" % (redact(url), proto))
    if spec.get("hosts"):
        try:
            check_remote(None, str(url), spec.get("hosts") or ())
        except Rejected as exc:
            raise Rejected("clone URL %s" % exc) from None
    if ref is not None and (not isinstance(ref, str) or not _REF_RE.fullmatch(ref) or ".." in ref
                            or ref.endswith((".", "/", ".lock"))):
        raise Rejected("clone ref %r is not a plain branch, tag or commit name" % (ref,))
    targets.add((proto, host, port))
    return str(url), ref


def _git_run(prefix: List[str], env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    """git with ``args``; the credentials' memfd (CHV_BROKER_CRED_FD) is its, and its helper's, to read."""
    fd = env.get("CHV_BROKER_CRED_FD")
    return subprocess.run(prefix + list(args), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, check=False, pass_fds=(int(fd),) if fd else ())


def run_clone(spec: SyncSpec, url: str, ref: Optional[str], env: Mapping[str, str]) -> Dict[str, Optional[str]]:
    """Clone ``url`` into the (empty) workspace, the cwd, and check out
    ``ref`` (a remote branch as a local tracking branch, else a tag or
    commit, detached); the hardened git of every sync (git_prefix,
    git_env), no template (no hooks), no submodules.  Afterwards the
    repository must pass what every later sync checks (check_git_dir, the
    config key allow-list).  Returns {"head", "branch"}; raises Rejected
    with git's message when git fails."""
    ws = spec["workspace"]
    if os.listdir("."):
        raise Rejected("the slot's workspace is not empty")
    prefix = git_prefix(spec.get("protocols", ["https"]), spec.get("credential_helper") or "", spec.get("proxy") or "")
    genv = dict(env, GIT_DIR=os.path.join(ws, ".git"), GIT_WORK_TREE=ws)

    def must(*args: str, in_repo: bool = True) -> bytes:
        proc = _git_run(prefix, genv if in_repo else env, *args)
        if proc.returncode != 0:
            raise Rejected("git %s failed: %s" % (args[0], printable_tail(proc.stderr)))
        return proc.stdout

    must("clone", "--quiet", "--template=", "--no-checkout", "--origin", "origin", "--", url, ".", in_repo=False)
    if ref is None:
        must("checkout", "--quiet")
    elif _git_run(prefix, genv, "rev-parse", "--verify", "--quiet", "refs/remotes/origin/" + ref).returncode == 0:
        must("checkout", "--quiet", "-B", ref, "--track", "origin/" + ref)
    else:
        found = _git_run(prefix, genv, "rev-parse", "--verify", "--quiet", "--end-of-options", ref + "^{commit}")
        if found.returncode != 0:
            raise Rejected("git checkout failed: %s is neither a branch of the remote nor a tag or commit of the "
                           "repository" % ref)
        commit = found.stdout.decode().strip()
        must("-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit)
    check_git_dir(ws)
    bad = disallowed_git_keys(n.lower() for n, _v in parse_config_list(
        must("config", "--local", "--no-includes", "--list", "--null")))
    if bad:
        raise Rejected("the clone's config holds keys chv-broker does not allow: " + ", ".join(bad[:10]))
    head = must("rev-parse", "HEAD").decode().strip()
    return {"head": head, "branch": current_branch(prefix, genv)}


def printable_tail(data: bytes, limit: int = 300) -> str:
    text = "".join(c if c.isprintable() else " " for c in data.decode("utf-8", "replace")).strip()
    return text[-limit:]


def clone_main(spec: SyncSpec, clone: CloneSpec, data: bytes) -> int:
    """The worker's clone: one JSON line ({"cloned": {...}} or {"rejected": why}); 0 or REJECT_STATUS."""
    targets: Set[Target] = set()
    try:
        url, ref = check_clone(spec, clone, targets)
        ws_real = os.path.realpath(spec["workspace"], strict=True)
        os.chdir(ws_real)
        env = git_env(os.environ, ws_real)
        fd = credentials_fd(credential_lines(data, targets))
        if fd is not None:
            env["CHV_BROKER_CRED_FD"] = str(fd)
        result = run_clone(spec, url, ref, env)
    except (Rejected, OSError) as exc:
        sys.stdout.write(json.dumps({"rejected": str(exc)}) + "\n")
        sys.stdout.flush()
        return REJECT_STATUS
    sys.stdout.write(json.dumps({"cloned": result}) + "\n")
    sys.stdout.flush()
    return 0


def main(args: List[str]) -> int:
    if args[:1] == ["--jail"]:  # isolation "child": started as root, becomes the slot here
        try:
            enter_jail(json.loads(args[1]))
        except Rejected as exc:
            sys.stdout.write(json.dumps({"rejected": str(exc)}) + "\n")
            sys.stdout.flush()
            return REJECT_STATUS
        args = args[2:]
    spec = json.loads(args[0])
    set_limits(spec)
    data = sys.stdin.buffer.read(1 << 20)
    if "clone" in spec:
        return clone_main(spec, spec["clone"], data)
    targets: Set[Target] = set()
    try:
        argv, env = prepare(spec, os.environ, targets)
    except Rejected as exc:
        sys.stdout.write(json.dumps({"rejected": str(exc)}) + "\n")
        sys.stdout.flush()
        return REJECT_STATUS
    fd = credentials_fd(credential_lines(data, targets))
    del data
    if fd is not None:
        env["CHV_BROKER_CRED_FD"] = str(fd)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
