"""The slot ledger on a full file system (issue 15's faults): chv.fleet.cell_identity,
run by ansible as the role runs it, with its ledger on a small tmpfs of its own.

Control: with room left, a third slot is added and the first two keep their
identities. Fault: the same run with the tmpfs filled fails, naming the
ledger and the lack of space, and leaves the ledger byte for byte as it was,
with no temporary file beside it."""

import json
import os
import subprocess
import sys

import pytest

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
# a pool and names no other test or lab uses on this machine
POOL = "10.251.0.0/16"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "ledgerfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def allocate(ledger, slots):
    args = {"slots": slots, "pool": POOL, "ifname_prefix": "lfl", "machine_prefix": "lfl-",
            "ledger": str(ledger), "state_dir": str(ledger.parent / "state")}
    proc = subprocess.run([os.path.join(BIN, "ansible"), "localhost", "-c", "local", "-e",
                           "ansible_python_interpreter=" + sys.executable, "-m", "chv.fleet.cell_identity",
                           "-a", json.dumps(args), "--one-line"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
                          env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    # one line: localhost | SUCCESS => {...} (or FAILED! => {...})
    line = next(line for line in proc.stdout.splitlines() if line.startswith("localhost | "))
    return proc.returncode, json.loads(line.split(" => ", 1)[1])


def fill(directory):
    """Write a filler file until the file system has no block left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28, exc  # ENOSPC
    finally:
        os.close(fd)
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(OSError):  # not even one more block
            os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def identities(result):
    return {i["name"]: (i["subnet"], i["uid_base"], i["host_ifname"]) for i in result["identities"]}


def test_a_full_file_system_under_the_ledger_fails_clearly_and_keeps_the_old_ledger(small_fs):
    ledger = small_fs / "ledger.json"
    rc, first = allocate(ledger, ["s0", "s1"])
    assert rc == 0 and first["changed"], first
    before = ledger.read_bytes()

    fill(small_fs)
    rc, failed = allocate(ledger, ["s0", "s1", "s2"])
    assert rc == 2, failed  # the module failed (ansible's exit status for a failed host)
    msg = failed["msg"]
    assert "No space left on device" in msg and str(ledger) in msg and "Nothing was written" in msg, msg
    assert ledger.read_bytes() == before
    assert sorted(os.listdir(small_fs)) == ["filler", "ledger.json", "ledger.json.lock"]

    # control: with room again, the same run adds the third slot and keeps the first two
    (small_fs / "filler").unlink()
    rc, grown = allocate(ledger, ["s0", "s1", "s2"])
    assert rc == 0 and grown["changed"], grown
    after = identities(grown)
    assert sorted(after) == ["s0", "s1", "s2"]
    assert {k: after[k] for k in ("s0", "s1")} == identities(first)
