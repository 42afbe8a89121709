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
4. exec the configured argument vector (never a shell).

A rejection is one JSON line on stdout and exit status REJECT_STATUS.
Standard library only; importable for unit tests.
"""
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


def git_prefix(protocols, credential_helper):
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
    return argv


def _git_out(prefix, env, *args):
    proc = subprocess.run(prefix + list(args), env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30, check=False)
    if proc.returncode != 0:
        raise Rejected("git refused the repository: " + proc.stderr.decode("utf-8", "replace").strip()[:200])
    return proc.stdout


def prepare(spec, environ):
    """Everything but the exec: returns (argv, env).  Raises Rejected."""
    ws_real = os.path.realpath(spec["workspace"])
    real = confine(spec["workspace"], spec["repo"])
    os.chdir(real)
    if not inside(ws_real, os.getcwd()):  # the pinned cwd is what the command sees
        raise Rejected("repo resolves outside the slot's workspace")
    argv = list(spec["argv"])
    env = dict(environ)
    if os.path.basename(argv[0]) == "git":
        env = git_env(environ, ws_real)
        prefix = git_prefix(spec.get("protocols", ["https"]), spec.get("credential_helper") or "")
        # config first: any other git command would already honour include.path & co.
        names = _git_out(prefix, env, "config", "--local", "--no-includes", "--list", "--name-only", "--null")
        bad = disallowed_git_keys(n.decode("utf-8", "replace").lower() for n in names.split(b"\0") if n)
        if bad:
            raise Rejected("repository config keys not allowed by chv-broker: " + ", ".join(bad[:10]))
        dirs = _git_out(prefix, env, "rev-parse", "--absolute-git-dir", "--git-common-dir")
        for d in dirs.decode("utf-8", "replace").splitlines():
            if not inside(ws_real, d):
                raise Rejected("the repository's git directory lies outside the slot's workspace")
        argv = prefix + argv[1:]
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
