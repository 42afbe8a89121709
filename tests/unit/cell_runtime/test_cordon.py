"""The cordon (cell/cordon.py): its record, the refusal, the drain's
progress line, and a cordoned host refusing a new run before any claim
while the run's verdict says why."""

import json
import os

import pytest

from chv_guest.cell import cli, cordon, exits, status

from test_launcher import _Launcher

NOW = 1_800_000_000.0


def test_the_record_is_one_line_of_reason_with_when_and_who():
    rec = cordon.record("  broker\nupgrade  ", NOW, "ops")
    assert rec == {"reason": "broker upgrade", "since": NOW, "by": "ops", "rollout": False}
    assert cordon.record(None, NOW, "root")["reason"] == ""
    assert len(cordon.record("x" * 1000, NOW, "root")["reason"]) == cordon.REASON_MAX
    assert cordon.parse(json.dumps(rec)) == rec


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", "null"])
def test_an_unreadable_marker_still_cordons(text):
    assert cordon.parse(text) == {"reason": "(unreadable cordon marker)", "since": None, "by": None, "rollout": False}


def test_the_refusal_names_the_cordon_its_reason_and_the_exit_code():
    msg = cordon.refusal(cordon.record("broker upgrade", NOW - 125, "ops"), NOW)
    assert "cordoned for 2m05s by ops (reason: broker upgrade)" in msg
    assert "retry on another guest (exit %d)" % exits.EXIT_CORDONED in msg
    assert "(reason: none given)" in cordon.refusal(cordon.record(None, NOW, "root"), NOW)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59, "59s"), (60, "1m00s"), (3599, "59m59s"),
                                           (3600, "1h00m"), (3720, "1h02m"), (90000, "1d01h"), (-5, "0s")])
def test_ages_for_people(seconds, text):
    assert cordon.age_text(seconds) == text


def test_the_drain_line_names_each_running_slot_with_its_age():
    cordoned = cordon.record("r", NOW, "root")
    line = cordon.drain_line([("slot3", 9, NOW - 3720), ("slot0", 123, NOW - 723)], NOW, cordoned)
    assert line == ("waiting for 2 cell(s): slot0 (pid 123, running 12m03s), slot3 (pid 9, running 1h02m); "
                    "cordoned")
    assert cordon.drain_line([], NOW, cordoned) == "drained: no cell runs (cordoned)"
    assert cordon.drain_line([("slot1", None, None)], NOW, None) == (
        "waiting for 1 cell(s): slot1 (pid ?, running ?); NOT cordoned (new cells may start)")


def test_set_read_and_clear_the_marker(tmp_path):
    state = str(tmp_path / "state")
    assert cordon.read(state) is None
    new, rec = cordon.set_cordon(state, "first", "ops", now=NOW)
    assert new and cordon.read(state) == rec
    assert oct(os.stat(cordon.marker_path(state)).st_mode & 0o777) == "0o644"
    again, kept = cordon.set_cordon(state, "second", "ops", now=NOW + 1)
    assert not again and kept["reason"] == "first"  # the first cordon's reason and time stay
    assert cordon.clear(state) == "uncordoned" and cordon.read(state) is None and cordon.clear(state) == "not cordoned"


def test_uncordon_rollout_lifts_only_a_rollouts_cordon(tmp_path):
    state = str(tmp_path / "state")
    cordon.set_cordon(state, "by hand", "ops", now=NOW)
    assert cordon.clear(state, only_rollout=True) == "kept" and cordon.read(state)["reason"] == "by hand"
    assert cordon.clear(state) == "uncordoned"  # control: a plain uncordon lifts it
    new, rec = cordon.set_cordon(state, "chv.fleet rollout: restarting chv-broker", "root", now=NOW, rollout=True)
    assert new and rec["rollout"] and cordon.read(state)["rollout"] is True
    assert cordon.clear(state, only_rollout=True) == "uncordoned" and cordon.read(state) is None
    assert cordon.clear(state, only_rollout=True) == "not cordoned"
    # a marker whose rollout field is anything but true is a cordon by hand
    os.makedirs(state, exist_ok=True)
    with open(cordon.marker_path(state), "w") as fh:
        fh.write(json.dumps(dict(cordon.record("x", NOW, "root"), rollout="yes")))
    assert cordon.clear(state, only_rollout=True) == "kept"


def test_a_link_or_a_directory_is_no_cordon(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "elsewhere").write_text(json.dumps(cordon.record("x", NOW, "root")))
    os.symlink(str(tmp_path / "elsewhere"), str(state / "cordon"))
    assert cordon.read(str(state)) is None
    os.unlink(str(state / "cordon"))
    (state / "cordon").mkdir()
    assert cordon.read(str(state)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the marker counts only when root owns it")
def test_a_cordoned_host_refuses_a_run_before_any_claim(policy, tmp_path, capsys):
    pol = dict(policy, state_dir=str(tmp_path / "state"))
    cordon.set_cordon(pol["state_dir"], "broker upgrade", "ops")
    la = _Launcher(pol, str(tmp_path))
    assert la.run(["true"]) == exits.EXIT_CORDONED and la.ran == [] and la.stage == "cordoned"
    err = capsys.readouterr().err
    assert "cordoned" in err and "(reason: broker upgrade)" in err
    rec = status.status_record(exits.EXIT_CORDONED, la.stage)
    assert rec["verdict"] == "cordoned" and rec["verdict"] in status.VERDICTS
    # the health gate's own run passes it
    la.ignore_cordon = True
    assert la.run(["true"]) == 3 and len(la.ran) == 1
    cordon.clear(pol["state_dir"])
    la.ignore_cordon = False
    assert la.run(["true"]) == 3  # uncordoned: runs again


def _policy_file(tmp_path, raw_policy):
    raw = dict(raw_policy, state_dir=str(tmp_path / "state"))
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the marker counts only when root owns it")
def test_cordon_status_uncordon_on_the_command_line(tmp_path, raw_policy, capsys):
    path = _policy_file(tmp_path, raw_policy)
    assert cli.main(["--policy", path, "cordon", "--reason", "broker upgrade"], euid=0) == 0
    assert capsys.readouterr().out.startswith("cordoned: cordoned for 0s by ")
    assert cli.main(["--policy", path, "cordon", "--reason", "other"], euid=0) == 0
    assert "already cordoned" in capsys.readouterr().out
    assert cli.main(["--policy", path, "status"], euid=0) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cordon: cordoned for ") and lines[0].endswith("(reason: broker upgrade)")
    assert [ln.split()[0] for ln in lines[1:]] == ["slot0", "slot1"]
    assert cli.main(["--policy", path, "status", "--json"], euid=0) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["cordoned"] is True and got["cordon"]["reason"] == "broker upgrade"
    assert [(s["slot"], s["state"]) for s in got["slots"]] == [("slot0", "idle"), ("slot1", "idle")]
    assert cli.main(["--policy", path, "drain"], euid=0) == 0
    assert capsys.readouterr().out == "drained: no cell runs (cordoned)\n"
    assert cli.main(["--policy", path, "run", "--", "true"], euid=0) == exits.EXIT_CORDONED
    assert "retry on another guest" in capsys.readouterr().err
    assert cli.main(["--policy", path, "uncordon"], euid=0) == 0
    assert capsys.readouterr().out == "uncordoned\n"
    assert cli.main(["--policy", path, "uncordon"], euid=0) == 0
    assert capsys.readouterr().out == "not cordoned\n"
    assert json.loads((cli.main(["--policy", path, "status", "--json"], euid=0), capsys.readouterr().out)[1])[
        "cordon"] is None


def test_cordon_is_roots(tmp_path, raw_policy, capsys):
    path = _policy_file(tmp_path, raw_policy)
    for action in ("cordon", "uncordon", "drain"):
        assert cli.main(["--policy", path, action], euid=1000) == exits.EXIT_CONFIG
        assert "runs as root only" in capsys.readouterr().err
