"""chv-browser's screenshot quota and its answer to a file system that refuses a screenshot.

policy.shots_to_prune is pure and tested on lists; Engine.op_screenshot is
run on the Engine's own (never started) loop with a stand-in page that
returns fixed PNG bytes, so the files it writes, prunes and leaves behind
are real; a full disk is an os.write that fails part way with ENOSPC
(tests/integration/browser/test_browser_shots.py fills a real tmpfs).
"""
import errno
import json
import os
import socket

import pytest
from hypothesis import given, settings, strategies as st

from chv_guest.browser import policy, server
from chv_guest.wire import wire

SLOT = "slot0"


# ------------------------------------------------------------------ the pure quota
def test_a_slot_within_its_quota_loses_nothing():
    shots = [("a.png", 100, 1.0), ("b.png", 100, 2.0), ("c.png", 100, 3.0)]
    assert policy.shots_to_prune(shots, keep=3, max_bytes=300) == []
    assert policy.shots_to_prune([], keep=1, max_bytes=1) == []
    assert policy.shots_to_prune([], keep=1, max_bytes=1, incoming=1) == []


def test_the_oldest_by_mtime_go_first_until_the_count_fits():
    # names in the reverse order of their times: the order is the mtime's, not the name's
    shots = [("e.png", 10, 1.0), ("d.png", 10, 2.0), ("c.png", 10, 3.0), ("b.png", 10, 4.0), ("a.png", 10, 5.0)]
    assert policy.shots_to_prune(shots, keep=3, max_bytes=10 ** 6) == ["e.png", "d.png"]
    assert policy.shots_to_prune(list(reversed(shots)), keep=3, max_bytes=10 ** 6) == ["e.png", "d.png"]
    assert policy.shots_to_prune(shots, keep=1, max_bytes=10 ** 6) == ["e.png", "d.png", "c.png", "b.png"]


def test_the_oldest_go_first_until_the_bytes_fit():
    shots = [("new.png", 300, 9.0), ("old.png", 500, 1.0), ("mid.png", 200, 5.0)]
    assert policy.shots_to_prune(shots, keep=10, max_bytes=1000) == []  # 1000 bytes: at the limit
    assert policy.shots_to_prune(shots, keep=10, max_bytes=999) == ["old.png"]
    assert policy.shots_to_prune(shots, keep=10, max_bytes=499) == ["old.png", "mid.png"]


def test_mtime_ties_are_broken_by_name():
    shots = [("b.png", 1, 7.0), ("a.png", 1, 7.0), ("c.png", 1, 7.0)]
    assert policy.shots_to_prune(shots, keep=1, max_bytes=10) == ["a.png", "b.png"]


def test_room_is_made_for_the_screenshot_about_to_be_written():
    shots = [("a.png", 100, 1.0), ("b.png", 100, 2.0), ("c.png", 100, 3.0)]
    # at its quota of 3: one goes so that the new one makes 3
    assert policy.shots_to_prune(shots, keep=3, max_bytes=10 ** 6, incoming=100) == ["a.png"]
    assert policy.shots_to_prune(shots, keep=4, max_bytes=10 ** 6, incoming=100) == []
    # bytes: 300 kept + 150 coming > 400
    assert policy.shots_to_prune(shots, keep=10, max_bytes=400, incoming=150) == ["a.png"]
    assert policy.shots_to_prune(shots, keep=10, max_bytes=450, incoming=150) == []
    # keep 1: every other one goes; one larger than the quota alone: everything else goes
    assert policy.shots_to_prune(shots, keep=1, max_bytes=10 ** 6, incoming=1) == ["a.png", "b.png", "c.png"]
    assert policy.shots_to_prune(shots, keep=10, max_bytes=50, incoming=60) == ["a.png", "b.png", "c.png"]


shot_lists = st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 50)), max_size=12).map(
    lambda items: [("s%d.png" % i, size, float(mtime)) for i, (size, mtime) in enumerate(items)])


@settings(max_examples=300, deadline=None)
@given(shots=shot_lists, keep=st.integers(1, 6), max_bytes=st.integers(1, 6000),
       incoming=st.none() | st.integers(1, 3000))
def test_pruning_removes_exactly_the_oldest_that_must_go(shots, keep, max_bytes, incoming):
    removed = policy.shots_to_prune(shots, keep, max_bytes, incoming=incoming)
    assert len(set(removed)) == len(removed)
    kept = [s for s in shots if s[0] not in removed]
    extra_count, extra_bytes = (0, 0) if incoming is None else (1, incoming)

    def fits(rest):
        return len(rest) + extra_count <= keep and sum(s[1] for s in rest) + extra_bytes <= max_bytes

    if kept:  # within the quota, unless everything went (a new one over max_bytes alone)
        assert fits(kept)
    order = sorted(shots, key=lambda s: (s[2], s[0]))
    assert removed == [s[0] for s in order][:len(removed)]  # the oldest, oldest first
    if removed:  # none more than needed: keeping the last one removed would not fit
        last = next(s for s in shots if s[0] == removed[-1])
        assert not fits(kept + [last])


# ------------------------------------------------------------------ which files count
def test_only_screenshot_names_count():
    assert all(policy.is_shot_file(n) for n in ("a.png", "front.v2.png", "A_b-c.png"))
    for name in ("filler", ".a.png.tmp", "a.png.tmp", "a.PNG", ".png", "..png", "a..b.png", "-a.png", "x" * 65 + ".png",
                 None, 3):
        assert not policy.is_shot_file(name), name


def test_list_shots_takes_only_regular_png_files_of_the_service(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x" * 7)
    (tmp_path / "notes.txt").write_bytes(b"x")
    (tmp_path / ".b.png.tmp").write_bytes(b"x")
    (tmp_path / "link.png").symlink_to(tmp_path / "a.png")
    (tmp_path / "dir.png").mkdir()
    os.utime(tmp_path / "a.png", (100.0, 123.0))
    assert server.list_shots(str(tmp_path)) == [("a.png", 7, 123.0)]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_list_shots_leaves_files_of_other_owners(tmp_path):
    (tmp_path / "mine.png").write_bytes(b"x")
    (tmp_path / "theirs.png").write_bytes(b"x")
    assert sorted(s[0] for s in server.list_shots(str(tmp_path))) == ["mine.png", "theirs.png"]  # the control
    os.chown(tmp_path / "theirs.png", 65534, 65534)
    assert [s[0] for s in server.list_shots(str(tmp_path))] == ["mine.png"]


# ------------------------------------------------------------------ op_screenshot on a real directory
class FakePage:
    """What op_screenshot and op_snapshot use of a Playwright page."""

    url = "http://example.test/"

    def __init__(self, png):
        self.png = png

    async def screenshot(self, **_kwargs):
        return self.png

    def locator(self, _selector):
        return self

    async def aria_snapshot(self):
        return '- heading "Fake" [level=1]'

    async def title(self):
        return "Fake"


class FakeContext:
    async def close(self):
        pass


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # 1032 bytes


def make_engine(tmp_path, slots=(SLOT,), png=PNG, **cfg):
    eng = server.Engine(dict(server.DEFAULTS, shots_dir=str(tmp_path / "shots"), **cfg))
    for slot in slots:
        eng.contexts[slot] = {"context": FakeContext(), "page": FakePage(png), "used": 0.0}
    return eng


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(tmp_path, shots_keep=3)
    yield eng
    eng.loop.close()


def shoot(eng, name, slot=SLOT):
    return eng.loop.run_until_complete(eng.op_screenshot(slot, name))


def pngs(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".png"))


def test_screenshots_past_the_quota_remove_the_oldest(engine, tmp_path):
    d = tmp_path / "shots" / SLOT
    # names in the reverse order of their times; each written a second after the one before
    for i, name in enumerate(["e", "d", "c", "b", "a"]):
        assert shoot(engine, name) == {"path": "/run/chv/shots/%s.png" % name, "bytes": len(PNG)}
        os.utime(d / (name + ".png"), (1000.0 + i, 1000.0 + i))
        assert len(pngs(d)) == min(i + 1, 3)
    assert pngs(d) == ["a.png", "b.png", "c.png"]
    # taking an existing name again replaces it (c, the oldest, stays) and makes it the newest
    shoot(engine, "a")
    os.utime(d / "a.png", (2000.0, 2000.0))
    assert pngs(d) == ["a.png", "b.png", "c.png"]
    shoot(engine, "z")
    assert pngs(d) == ["a.png", "b.png", "z.png"]  # c was the oldest
    # files the service did not write as screenshots are never counted nor removed
    (d / "notes.txt").write_bytes(b"x")
    for name in ("y", "x"):
        shoot(engine, name)
    assert (d / "notes.txt").exists() and len(pngs(d)) == 3


def test_the_byte_quota_keeps_the_newest_that_fit(tmp_path):
    eng = make_engine(tmp_path, shots_keep=100, shots_max_bytes=3 * len(PNG) + 10)
    try:
        d = tmp_path / "shots" / SLOT
        for i, name in enumerate(["p4", "p3", "p2", "p1", "p0"]):
            shoot(eng, name)
            os.utime(d / (name + ".png"), (1000.0 + i, 1000.0 + i))
        assert pngs(d) == ["p0.png", "p1.png", "p2.png"]
    finally:
        eng.loop.close()


def test_room_is_made_before_the_write(engine, tmp_path, monkeypatch):
    """A slot at its quota holds keep - 1 screenshots while the new one is written: on a full
    disk, the oldest one's space is what the new one can take."""
    d = tmp_path / "shots" / SLOT
    for name in ("a", "b", "c"):
        shoot(engine, name)
    seen = []
    real_write = os.write

    def write(fd, data):
        seen.append(pngs(d))
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", write)
    shoot(engine, "d")
    assert len(seen[0]) == 2 and "d.png" not in seen[0]
    assert len(pngs(d)) == 3 and "d.png" in pngs(d)


def full_disk(monkeypatch, err=errno.ENOSPC, after=100):
    """os.write writes ``after`` bytes of the first call, then fails with ``err`` (as a full tmpfs does)."""
    real_write = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:after]))
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(os, "write", write)
    return calls


def test_a_full_disk_is_an_error_naming_the_path_and_leaves_no_temporary_file(engine, tmp_path, monkeypatch):
    d = tmp_path / "shots" / SLOT
    shoot(engine, "front")
    (d / "front.png").write_bytes(b"previous screenshot")
    calls = full_disk(monkeypatch)
    with pytest.raises(server.ShotNotSaved) as exc:
        shoot(engine, "front")
    assert len(calls) == 2  # the write was under way when the disk filled
    assert str(exc.value) == ("screenshot /run/chv/shots/front.png not saved: no space left on device "
                              "(host directory %s)" % d)
    assert sorted(os.listdir(d)) == ["front.png"]  # no .front.png.tmp
    assert (d / "front.png").read_bytes() == b"previous screenshot"  # a failed replace keeps the old one
    monkeypatch.undo()
    assert shoot(engine, "front")["bytes"] == len(PNG)  # room again: it works
    assert (d / "front.png").read_bytes() == PNG


@pytest.mark.parametrize("err, why", [
    (errno.EDQUOT, "no space left: disk quota exceeded"),
    (errno.EIO, os.strerror(errno.EIO)),
])
def test_other_write_errors_are_answered_too(engine, tmp_path, monkeypatch, err, why):
    d = tmp_path / "shots" / SLOT
    full_disk(monkeypatch, err=err, after=0)
    with pytest.raises(server.ShotNotSaved) as exc:
        shoot(engine, "x")
    assert str(exc.value) == "screenshot /run/chv/shots/x.png not saved: %s (host directory %s)" % (why, d)
    assert os.listdir(d) == []


def test_a_directory_that_cannot_be_made_is_answered(tmp_path):
    (tmp_path / "shots").write_bytes(b"a file where the directory should be")
    eng = make_engine(tmp_path)
    try:
        with pytest.raises(server.ShotNotSaved, match=r"^screenshot /run/chv/shots/x.png not saved: "):
            shoot(eng, "x")
    finally:
        eng.loop.close()


def request(srv, req):
    """One request through Server.handle on a socket pair, as a connection thread serves it."""
    client, conn = socket.socketpair()
    with client:
        client.sendall(wire.encode(req))
        srv.handle(conn)
        return json.loads(client.makefile("rb").readline())


def test_the_service_answers_a_full_disk_and_keeps_serving(tmp_path, monkeypatch, capfd):
    eng = make_engine(tmp_path, slots=(SLOT, "slot1"))
    eng.start()
    try:
        srv = server.Server(eng.cfg, eng)
        assert request(srv, {"slot": SLOT, "action": "screenshot", "name": "one"})["ok"] is True  # the control
        full_disk(monkeypatch)
        rep = request(srv, {"slot": SLOT, "action": "screenshot", "name": "two"})
        monkeypatch.undo()
        d = tmp_path / "shots" / SLOT
        assert rep == {"ok": False, "error": "screenshot /run/chv/shots/two.png not saved: no space left on device "
                                             "(host directory %s)" % d}
        assert sorted(os.listdir(d)) == ["one.png"]
        log = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
        assert log[-1]["verdict"] == "error" and log[-1]["reason"] == rep["error"]
        # the same slot and another go on
        snap = request(srv, {"slot": SLOT, "action": "snapshot"})
        assert snap["ok"] is True and snap["result"]["title"] == "Fake"
        assert request(srv, {"slot": "slot1", "action": "screenshot", "name": "two"})["ok"] is True
        assert request(srv, {"slot": SLOT, "action": "screenshot", "name": "two"})["ok"] is True
        assert sorted(os.listdir(d)) == ["one.png", "two.png"]
    finally:
        eng.stop()


# ------------------------------------------------------------------ the configuration
@pytest.mark.parametrize("key, value", [
    ("shots_keep", 0), ("shots_keep", -1), ("shots_keep", True), ("shots_keep", "20"), ("shots_keep", 2.5),
    ("shots_keep", None), ("shots_max_bytes", 0), ("shots_max_bytes", "8M"),
])
def test_a_bad_quota_in_the_configuration_stops_the_start(tmp_path, capsys, key, value):
    assert server.config_problem(dict(server.DEFAULTS)) is None  # the control
    assert server.config_problem(dict(server.DEFAULTS, shots_keep=1, shots_max_bytes=1048576)) is None
    least = {"shots_keep": 1, "shots_max_bytes": 1048576}[key]
    rule = ("at least %d" if isinstance(value, int) and not isinstance(value, bool) else "an integer of at least %d")
    assert server.config_problem(dict(server.DEFAULTS, **{key: value})) == \
        "chv_browser_%s must be %s, not %s" % (key, rule % least, json.dumps(value))
    config = tmp_path / "browser.json"
    # a socket that cannot be bound (its directory is a file): a start that got past the check fails, never serves
    (tmp_path / "run").write_text("")
    config.write_text(json.dumps({key: value, "socket": str(tmp_path / "run" / "never.sock")}))
    assert server.main(["--config", str(config)]) == 1
    line = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert line["verdict"] == "refused-start" and line["reason"].startswith("chv_browser_%s must be" % key)


class InterruptedPage(FakePage):
    """A page whose first ``interruptions`` gotos lose to a navigation already under way, as
    chromium's error page after a refused open makes Playwright's goto fail."""

    def __init__(self, interruptions, error="interrupted"):
        super().__init__(PNG)
        self.gotos, self.interruptions, self.error = [], interruptions, error
        self.waits = 0

    async def wait_for_load_state(self, state="load"):
        assert state == "load"
        self.waits += 1  # the navigation that won has loaded

    async def goto(self, url, **_kwargs):
        self.gotos.append(url)
        if len(self.gotos) <= self.interruptions:
            if self.error == "interrupted":
                raise RuntimeError('Page.goto: Navigation to "%s" is interrupted by another navigation to '
                                   '"chrome-error://chromewebdata/"' % url)
            raise RuntimeError("Page.goto: net::ERR_CONNECTION_REFUSED at %s" % url)
        self.url = url
        return None


@pytest.mark.parametrize("interruptions, error, gotos, opened", [
    (0, "interrupted", 1, True),   # the control: a plain open
    (1, "interrupted", 2, True),   # lost to the earlier navigation once: asked for once more
    (2, "interrupted", 3, True),   # twice (the lost goto's own navigation won the second race)
    (3, "interrupted", 3, False),  # three times: the error goes back to the cell
    (1, "refused", 1, False),      # any other error is never retried
])
def test_an_open_that_lost_to_an_earlier_navigation_is_asked_for_once_more(
        tmp_path, interruptions, error, gotos, opened):
    eng = make_engine(tmp_path)
    page = InterruptedPage(interruptions, error)
    eng.contexts[SLOT]["page"] = page
    try:
        if opened:
            out = eng.loop.run_until_complete(eng.op_open(SLOT, "http://example.test/next"))
            assert out["url"] == "http://example.test/next" and out["status"] is None
        else:
            with pytest.raises(RuntimeError):
                eng.loop.run_until_complete(eng.op_open(SLOT, "http://example.test/next"))
        assert len(page.gotos) == gotos
        # before each goto again, the navigation that won was let finish loading
        assert page.waits == min(interruptions, gotos - 1) if error == "interrupted" else page.waits == 0
    finally:
        eng.loop.close()
