"""The base of every launcher (chv_guest/cell/launcher.py): one run from the
request to the released slot, whatever the platform. A stand-in launcher
overrides only the two hooks each platform has (claim, run_claimed)."""

import json
import os

import pytest

from chv_guest.cell import claim as claimmod
from chv_guest.cell import darwin, exits, launcher, runner, warm


class _Launcher(launcher.Launcher):
    """Claims the first slot's lock (a file in tmp), or answers ``busy``."""

    def __init__(self, policy, lock_dir, busy=None):
        super().__init__(policy)
        self.lock_dir, self.busy, self.ran = lock_dir, busy, []

    def claim(self, slots, wait, command, shared_network, runtime_max):
        if self.busy is not None:
            return self.busy
        path = os.path.join(self.lock_dir, slots[0]["name"] + ".lock")
        return slots[0], claimmod.try_claim(path)

    def run_claimed(self, slot, command, shared_network, runtime_max):
        self.ran.append((slot, list(command), runtime_max, os.path.exists(os.path.join(self.lock_dir,
                                                                                       slot["name"] + ".lock"))))
        self.payload_started, self.payload_exit = True, 3
        return 3


def test_every_launcher_runs_the_one_skeleton():
    for cls in (runner.Launcher, warm.WarmCell, darwin.Launcher):
        assert issubclass(cls, launcher.Launcher)
        assert cls.run is launcher.Launcher.run and cls._run is launcher.Launcher._run, cls


def test_a_claimed_slot_is_the_policys_own_and_released_after_the_run(policy, tmp_path):
    la = _Launcher(policy, str(tmp_path))
    slot = policy["slots"][1]
    assert la.run(["true"], slot_name=slot["name"]) == 3
    (got, command, runtime_max, held) = la.ran[0]
    assert got is slot and command == ["true"] and runtime_max == 0 and held  # the lock held during the run
    assert not os.path.exists(tmp_path / (slot["name"] + ".lock"))  # released (and unlinked) after it
    assert (la.stage, la.claimed_slot) == ("claimed", slot["name"])


def test_refusals_come_before_any_claim_and_are_config(policy, tmp_path, capsys):
    la = _Launcher(dict(policy, allow_shared_network=False), str(tmp_path))
    assert la.run(["true"], shared_network=True) == exits.EXIT_CONFIG
    assert launcher.SHARED_NETWORK_REFUSAL in capsys.readouterr().err
    assert la.run(["true"], runtime_max=-1) == exits.EXIT_CONFIG
    assert la.run(["true"], slot_name="nope") == exits.EXIT_CONFIG
    assert "no slot named 'nope' in the policy (have: %s)" % ", ".join(
        s["name"] for s in policy["slots"]) in capsys.readouterr().err
    assert la.ran == [] and la.stage == "config"


def test_a_claim_that_ends_the_run_returns_its_code(policy, tmp_path):
    la = _Launcher(policy, str(tmp_path), busy=exits.EXIT_BUSY)
    assert la.run(["true"]) == exits.EXIT_BUSY and la.ran == []


def test_the_verdict_goes_to_the_status_fd_once_the_slot_is_released(policy, tmp_path):
    la = _Launcher(policy, str(tmp_path))
    r, w = os.pipe()
    la.status_fd = w
    assert la.run(["true"]) == 3
    with os.fdopen(r) as fh:
        rec = json.loads(fh.read())
    assert rec == {"verdict": "ran", "exit": 3, "slot": policy["slots"][0]["name"], "payload_started": True,
                   "payload_exit": 3}
    with pytest.raises(OSError):
        os.fstat(w)  # write_status closed it
