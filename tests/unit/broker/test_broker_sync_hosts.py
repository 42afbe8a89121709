"""sync: the git host allow-list (chv_broker_sync_hosts)."""
import json
import os
import re
import socket
import subprocess

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from testpaths import ROOT

from ansible_collections.chv.fleet.plugins.filter import door_config

from chv_guest.broker import config, server
from chv_guest.broker.syncrun import (Rejected, check_remote, git_prefix, parse_host_entry, parse_remote_url, redact,
                                sync_remotes)

# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("url, expected", [
    ("https://github.com/org/repo.git", ("https", "github.com", 443)),
    ("https://bot:s3cret@GitHub.COM./org/repo.git", ("https", "github.com", 443)),
    ("http://git.example.org:8080/x", ("http", "git.example.org", 8080)),
    ("https://git.example.org:/x", ("https", "git.example.org", 443)),
    ("ssh://git@git.example.org/org/repo.git", ("ssh", "git.example.org", 22)),
    ("ssh://git@git.example.org:2222/org/repo.git", ("ssh", "git.example.org", 2222)),
    ("git+ssh://git.example.org/x", ("ssh", "git.example.org", 22)),
    ("ssh+git://git.example.org/x", ("ssh", "git.example.org", 22)),
    ("git://git.example.org/x", ("git", "git.example.org", 9418)),
    ("HTTPS://[2001:DB8::1]:8443/x", ("https", "[2001:db8::1]", 8443)),
    ("ssh://git@[2001:db8:0:0::1]/x", ("ssh", "[2001:db8::1]", 22)),
    ("git@github.com:org/repo.git", ("ssh", "github.com", 22)),
    ("github.com:org/repo.git", ("ssh", "github.com", 22)),
    ("git@[2001:db8::1]:org/repo.git", ("ssh", "[2001:db8::1]", 22)),
    ("10.0.0.5:repo", ("ssh", "10.0.0.5", 22)),
])
def test_parse_remote_url_accepts(url, expected):
    assert parse_remote_url(url)[:3] == expected


@pytest.mark.parametrize("url, why", [
    ("file:///srv/git/x.git", "file://"),
    ("FILE://host/x", "file://"),
    ("/srv/git/x.git", "local path"),
    ("../x", "local path"),
    (".", "local path"),
    ("origin", "local path"),
    ("./host:path", "local path"),
    ("https::https://evil.example/x", "remote helper"),
    ("ext::sh -c touch% /tmp/x", "unparseable"),
    ("ftp://evil.example/x", "scheme ftp://"),
    ("ssh://ev%69l.example/x", "unparseable"),          # git would decode this
    ("ssh://a@b@evil.example/x", "unparseable"),
    ("https://evil.example?@good.example/x", "unparseable"),
    ("https://evil.example#@good.example/x", "unparseable"),
    ("https://-oProxyCommand=x/y", "not a host"),
    ("-oProxyCommand=x:y", "not a host"),
    ("https:///x", "not a host"),
    ("https://host:99999/x", "port"),
    ("https://host:0/x", "port"),
    ("https://host:1:2/x", "unparseable"),
    ("https://[fe80::1%25eth0]/x", "unparseable"),
    ("https://[not-v6]/x", "not an IPv6 address"),
    ("[user@host:2222]:repo", "not an IPv6 address"),
    ("user:pw@host:path", None),  # git: ssh to host "user" (path "pw@host:path"): parsed, not refused here
    ("https://h\\@evil.example/x", "backslash"),
    ("https://host/x y", "blanks"),
    ("", "empty"),
])
def test_parse_remote_url_refuses(url, why):
    if why is None:
        assert parse_remote_url(url)[1] == "user"
        return
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_remote_url(url)


@pytest.mark.parametrize("entry, expected", [
    ("github.com", ("github.com", None)),
    ("GitHub.com.", ("github.com", None)),
    ("git.example.org:2222", ("git.example.org", 2222)),
    ("10.1.2.3", ("10.1.2.3", None)),
    ("10.1.2.3:443", ("10.1.2.3", 443)),
    ("2001:db8::1", ("[2001:db8::1]", None)),
    ("[2001:DB8:0::1]", ("[2001:db8::1]", None)),
    ("[2001:db8::1]:22", ("[2001:db8::1]", 22)),
])
def test_host_entries(entry, expected):
    assert parse_host_entry(entry) == expected


@pytest.mark.parametrize("entry", ["", "https://github.com", "host:", "host:0", "host:65536", "host:022",
                                   "-host", "ho st", "[::1]:", "[::1]x", "fe80::1%eth0", "a:b:c", "host/x", 5, None])
def test_bad_host_entries(entry):
    with pytest.raises(ValueError):
        parse_host_entry(entry)


# ------------------------------------------------------------------ matching

HOSTS = ["git.example.org", "mirror.example.org:8443", "10.0.0.5", "2001:db8::1"]


@pytest.mark.parametrize("url", [
    "https://git.example.org/x.git",
    "https://GIT.Example.ORG./x.git",
    "ssh://git@git.example.org:2222/x.git",        # no port in the entry: every port
    "git@git.example.org:x.git",
    "https://mirror.example.org:8443/x",
    "https://10.0.0.5/x",
    "ssh://[2001:db8:0::1]/x",
    "git@[2001:db8::1]:x",
])
def test_allowed_hosts(url):
    check_remote("origin", url, HOSTS)  # does not raise


@pytest.mark.parametrize("url, why", [
    ("https://evil.example/x.git", "host evil.example port 443 is not in chv_broker_sync_hosts"),
    ("https://git.example.org.evil.example/x", "is not in chv_broker_sync_hosts"),
    ("https://mirror.example.org/x", "host mirror.example.org port 443 is not"),  # wrong port
    ("https://10.0.0.6/x", "host 10.0.0.6 port 443"),
    ("https://[2001:db8::2]/x", "host [2001:db8::2] port 443"),
    ("/srv/git/x.git", "local paths are refused while chv_broker_sync_hosts is set"),
    ("file:///srv/git/x.git", "file:// URLs (local repositories) are refused while chv_broker_sync_hosts is set"),
    ("https::https://git.example.org/x", "remote helper"),
])
def test_refused_hosts_name_the_remote_and_the_variable(url, why):
    with pytest.raises(Rejected) as exc:
        check_remote("origin", url, HOSTS)
    assert why in str(exc.value) and str(exc.value).startswith("remote 'origin' ("), str(exc.value)
    assert "chv_broker_sync_hosts" in str(exc.value)


def test_refusal_strips_credentials_query_and_fragment():
    with pytest.raises(Rejected) as exc:
        check_remote("up", "https://bot:hunter2@evil.example:8443/org/x.git?token=abc#frag", HOSTS)
    assert str(exc.value) == ("remote 'up' (https://evil.example:8443/org/x.git): host evil.example port 8443 "
                              "is not in chv_broker_sync_hosts")
    with pytest.raises(Rejected) as exc:
        check_remote(None, "ssh://bot:hunter2@ev%69l/x", HOSTS)  # unparseable: redacted all the same
    assert "hunter2" not in str(exc.value) and "bot" not in str(exc.value)
    assert redact("user:pw@host:path") == "host:path"


_label = st.from_regex(r"[a-z0-9][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
_hostname = st.lists(_label, min_size=1, max_size=4).map(".".join)
_secret = st.from_regex(r"[A-Z][A-Z0-9!$&'()*+,;=~:%/?#\[\]@]{5,30}", fullmatch=True)
_path = st.from_regex(r"[a-z0-9._/-]{0,30}", fullmatch=True)


def _url_forms(user, secret, host, port, path):
    return [
        "https://%s:%s@%s/%s" % (user, secret, host, path),
        "https://%s:%s@%s:%d/%s" % (user, secret, host, port, path),
        "http://%s@%s/%s?token=%s" % (user, host, path, secret),
        "https://%s/%s#%s" % (host, path, secret),
        "ssh://%s:%s@%s/%s" % (user, secret, host, path),
        "git://%s:%s@%s/%s" % (user, secret, host, path),
        "%s:%s@%s:%s" % (user, secret, host, path),   # scp-like (odd, but git takes it)
        "https://%s@%s/%s" % (secret, host, path),
    ]


@settings(max_examples=300, deadline=None)
@given(user=st.from_regex(r"[a-z]{1,8}", fullmatch=True), secret=_secret, host=_hostname,
       port=st.integers(1, 65535), path=_path, allowed=st.lists(_hostname, max_size=3))
def test_credentials_never_appear_in_the_refusal(user, secret, host, port, path, allowed):
    for url in _url_forms(user, secret, host, port, path):
        try:
            check_remote("origin", url, allowed or ["nothing.invalid"])
        except Rejected as exc:
            msg = str(exc)
            assert secret not in msg, (url, msg)
            assert "chv_broker_sync_hosts" in msg
            assert msg.isprintable()
        try:
            check_remote(None, url, ["nothing.invalid"])  # the remote *is* the URL
            raise AssertionError("allowed: " + url)
        except Rejected as exc:
            assert secret not in str(exc), (url, str(exc))


@settings(max_examples=300, deadline=None)
@given(host=_hostname, other=_hostname, port=st.integers(1, 65535), data=st.data())
def test_matching_ignores_case_and_trailing_dot_and_nothing_else(host, other, port, data):
    spelled = "".join(c.upper() if data.draw(st.booleans()) else c for c in host)
    dot = "." if data.draw(st.booleans()) else ""
    entry = data.draw(st.sampled_from([host, host + ".", host.upper(), "%s:%d" % (host, port)]))
    url = "ssh://git@%s%s:%d/x" % (spelled, dot, port)
    check_remote("origin", url, [entry])
    check_remote("origin", "git@%s%s:x" % (spelled, dot), [host])
    if other != host:
        with pytest.raises(Rejected):
            check_remote("origin", "ssh://git@%s:%d/x" % (other, port), [entry])
    with pytest.raises(Rejected):
        check_remote("origin", "ssh://git@%s:%d/x" % (host, port % 65535 + 1), ["%s:%d" % (host, port)])


@settings(max_examples=200, deadline=None)
@given(addr=st.ip_addresses(v=6), port=st.integers(1, 65535))
def test_ipv6_by_value(addr, port):
    exploded = addr.exploded.upper()
    check_remote("o", "https://[%s]:%d/x" % (exploded, port), [str(addr)])
    check_remote("o", "git@[%s]:x" % exploded, ["[%s]:22" % addr])
    with pytest.raises(Rejected):
        check_remote("o", "https://[%s]:%d/x" % (exploded, port), ["[%s]:%d" % (addr, port % 65535 + 1)])


# ------------------------------------------------------------------ the entry syntax, on the controller too

def _parses(entry):
    try:
        parse_host_entry(entry)
        return True
    except ValueError:
        return False


def _role_check(entry):
    """The role's check (chv.fleet.door_config_errors, chv-broker's own validator) of one entry."""
    return door_config.door_config_errors({"sync": {"hosts": [entry]}}, "broker")


_entry_text = st.one_of(
    st.text(alphabet="abcAB019.:[]_-%", max_size=24),
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda a: "[%s]" % a),
    st.tuples(st.ip_addresses(v=6), st.integers(0, 70000)).map(lambda t: "[%s]:%d" % t),
    st.tuples(_hostname, st.integers(0, 70000)).map(lambda t: "%s:%d" % t),
    st.tuples(st.ip_addresses(v=6), st.integers(0, 8)).map(lambda t: t[0].exploded[:-t[1] or None]),
    st.tuples(st.ip_addresses(v=6), st.text(alphabet="0123456789abcdef:.", max_size=6))
    .map(lambda t: t[0].compressed + t[1]),
)


@settings(max_examples=300, deadline=None)
@given(entry=_entry_text)
def test_the_role_check_is_the_brokers(entry):
    assert (_role_check(entry) == []) == _parses(entry), entry


@pytest.mark.parametrize("entry", ["github.com", "h:1", "h:65535", "::", "::1", "1::", "::ffff:1.2.3.4",
                                   "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:1.2.3.4", "[1::2:3:4:5:6:7]:80",
                                   "bad:", "1:2:3:4:5:6:7:8:9", ":::", "1::2::3", "::1.2.3.04", "h:65536",
                                   "[1:2:3:4:5:6:7::]", "[::1]:0", "h\n"])
def test_the_role_check_agrees_on_edges(entry):
    errors = _role_check(entry)
    assert (errors == []) == _parses(entry), entry
    if errors:  # names the variable and the entry
        assert errors == ['chv_broker_sync_hosts entry %s is not %s: %s'
                          % (json.dumps(entry), config.HOST_ENTRY, _why(entry))]


def _why(entry):
    try:
        parse_host_entry(entry)
    except ValueError as exc:
        return str(exc)
    return None


def test_role_wiring_is_consistent():
    with open(os.path.join(ROOT, "roles", "broker", "meta", "argument_specs.yml")) as fh:
        specs = yaml.safe_load(fh)["argument_specs"]
    assert door_config.door_default("chv_broker_sync_hosts", "broker") == [] == server.DEFAULTS["sync"]["hosts"]
    opt = specs["main"]["options"]["chv_broker_sync_hosts"]  # validate checks main's options, has none of its own
    assert (opt["type"], opt["elements"]) == ("list", "str")
    assert "options" not in specs["validate"]
    with open(os.path.join(ROOT, "roles", "broker", "vars", "main.yml")) as fh:
        role_vars = yaml.safe_load(fh)
    assert role_vars["__broker_config_values"]["sync"]["hosts"] == "{{ chv_broker_sync_hosts }}"
    assert not [k for k in role_vars if "host_entry" in k]  # no regular expression of its own
    with open(os.path.join(ROOT, "roles", "broker", "tasks", "checks.yml")) as fh:
        task = yaml.safe_load(fh)[0]
    assert task["loop"] == "{{ __broker_config_errors }}" and task["ansible.builtin.fail"]["msg"] == "{{ item }}"


# ------------------------------------------------------------------ which remote git would use

CFG = [("remote.origin.url", "https://git.example.org/o.git"),
       ("remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*"),
       ("remote.Up.url", "https://up.example/u.git"),
       ("remote.Up.pushurl", "ssh://git@push.example/u.git"),
       ("branch.main.remote", "origin"),
       ("branch.feature.remote", "Up"),
       ("branch.feature.pushRemote", "origin"),
       ("branch.detour.remote", "https://alias.example/a.git"),
       ("branch.ghost.remote", "ghost")]


@pytest.mark.parametrize("argv, branch, expected", [
    (["git", "status", "--porcelain=v1", "-b"], "main", []),
    (["git", "-c", "core.pager=cat", "log"], "main", []),
    (["git", "pull", "--ff-only"], "main", [("origin", ["https://git.example.org/o.git"])]),
    (["git", "pull", "--ff-only"], "feature", [("Up", ["https://up.example/u.git"])]),
    (["git", "pull"], None, [("origin", ["https://git.example.org/o.git"])]),        # detached HEAD
    (["git", "pull"], "nobranch", [("origin", ["https://git.example.org/o.git"])]),
    (["git", "push"], "main", [("origin", ["https://git.example.org/o.git"])]),
    (["git", "push"], "feature", [("origin", ["https://git.example.org/o.git"])]),  # pushRemote wins
    (["git", "push", "Up", "HEAD"], "main", [("Up", ["ssh://git@push.example/u.git"])]),  # pushurl wins
    (["git", "fetch", "Up"], "main", [("Up", ["https://up.example/u.git"])]),
    (["git", "push", "--repo=Up"], "main", [("Up", ["ssh://git@push.example/u.git"])]),
    (["git", "push", "-o", "ci.skip", "Up"], "main", [("Up", ["ssh://git@push.example/u.git"])]),
    (["git", "pull", "--depth", "1", "Up", "main"], "main", [("Up", ["https://up.example/u.git"])]),
    (["git", "pull"], "detour", [(None, ["https://alias.example/a.git"])]),  # the name is the URL
    (["git", "fetch", "https://x.example/y.git"], "main", [(None, ["https://x.example/y.git"])]),
    (["git", "fetch", "--multiple", "origin", "Up"], "main",
     [("origin", ["https://git.example.org/o.git"]), ("Up", ["https://up.example/u.git"])]),
    (["git", "fetch", "--all"], "main",
     [("origin", ["https://git.example.org/o.git"]), ("Up", ["https://up.example/u.git"])]),
    (["git", "-c", "remote.origin.url=https://extra.example/e.git", "pull"], "main",
     [("origin", ["https://git.example.org/o.git", "https://extra.example/e.git"])]),
    (["git", "ls-remote"], "main", [("origin", ["https://git.example.org/o.git"])]),
])
def test_sync_remotes(argv, branch, expected):
    assert sync_remotes(argv, CFG, branch) == expected


def test_sync_remotes_default_and_single_remote():
    only_up = [("remote.up.url", "https://up.example/u.git")]
    # no branch remote: git uses origin (newer git: the only remote) -- with no origin url, refused
    with pytest.raises(Rejected, match="remote 'origin' has no url"):
        sync_remotes(["git", "pull"], only_up, "main")
    both = only_up + [("remote.origin.url", "https://o.example/o.git")]
    assert sync_remotes(["git", "pull"], both, "main") == [("origin", ["https://o.example/o.git"])]
    single = [("remote.origin.url", "https://o.example/o.git")]
    assert sync_remotes(["git", "pull"], single, "main") == [("origin", ["https://o.example/o.git"])]


@pytest.mark.parametrize("argv, branch, why", [
    (["git", "pull"], "ghost", "remote 'ghost' has no url in the repository config"),
    (["git", "fetch", "nowhere"], "main", "remote 'nowhere' has no url"),
    (["git", "pull", "--recurse-submodules"], "main", "submodule"),
    (["git", "fetch", "--recurse-submodules=yes"], "main", "submodule"),
    (["git", "-C", "../other", "pull"], "main", "-C"),
    (["git", "--git-dir=/elsewhere", "pull"], "main", "--git-dir"),
    (["git", "remote", "update"], "main", "cannot tell which remote 'git remote' contacts"),
    (["git", "submodule", "update", "--remote"], "main", "git submodule"),
    (["sh", "-c", "git pull"], "main", "not git"),
])
def test_sync_remotes_refuses_what_it_cannot_tell(argv, branch, why):
    with pytest.raises(Rejected, match=re.escape(why)):
        sync_remotes(argv, CFG, branch)
    # controls: the same repository with plain commands is fine
    assert sync_remotes(["git", "pull", "--no-recurse-submodules"], CFG, "main")[0][0] == "origin"
    assert sync_remotes(["git", "pull", "--recurse-submodules=no"], CFG, "main")[0][0] == "origin"


def test_submodule_recursion_is_always_off():
    prefix = git_prefix(["https"], "")  # with or without a host list (issue 29: submodules' git dirs)
    for opt in ("submodule.recurse=false", "fetch.recurseSubmodules=false", "push.recurseSubmodules=no",
                "diff.ignoreSubmodules=all", "status.submoduleSummary=false"):
        assert opt in prefix


def test_the_sync_worker_gets_the_cells_proxy_as_gits_http_proxy():
    """Proxy mode: the cell record's egress_proxy goes into the worker's spec (worker_spec) and
    from there into git's http.proxy (git_prefix); without it, no proxy option at all."""
    scfg = server.merge(server.DEFAULTS, {})["sync"]
    spec = server.worker_spec(scfg, "/ws", ".", ["git", "fetch"], b"", "http://10.200.0.1:3128")
    assert spec["proxy"] == "http://10.200.0.1:3128"
    assert "proxy" not in server.worker_spec(scfg, "/ws", ".", ["git", "fetch"], b"", None)
    assert git_prefix(["https"], "", spec["proxy"])[-12:-10] == ["-c", "http.proxy=http://10.200.0.1:3128"]
    assert not any(a.startswith("http.proxy") for a in git_prefix(["https"], ""))


def test_broker_refuses_a_bad_host_entry_at_start():
    server.Broker(server.merge(server.DEFAULTS, {"sync": {"hosts": ["git.example.org", "[::1]:22"]}}))
    for bad in (["https://git.example.org"], ["host:0"], "git.example.org"):
        with pytest.raises(ValueError, match="chv_broker_sync_hosts"):
            server.Broker(server.merge(server.DEFAULTS, {"sync": {"hosts": bad}}))


def test_in_proxy_mode_only_the_protocols_git_sends_through_the_proxy(tmp_path):
    """git:// and ssh:// ignore http.proxy: in proxy mode the worker's spec keeps only http and https, so
    git refuses a git:// remote before it connects (here: to a listener on loopback, standing for another
    slot's gateway). The control: the same remote with the configured protocols and no proxy reaches it."""
    scfg = server.merge(server.DEFAULTS, {"sync": {"protocols": ["https", "http", "git", "ssh"]}})["sync"]
    proxied = server.worker_spec(scfg, "/ws", ".", ["git", "fetch"], b"", "http://10.200.0.1:3128")
    assert proxied["protocols"] == ["https", "http"]
    plain = server.worker_spec(scfg, "/ws", ".", ["git", "fetch"], b"", None)
    assert plain["protocols"] == ["https", "http", "git", "ssh"]
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        lst.settimeout(5)
        url = "git://127.0.0.1:%d/repo" % lst.getsockname()[1]
        env = {"PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "HOME": str(tmp_path)}
        refused = subprocess.run(git_prefix(proxied["protocols"], "", proxied["proxy"]) + ["ls-remote", url],
                                 env=env, capture_output=True, text=True, timeout=30, check=False)
        assert refused.returncode != 0 and "transport 'git' not allowed" in refused.stderr, refused.stderr
        lst.settimeout(0.5)
        with pytest.raises(socket.timeout):
            lst.accept()                                                  # nothing came
        control = subprocess.Popen(git_prefix(plain["protocols"], "") + ["ls-remote", url], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            lst.settimeout(10)
            conn, _peer = lst.accept()                                    # the control's connection
            conn.close()
        finally:
            control.kill()
            control.wait()
