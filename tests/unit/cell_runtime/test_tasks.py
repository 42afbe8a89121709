"""Tasks (chv_guest/cell/taskrec.py, tasks.py): ids, records, the expiry
decision, ownership, the lifecycle with the slot's emptying faked, and
emptying a directory without following what a cell planted there."""

import json
import os
import stat

import pytest

from chv_guest.cell import claim as claimmod
from chv_guest.cell import exits, runner, taskrec, tasks
from chv_guest.cell import argv as argvmod

OWNER, OTHER = 1000, 1001


@pytest.fixture
def pol(task_policy):
    p = task_policy
    return p


@pytest.fixture
def emptied(monkeypatch):
    """tasks.empty_slot faked: the slots emptied, in order."""
    got = []
    monkeypatch.setattr(tasks, "empty_slot", lambda pol, slot: got.append(slot["name"]))
    return got


# ---------------------------------------------------------------- records
def test_ids_are_random_and_strictly_shaped():
    ids = {taskrec.new_id() for dummy in range(200)}
    assert len(ids) == 200 and all(taskrec.valid_id(i) and len(i) == 32 for i in ids)
    for bad in ("", "../x", "A" * 32, "0" * 31, "0" * 33, "0" * 32 + "\n", "g" * 32):
        assert not taskrec.valid_id(bad)
        with pytest.raises(ValueError):
            taskrec.record_path({"state_dir": "/run/x"}, bad)


def test_expiry_decision():
    rec = taskrec.new_record("0" * 32, "slot0", OWNER, 10.0, 1000.0)
    assert taskrec.expires(rec) == 1010.0
    assert not taskrec.expired(rec, 1010.0)  # control
    assert taskrec.expired(rec, 1010.1)
    assert taskrec.expired(dict(rec, ending=True), 1000.0)  # an end that did not finish


def test_only_the_owner_and_root_may_use_a_task():
    rec = taskrec.new_record("0" * 32, "slot0", OWNER, 10.0, 0.0)
    assert taskrec.may_use(rec, OWNER) and taskrec.may_use(rec, 0)
    assert not taskrec.may_use(rec, OTHER)


def test_records_round_trip_and_reserve_their_slot(pol):
    rec = taskrec.new_record(taskrec.new_id(), "slot1", OWNER, 10.0, 5.0)
    taskrec.write(pol, rec)
    path = taskrec.record_path(pol, rec["task"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert taskrec.read(pol, rec["task"]) == rec
    assert taskrec.reserved_by(pol, "slot1") == rec["task"]
    assert taskrec.reserved_by(pol, "slot0") is None
    taskrec.remove(pol, rec["task"])
    assert taskrec.read(pol, rec["task"]) is None and taskrec.reserved_by(pol, "slot1") is None


def test_a_planted_or_broken_record_is_no_task(pol):
    tid = taskrec.new_id()
    os.makedirs(taskrec.tasks_dir(pol))
    target = os.path.join(pol["state_dir"], "elsewhere.json")
    with open(target, "w") as fh:
        json.dump(taskrec.new_record(tid, "slot0", OWNER, 10.0, 0.0), fh)
    os.symlink(target, taskrec.record_path(pol, tid))
    assert taskrec.read(pol, tid) is None  # never followed
    os.unlink(taskrec.record_path(pol, tid))
    with open(taskrec.record_path(pol, tid), "w") as fh:
        fh.write('{"task": "%s", "slot": "slot0"}' % tid)  # no owner
    assert taskrec.read(pol, tid) is None and taskrec.all_records(pol) == []


# ---------------------------------------------------------------- wiping
def _tree(root, outside):
    """A slot directory with what a cell could plant: links out, a FIFO, a
    hard link, a socket-free deep tree, unreadable directories."""
    os.makedirs(os.path.join(root, "a", "b"))
    with open(os.path.join(root, "a", "b", "f"), "w") as fh:
        fh.write("x")
    os.symlink(outside, os.path.join(root, "link-to-dir"))
    os.symlink(os.path.join(outside, "keep"), os.path.join(root, "link-to-file"))
    os.symlink("/nonexistent", os.path.join(root, "dangling"))
    os.mkfifo(os.path.join(root, "fifo"))
    os.link(os.path.join(outside, "keep"), os.path.join(root, "hard"))
    locked = os.path.join(root, "locked")
    os.mkdir(locked)
    open(os.path.join(locked, "g"), "w").close()
    os.chmod(locked, 0)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for dummy in range(1200):  # deeper than Python's recursion limit and PATH_MAX
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)


def test_wipe_empties_without_following_anything(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    root = str(tmp_path / "slot")
    _tree(root, str(outside))
    before = os.stat(root)
    assert taskrec.wipe_contents(root) > 1200
    assert os.listdir(root) == []
    after = os.stat(root)
    assert (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev)  # the directory itself stays
    # nothing a link pointed to was touched
    assert sorted(os.listdir(outside)) == ["keep"] and (outside / "keep").read_text() == "mine"
    assert os.stat(outside / "keep").st_nlink == 1


def test_wipe_refuses_a_symlinked_top_and_ignores_a_missing_one(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep").write_text("x")
    os.symlink(str(real), str(tmp_path / "slot"))
    with pytest.raises(taskrec.WipeError):
        taskrec.wipe_contents(str(tmp_path / "slot"))
    assert os.listdir(real) == ["keep"]
    assert taskrec.wipe_contents(str(tmp_path / "missing")) == 0


@pytest.mark.skipif(not os.path.ismount("/proc"), reason="needs /proc mounted")
def test_wipe_stops_at_another_file_system(tmp_path, monkeypatch):
    """A directory of another device (a mount point) is refused, not entered."""
    root = tmp_path / "slot"
    (root / "mnt").mkdir(parents=True)
    real_stat = os.stat

    def fake_stat(path, *a, dir_fd=None, follow_symlinks=True):
        st = real_stat(path, *a, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        if path == "mnt":
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1) + tuple(st)[3:])
        return st

    monkeypatch.setattr(taskrec.os, "stat", fake_stat)
    with pytest.raises(taskrec.WipeError, match="another file system"):
        taskrec.wipe_contents(str(root))
    assert os.path.isdir(root / "mnt")


# ---------------------------------------------------------------- lifecycle
def test_start_takes_a_free_cold_slot_and_records_the_owner(pol, emptied):
    pol["warm_slots"] = ["slot1"]
    got = tasks.start(pol, OWNER)
    assert got["slot"] == "slot0" and taskrec.valid_id(got["task"])
    assert got["home"] == pol["agent_state_mount"] and got["workspace"] == pol["workspace_mount"]
    assert got["expires"] == pytest.approx(got["last_used"] + 100.0)
    assert emptied == ["slot0"]  # emptied before it is recorded
    assert taskrec.read(pol, got["task"])["owner"] == OWNER
    # slot0 is the task's, slot1 warm: no slot for a second task
    with pytest.raises(tasks.TaskError) as exc:
        tasks.start(pol, OWNER)
    assert exc.value.code == exits.EXIT_BUSY
    pol["warm_slots"] = []
    assert tasks.start(pol, OTHER)["slot"] == "slot1"  # control: a free cold slot is given


def test_start_waits_out_a_busy_slot_and_refuses_a_ttl_above_the_policy(pol, emptied):
    held = [claimmod.try_claim(argvmod.cell_paths(pol, s)["lock"]) for s in pol["slots"]]
    try:
        with pytest.raises(tasks.TaskError) as exc:
            tasks.start(pol, OWNER)
        assert exc.value.code == exits.EXIT_BUSY
    finally:
        for h in held:
            h.release()
    with pytest.raises(tasks.TaskError) as exc:
        tasks.start(pol, OWNER, ttl=101)
    assert exc.value.code == exits.EXIT_CONFIG and "task_ttl" in str(exc.value)
    assert tasks.start(pol, OWNER, ttl=5)["ttl"] == 5.0


def test_only_the_owner_ends_a_task(pol, emptied):
    t = tasks.start(pol, OWNER)["task"]
    for uid, tid in ((OTHER, t), (OWNER, "f" * 32), (OWNER, "../x")):
        with pytest.raises(tasks.TaskError) as exc:
            tasks.end(pol, tid, uid)
        assert exc.value.code == exits.EXIT_NO_TASK and tid in str(exc.value)
        assert "no such task of yours" in str(exc.value)
    assert taskrec.read(pol, t) is not None
    assert tasks.end(pol, t, OWNER) == {"task": t, "slot": "slot0", "ended": True}
    assert taskrec.read(pol, t) is None and emptied == ["slot0", "slot0"]
    with pytest.raises(tasks.TaskError) as exc:
        tasks.end(pol, t, OWNER)
    assert exc.value.code == exits.EXIT_NO_TASK


def test_end_waits_for_a_running_turn(pol, emptied):
    t = tasks.start(pol, OWNER)
    held = claimmod.try_claim(argvmod.cell_paths(pol, pol["slots"][0])["lock"])
    try:
        with pytest.raises(tasks.TaskError) as exc:
            tasks.end(pol, t["task"], OWNER, timeout=0.1)
        assert exc.value.code == exits.EXIT_BUSY and "a turn still runs" in str(exc.value)
    finally:
        held.release()
    assert taskrec.read(pol, t["task"]) is not None


def test_expired_tasks_are_reaped_unless_a_turn_runs(pol, emptied):
    a = tasks.start(pol, OWNER, ttl=10)
    b = tasks.start(pol, OTHER, ttl=50)
    now = a["last_used"] + 20
    held = claimmod.try_claim(argvmod.cell_paths(pol, pol["slots"][0])["lock"])
    try:
        assert tasks.reap(pol, now=now, logf=lambda m: None) == []  # a turn of a runs: not reaped
    finally:
        held.release()
    assert tasks.reap(pol, now=now, logf=lambda m: None) == [a["task"]]
    assert taskrec.read(pol, a["task"]) is None and taskrec.read(pol, b["task"]) is not None  # control
    # its owner (and only its owner) learns it expired, after the reap too
    for uid, code in ((OWNER, exits.EXIT_TASK_EXPIRED), (OTHER, exits.EXIT_NO_TASK)):
        with pytest.raises(tasks.TaskError) as exc:
            tasks.owned(pol, a["task"], uid)
        assert exc.value.code == code
    with pytest.raises(tasks.TaskError) as exc:
        tasks.end(pol, a["task"], OWNER)
    assert exc.value.code == exits.EXIT_TASK_EXPIRED and "expired" in str(exc.value)
    old = taskrec.tombstone_path(pol, a["task"])
    os.utime(old, (1, 1))
    taskrec.prune_tombstones(pol, now)
    assert not os.path.exists(old)


def test_owned_names_the_reason(pol, emptied):
    t = tasks.start(pol, OWNER, ttl=10)
    assert tasks.owned(pol, t["task"], OWNER, now=t["last_used"] + 1)["slot"] == "slot0"
    with pytest.raises(tasks.TaskError) as exc:
        tasks.owned(pol, t["task"], OTHER, now=t["last_used"] + 1)
    assert exc.value.code == exits.EXIT_NO_TASK
    held = claimmod.try_claim(argvmod.cell_paths(pol, pol["slots"][0])["lock"])
    try:  # a turn of it runs longer than its ttl: in use, not expired
        assert tasks.owned(pol, t["task"], OWNER, now=t["last_used"] + 11)["task"] == t["task"]
    finally:
        held.release()
    with pytest.raises(tasks.TaskError) as exc:
        tasks.owned(pol, t["task"], OWNER, now=t["last_used"] + 11)
    assert exc.value.code == exits.EXIT_TASK_EXPIRED and t["task"] in str(exc.value)
    assert taskrec.read(pol, t["task"]) is None  # torn down


def test_touch_moves_the_expiry(pol, emptied, monkeypatch):
    t = tasks.start(pol, OWNER, ttl=10)
    monkeypatch.setattr(taskrec.time, "time", lambda: t["last_used"] + 9)
    taskrec.touch(pol, t["task"])
    assert taskrec.read(pol, t["task"])["last_used"] == pytest.approx(t["last_used"] + 9)


def test_listing_is_per_owner(pol, emptied):
    a = tasks.start(pol, OWNER)["task"]
    b = tasks.start(pol, OTHER)["task"]
    assert [r["task"] for r in tasks.listing(pol, OWNER)] == [a]
    assert [r["task"] for r in tasks.listing(pol, OTHER)] == [b]
    assert sorted(r["task"] for r in tasks.listing(pol, 0)) == sorted([a, b])


def test_plain_runs_skip_a_tasks_slot_and_a_turn_takes_only_its_own(pol, emptied):
    t = tasks.start(pol, OWNER)["task"]
    locks = [(s, argvmod.cell_paths(pol, s)["lock"]) for s in pol["slots"]]
    plain = runner.Launcher(pol)
    slot, held = plain._claim_open(locks)
    assert slot["name"] == "slot1"  # slot0 is the task's
    held.release()
    with pytest.raises(claimmod.SlotBusy):
        plain._claim_open(locks[:1])
    turn = runner.Launcher(pol)
    turn.task_id = t
    slot, held = turn._claim_open(locks[:1])
    assert slot["name"] == "slot0"
    held.release()
    tasks.end(pol, t, OWNER)
    with pytest.raises(runner.TaskGone):
        turn._claim_open(locks[:1])
    slot, held = plain._claim_open(locks[:1])  # control: the ended task's slot is free again
    held.release()


def test_command_prints_json_and_exits_with_the_reason(pol, emptied, capsys):
    out = []
    assert tasks.command(pol, "start", OWNER, out=out.append) == 0
    rec = json.loads(out[0])
    assert set(rec) >= {"task", "slot", "home", "workspace", "expires"}
    assert tasks.command(pol, "end", OTHER, rec["task"], out=out.append) == exits.EXIT_NO_TASK
    assert "task %s: no such task of yours" % rec["task"] in capsys.readouterr().err
    assert tasks.command(pol, "list", OWNER, out=out.append) == 0 and json.loads(out[-1])[0]["task"] == rec["task"]


def test_a_non_root_task_command_goes_to_sudo_or_is_refused_before(monkeypatch):
    from chv_guest.cell import agent, cli

    calls = []
    monkeypatch.setattr(agent, "delegate", lambda *a: calls.append(a) or 0)
    assert cli.main(["task", "list"], euid=1000) == 0
    assert calls == [(False, False, "task", ["list"])]
    monkeypatch.undo()
    # the wrapper's own filter: refused with 78, sudo never asked
    monkeypatch.setattr(agent, "sudo_problem", lambda *a: pytest.fail("sudo asked"))
    for args in (["task", "reap"], ["task", "end", "x"], ["--policy", "/x", "task", "list"]):
        assert cli.main(args, euid=1000) == exits.EXIT_CONFIG, args


def test_read_of_a_tasks_slot_is_its_owners(pol, emptied, tmp_path):
    from chv_guest.cell import actions, agent

    t = tasks.start(pol, OWNER)
    ws = os.path.join(pol["workspace_root"], t["slot"])
    os.makedirs(ws, exist_ok=True)
    with open(os.path.join(ws, "r.txt"), "w") as fh:
        fh.write("result\n")
    uid = next(s["uid_base"] for s in pol["slots"] if s["name"] == t["slot"])
    for p in (ws, os.path.join(ws, "r.txt")):
        os.chown(p, uid, uid)
    req = agent.AgentRequest("read", t["slot"], None, None, False, False, [], None, "r.txt")
    assert actions.read_request(pol, req, OTHER) == exits.EXIT_NO_TASK
    # control: the owner and root read it
    for who in (OWNER, 0):
        assert actions.read_request(pol, req, who) == 0


def test_a_cordon_stops_new_tasks_not_the_turns_of_a_started_one(pol, emptied, monkeypatch):
    from chv_guest.cell import actions
    from chv_guest.cell import cordon as cordonmod

    t = tasks.start(pol, OWNER)["task"]  # control: started before the cordon
    cordonmod.set_cordon(pol["state_dir"], "rollout 42", "ops")
    with pytest.raises(tasks.TaskError) as exc:
        tasks.start(pol, OWNER)
    assert exc.value.code == exits.EXIT_CORDONED and "rollout 42" in str(exc.value)
    seen = []
    monkeypatch.setattr(runner.Launcher, "run",
                        lambda self, cmd, slot_name=None, **kw: seen.append((slot_name, self.ignore_cordon)) or 0)
    assert actions.start_run(pol, ["true"], None, None, False, None, None, task=t, caller_uid=OWNER) == 0
    assert seen == [("slot0", True)]  # the task's turn goes on, in its slot
    assert actions.start_run(pol, ["true"], None, None, False, None, None) == 0
    assert seen[-1] == (None, False)  # control: a plain run still meets the cordon
    cordonmod.clear(pol["state_dir"])
    assert tasks.start(pol, OTHER)["slot"] == "slot1"  # uncordoned: new tasks again


# ---------------------------------------------------------------- a start between tenants
def test_the_slot_is_the_owners_before_a_byte_of_the_task_is_in_it(pol, monkeypatch, tmp_path):
    """The record first: while the start empties and fills the slot, another user's read finds it owned
    (hostile-tenant review: a read looped beside a start got the clone as it arrived)."""
    from chv_guest.cell import actions, agent

    seen = []
    req = agent.AgentRequest("read", "slot0", None, None, False, False, [], None, "r.txt")

    def filling(p, slot):
        seen.append((taskrec.reserved_by(p, slot["name"]) is not None, actions.read_request(p, req, OTHER)))

    monkeypatch.setattr(tasks, "empty_slot", filling)
    t = tasks.start(pol, OWNER)
    assert seen == [(True, exits.EXIT_NO_TASK)]
    rec = taskrec.read(pol, t["task"])
    assert "starting" not in rec and rec["owner"] == OWNER
    # control: with no task in the slot, the same read by the same user is not refused for ownership
    tasks.end(pol, t["task"], OWNER)
    assert actions.read_request(pol, req, OTHER) != exits.EXIT_NO_TASK


def test_a_read_looks_at_the_owner_again_once_the_file_is_open(pol, emptied, monkeypatch, capfd):
    """A task that takes the slot between a read's first look and its open: nothing is copied."""
    from chv_guest.cell import actions, agent, slotfiles

    ws = os.path.join(pol["workspace_root"], "slot0")
    os.makedirs(ws, exist_ok=True)
    with open(os.path.join(ws, "r.txt"), "w") as fh:
        fh.write("the task's secret\n")
    uid = pol["slots"][0]["uid_base"]
    for p in (ws, os.path.join(ws, "r.txt")):
        os.chown(p, uid, uid)
    req = agent.AgentRequest("read", "slot0", None, None, False, False, [], None, "r.txt")
    real_open = slotfiles.open_slot_file
    started = []

    def open_then_start(*a, **kw):
        got = real_open(*a, **kw)
        if not started:
            started.append(tasks.start(pol, OWNER))  # the task arrives after the look, before the copy
        return got

    monkeypatch.setattr(slotfiles, "open_slot_file", open_then_start)
    capfd.readouterr()
    assert actions.read_request(pol, req, OTHER) == exits.EXIT_NO_TASK
    assert "secret" not in capfd.readouterr().out
    # control: the owner's read of the same file copies it
    assert actions.read_request(pol, req, OWNER) == 0
    assert "the task's secret" in capfd.readouterr().out


@pytest.mark.parametrize("signum", [15, 1, 2])
def test_a_start_stopped_by_a_signal_empties_the_slot_and_frees_it(pol, monkeypatch, signum):
    """sudo relays the executor's SIGTERM, SIGHUP (a dropped SSH) and SIGINT to task start: the start
    stops, its slot is emptied again and free, its record and variables gone."""
    calls = []

    def empty(p, slot):
        calls.append(slot["name"])
        if len(calls) == 1:
            os.kill(os.getpid(), signum)  # arrives while the slot is being filled

    monkeypatch.setattr(tasks, "empty_slot", empty)
    with pytest.raises(tasks.StartStopped) as exc:
        tasks.start(pol, OWNER, env={"A": "1"})
    assert exc.value.code == exits.EXIT_SETUP and str(signum) in str(exc.value)
    assert calls == ["slot0", "slot0"] and taskrec.all_records(pol) == []
    assert os.listdir(taskrec.tasks_dir(pol)) == []  # no variables left either
    assert tasks.start(pol, OWNER)["slot"] == "slot0"  # control: free again, and signals as before
    import signal as sig
    assert sig.getsignal(signum) in (sig.SIG_DFL, sig.default_int_handler)


def test_a_start_that_died_leaves_a_starting_record_the_next_reap_tears_down(pol, emptied):
    rec = dict(taskrec.new_record(taskrec.new_id(), "slot0", OWNER, 100.0, 1e12), starting=True)
    taskrec.write(pol, rec)
    assert taskrec.reserved_by(pol, "slot0") == rec["task"]  # the slot stays its owner's meanwhile
    held = claimmod.try_claim(argvmod.cell_paths(pol, pol["slots"][0])["lock"])
    try:
        assert tasks.reap(pol) == []  # control: its start still holds the lock
    finally:
        held.release()
    assert tasks.reap(pol) == [rec["task"]] and emptied == ["slot0"]
    assert taskrec.reserved_by(pol, "slot0") is None


def test_the_health_gates_slot_is_never_a_tasks(pol, emptied):
    pol["health_slot"] = "slot0"
    assert tasks.start(pol, OWNER)["slot"] == "slot1"
    with pytest.raises(tasks.TaskError) as exc:
        tasks.start(pol, OWNER)
    assert exc.value.code == exits.EXIT_BUSY
    pol["health_slot"] = ""
    assert tasks.start(pol, OWNER)["slot"] == "slot0"  # control
