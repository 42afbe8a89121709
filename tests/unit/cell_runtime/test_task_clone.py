"""A task's clone (broker/syncrun.py check_clone, cell/clone.py): which
URLs and refs the worker takes, how its answer becomes the task's exit
code, and the agent's --repo/--ref filter.  The clone itself runs against a
real git server in tests/integration/cells/test_task_repo_real.py."""

import json
import signal

import pytest

from chv_guest.broker import syncrun
from chv_guest.cell import agent, clone, exits

SPEC = {"workspace": "/ws", "repo": ".", "argv": ["git"], "protocols": ["https", "http"], "hosts": []}


def check(url, ref=None, **over):
    targets = set()
    got = syncrun.check_clone(dict(SPEC, **over), {"url": url, "ref": ref}, targets)
    return got, targets


def test_a_plain_url_and_ref_pass_with_their_target():
    assert check("http://git.test:8080/r.git", "main") == (("http://git.test:8080/r.git", "main"),
                                                          {("http", "git.test", 8080)})
    assert check("https://git.test/a/r.git")[1] == {("https", "git.test", 443)}
    # the host allow-list: a listed host passes (control), another is refused
    assert check("https://git.test/r.git", hosts=["git.test"])[0][0] == "https://git.test/r.git"
    with pytest.raises(syncrun.Rejected, match="not in chv_broker_sync_hosts"):
        check("https://other.test/r.git", hosts=["git.test"])


@pytest.mark.parametrize("url, says", [
    ("https://user:tok3n@git.test/r.git", "user name, password"),
    ("https://user@git.test/r.git", "user name, password"),
    ("https://git.test/r.git?x=1", "query"),
    ("HTTPS://git.test/r.git", "upper-case"),
    ("file:///srv/r.git", "file:// URLs"),
    ("/srv/r.git", "local paths"),
    ("ext::sh", "remote helper"),
    ("ssh://git.test/r.git", "protocol ssh is not allowed"),
    ("git://git.test/r.git", "protocol git is not allowed"),
])
def test_urls_refused_without_showing_a_credential(url, says):
    with pytest.raises(syncrun.Rejected) as exc:
        check(url)
    assert says in str(exc.value) and "tok3n" not in str(exc.value)
    assert str(exc.value).startswith("clone URL")


@pytest.mark.parametrize("ref", ["-b", "--upload-pack=x", "a..b", "main.lock", "a/", "x y", "", "@{-1}", "m~1"])
def test_refs_refused(ref):
    with pytest.raises(syncrun.Rejected, match="clone ref"):
        check("https://git.test/r.git", ref)


def test_refs_allowed():
    for ref in ("main", "feature/x-1", "v1.2.3", "0123456789abcdef0123456789abcdef01234567"):
        assert check("https://git.test/r.git", ref)[0][1] == ref


def result(rc, out, err=b"", ended=None, truncated=False):
    return {"returncode": rc, "stdout": out, "stderr": err, "ended": ended, "truncated": truncated}


def test_the_workers_answer_becomes_the_exit_code():
    ok = json.dumps({"cloned": {"head": "ab" * 20, "branch": "main"}}).encode() + b"\n"
    assert clone.clone_result(result(0, ok), 60, "https://g/r") == {"head": "ab" * 20, "branch": "main",
                                                                    "url": "https://g/r"}
    for answer, code in (("git clone failed: fatal: repository not found", clone.EXIT_CLONE),
                         ("clone URL https://g/r: protocol", exits.EXIT_CONFIG),
                         ("clone ref '-x' is not", exits.EXIT_CONFIG),
                         ("the sync worker's mount namespace could not be made", exits.EXIT_SETUP)):
        with pytest.raises(clone.CloneError) as exc:
            clone.clone_result(result(120, json.dumps({"rejected": answer}).encode()), 60, "u")
        assert exc.value.code == code and answer in str(exc.value)
    with pytest.raises(clone.CloneError) as exc:
        clone.clone_result(result(1, b"", b"Traceback"), 60, "u")
    assert exc.value.code == clone.EXIT_CLONE and "without an answer" in str(exc.value)
    with pytest.raises(clone.CloneError, match="timed out"):
        clone.clone_result(result(-9, b"", ended="timeout"), 60, "u")


def test_no_clone_without_a_broker_configuration(policy):
    with pytest.raises(clone.CloneError) as exc:
        clone.load_sync_config(dict(policy, broker_config=""))
    assert exc.value.code == exits.EXIT_CONFIG
    with pytest.raises(clone.CloneError, match="cannot be read"):
        clone.load_sync_config(dict(policy, broker_config="/nonexistent/broker.json"))


def test_the_agent_takes_repo_and_ref_on_task_start_only():
    req = agent.parse_agent_args(["task", "start", "--repo", "https://g/r.git", "--ref=main", "--ttl", "60"])
    assert (req.repo, req.ref, req.ttl) == ("https://g/r.git", "main", 60.0)
    assert agent.parse_agent_args(agent.render_agent_args(req)) == req
    for args, says in ((["task", "start", "--ref", "main"], "--ref goes with --repo"),
                       (["task", "start", "--repo", "-x"], "--repo must be a URL"),
                       (["task", "start", "--repo", "https://g/a b"], "--repo must be a URL"),
                       (["task", "start", "--repo", "u", "--ref", "--x"], "not a plain branch"),
                       (["task", "start", "--repo", "u", "--repo", "v"], "--repo given twice"),
                       (["run", "--repo", "u", "--", "true"], "'--repo' is not allowed")):
        with pytest.raises(agent.Refused, match=says):
            agent.parse_agent_args(args)


def test_a_failed_clone_leaves_the_slot_emptied_and_free(task_policy, monkeypatch):
    from chv_guest.cell import taskrec, tasks

    emptied = []
    monkeypatch.setattr(tasks, "empty_slot", lambda pol, slot: emptied.append(slot["name"]))

    def failing(pol, slot, url, ref):
        raise clone.CloneError(clone.EXIT_CLONE, "git clone failed: fatal: repository not found")

    monkeypatch.setattr(clone, "clone_into", failing)
    out = []
    assert tasks.command(task_policy, "start", 1000, repo=("https://g/r.git", None), out=out.append) == clone.EXIT_CLONE
    assert out == [] and taskrec.all_records(task_policy) == [] and emptied == ["slot0", "slot0"]
    # control: a clone that works gives the task its repository, printed and listed
    monkeypatch.setattr(clone, "clone_into", lambda pol, slot, url, ref: {"url": url, "head": "ab" * 20,
                                                                           "branch": ref})
    assert tasks.command(task_policy, "start", 1000, repo=("https://g/r.git", "main"), out=out.append) == 0
    started = json.loads(out[0])
    assert started["repo"] == {"url": "https://g/r.git", "head": "ab" * 20, "branch": "main"}
    assert [t["repo"] for t in tasks.listing(task_policy, 1000)] == [started["repo"]]


def test_policy_broker_config_is_a_path_or_empty(raw_policy):
    from chv_guest.cell import policy as policymod

    for ok in ("/etc/chv-fleet/broker.json", ""):
        assert policymod.validate(dict(raw_policy, broker_config=ok)) == []
    for bad in ("broker.json", "/", 7, "/etc/../x"):
        assert any("broker_config" in e for e in policymod.validate(dict(raw_policy, broker_config=bad))), bad


def _fake_ip(tmp_path, rc):
    """An ``ip`` that logs its arguments and exits ``rc`` (the policy's "ip")."""
    log = tmp_path / "ip.log"
    exe = tmp_path / "ip"
    exe.write_text("#!/bin/sh\necho \"$*\" >> %s\necho 'RTNETLINK answers: File exists' >&2\nexit %d\n" % (log, rc))
    exe.chmod(0o755)
    return str(exe), log


def test_in_proxy_mode_the_slots_gateway_is_on_loopback_for_the_clone_only(policy, tmp_path):
    """The clone's git reaches the slot's proxy on the slot's gateway, which
    no veth holds before the task's first cell: the address is put on lo
    for the clone's length and removed after, also when the clone fails."""
    slot = policy["slots"][0]
    exe, log = _fake_ip(tmp_path, 0)
    proxied = dict(policy, ip=exe, egress_proxy={"port": 3128})
    with clone.door_gateway(proxied, slot):
        assert log.read_text().splitlines() == ["addr replace %s/32 dev lo" % slot["gateway"]]
    with pytest.raises(RuntimeError):
        with clone.door_gateway(proxied, slot):
            raise RuntimeError("the worker failed")
    assert log.read_text().splitlines() == ["addr replace %s/32 dev lo" % slot["gateway"],
                                            "addr del %s/32 dev lo" % slot["gateway"]] * 2
    # outside proxy mode: nothing
    log.unlink()
    with clone.door_gateway(dict(policy, ip=exe, egress_proxy=None), slot):
        pass
    assert not log.exists()
    # the address refused: the guest's fault (125), and the clone does not run
    (tmp_path / "refusing").mkdir()
    exe, log = _fake_ip(tmp_path / "refusing", 1)
    ran = []
    with pytest.raises(clone.CloneError) as exc:
        with clone.door_gateway(dict(proxied, ip=exe), slot):
            ran.append(1)
    assert exc.value.code == exits.EXIT_SETUP and "File exists" in str(exc.value) and ran == []
    # ... and the delete follows all the same (a partial add leaves nothing)
    assert log.read_text().splitlines()[-1] == "addr del %s/32 dev lo" % slot["gateway"]


def test_a_signal_during_the_delete_waits_until_the_address_is_gone(policy, tmp_path):
    """A start's SIGTERM becomes StartStopped (tasks.stop_signals); during
    release_gateway's delete it is held, then delivered after it."""
    slot = policy["slots"][0]
    log = tmp_path / "ip.log"
    exe = tmp_path / "ip"
    # the ip of this test signals its parent (this process) in the middle of its run
    exe.write_text("#!/bin/sh\nkill -TERM $PPID\nsleep 0.2\necho \"$*\" >> %s\n" % log)
    exe.chmod(0o755)
    got = []

    def stopped(signum, _frame):
        got.append(log.read_text().splitlines())
        raise RuntimeError("stopped")

    old = signal.signal(signal.SIGTERM, stopped)
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            clone.release_gateway(dict(policy, ip=str(exe), egress_proxy={"port": 3128}), slot)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert got == [["addr del %s/32 dev lo" % slot["gateway"]]]       # delivered after the delete, not in it


def test_emptying_a_slot_takes_a_killed_clones_gateway_off_the_loopback(task_policy, monkeypatch, tmp_path):
    """A start killed with SIGKILL cannot run door_gateway's removal: the
    slot's emptying (task end, reap, an abandoned start) does it, in proxy
    mode only, after the slot's cell is reaped and its files are emptied."""
    from chv_guest.cell import doors, runner, tasks, taskrec

    order = []
    monkeypatch.setattr(runner.Launcher, "reap", lambda self, slot, scope: order.append("reap"))
    monkeypatch.setattr(tasks.host, "resolve_scope", lambda pol: "scope")
    monkeypatch.setattr(taskrec, "wipe_contents", lambda path: order.append("wipe"))
    monkeypatch.setattr(doors, "end_browser_slot", lambda sock, name: ("ended", ""))
    monkeypatch.setattr(tasks, "ensure_slot_dir", lambda path, uid: None)
    exe, log = _fake_ip(tmp_path, 0)
    slot = task_policy["slots"][0]
    tasks.empty_slot(dict(task_policy, ip=exe, egress_proxy={"port": 3128}), slot)
    assert log.read_text().splitlines() == ["addr del %s/32 dev lo" % slot["gateway"]]
    assert order == ["reap", "wipe", "wipe", "wipe"]
    log.unlink()
    tasks.empty_slot(dict(task_policy, ip=exe, egress_proxy=None), slot)     # cidr mode: no ip run
    assert not log.exists()
