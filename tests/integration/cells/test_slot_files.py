"""A slot's files read for someone else, and the launcher's verdicts, with
real cells and the executor's real path (a non-root member of the agent
group, chv-cell -> sudo -> chv-cell-agent).

Reuses test_cells_real's sudo_env (a copy of the launcher whose fixed policy
is this module's, a throwaway agent group and users, the sudoers rule) with
this module's own policy: veths lth50/lth51, subnets 10.231.50.0/24 and
10.231.51.0/24, uid ranges 3500000+, slot directories under a 0755 scratch
directory in /var/tmp (so that the agent user can reach them, as it reaches
/var/lib/chv-fleet on a guest).  On top of sudo_env's rule the module
installs the role's own sudoers template rendered for that copy (it adds
closefrom_override, which --status-fd needs through sudo).

Each refusal is checked beside a control in the same run, after a cell
that really ran (its own output) planted what is refused.
"""

import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from cellrt import ENTRY, real_cells_marks
from test_cells_real import AGENT_KEYS, NOISE, as_user, leftovers, sudo_env, user_run  # noqa: F401 (fixture)
from testpaths import ROOT

pytestmark = real_cells_marks(("systemd-nspawn", "ip", "nsenter", "sudo", "visudo", "setpriv"))

READ_MAX = 65536
SLOT1_SECRET = "slot1's secret result\n"


def slot(i):
    return {"name": "slot%d" % i, "index": i, "machine": "lf-slot%d" % i, "host_ifname": "lth5%d" % i,
            "cell_ifname": "eth0", "subnet": "10.231.5%d.0/24" % i, "gateway": "10.231.5%d.1" % i,
            "address": "10.231.5%d.2" % i, "prefixlen": 24, "uid_base": 3500000 + i * 65536, "uid_size": 65536}


@pytest.fixture(scope="module")
def env():
    root = tempfile.mkdtemp(prefix="chv-slotfiles-", dir="/var/tmp")
    os.chmod(root, 0o755)
    pol = {
        "version": 1,
        "state_dir": "/run/chv-fleet-lf%d" % os.getpid(),
        "workspace_root": os.path.join(root, "ws"),
        "agent_state_root": os.path.join(root, "state"),
        "writable_binds": [],
        "claim_timeout": 0,
        "stop_grace": 1,
        "require_ruleset": False,
        "read_max_bytes": READ_MAX,
        "slots": [slot(0), slot(1)],
    }
    for d in (pol["workspace_root"], pol["agent_state_root"]):
        os.mkdir(d, 0o755)
    path = os.path.join(root, "policy.json")
    with open(path, "w") as fh:
        json.dump(pol, fh)
    badnet = dict(pol, nsenter="/bin/false")
    with open(os.path.join(root, "badnet.json"), "w") as fh:
        json.dump(badnet, fh)
    yield {"policy": path, "badnet": os.path.join(root, "badnet.json"), "pol": pol, "root": root}
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(pol["state_dir"], ignore_errors=True)


@pytest.fixture(autouse=True)
def clean_after(env):
    yield
    assert leftovers(env["pol"]) == []


@pytest.fixture(scope="module")
def executor(env, sudo_env):
    """sudo_env plus the role's sudoers template rendered for its copy."""
    import grp

    import jinja2

    with open(os.path.join(ROOT, "roles", "cell_runtime", "templates", "chv-cell.sudoers.j2")) as fh:
        text = jinja2.Template(fh.read(), keep_trailing_newline=True).render(
            ansible_managed="test_slot_files", chv_cell_agent_group=sudo_env["group"],
            chv_cell_lib_dir=os.path.dirname(sudo_env["agent"]))
    assert "closefrom_override" in text
    tmp = os.path.join(sudo_env["dir"], "sudoers-role")
    with open(tmp, "w") as fh:
        fh.write(text)
    subprocess.run(["visudo", "-cf", tmp], check=True, capture_output=True)
    os.chmod(tmp, 0o440)
    dropin = "/etc/sudoers.d/chv-celltest-role-%d" % os.getpid()
    shutil.move(tmp, dropin)
    try:
        yield dict(sudo_env, gid=grp.getgrnam(sudo_env["group"]).gr_gid)
    finally:
        os.unlink(dropin)


def cell(ex, slot_name, script, **kw):
    """A cell of ``slot_name`` through the executor's path; its output (it must have run)."""
    r = user_run(ex["member"], [ex["chv_cell"], "run", "--slot", slot_name, "--", "sh", "-c", script], **kw)
    assert r.returncode == 0, r.stderr
    return r.stdout


def read(ex, slot_name, path):
    return user_run(ex["member"], [ex["chv_cell"], "read", "--slot", slot_name, path], timeout=20)


def ws(env, name, *rest):
    return os.path.join(env["pol"]["workspace_root"], name, *rest)


def old_modes(env, gid):
    """What the role made of slot directories before: the agent group, setgid, 2750."""
    for s in env["pol"]["slots"]:
        for top in (env["pol"]["workspace_root"], env["pol"]["agent_state_root"]):
            d = os.path.join(top, s["name"])
            os.chown(d, s["uid_base"], gid)
            os.chmod(d, 0o2750)


# ---------------------------------------------------------------- reading a slot's files
def test_a_planted_symlink_gave_another_slots_file_to_cat_and_chv_cell_read_refuses_it(env, executor):
    ex = executor
    out = cell(ex, "slot1", "printf \"slot1's secret result\\n\" > /workspace/secret.txt; echo slot1-ran")
    assert out == "slot1-ran\n"
    out = cell(ex, "slot0", "ln -s %s /workspace/result.txt; ln -s /etc/shadow /workspace/shadow.txt; "
                            "ln -s ../slot1/secret.txt /workspace/rel.txt; echo mine > /workspace/mine.txt; "
                            "mkdir -p /home/chv/.codex; echo '{\"slot\": \"slot0\"}' > /home/chv/.codex/state.json; "
                            "echo slot0-ran" % ws(env, "slot1", "secret.txt"))
    assert out == "slot0-ran\n"
    result = ws(env, "slot0", "result.txt")
    # the old modes (the agent group reads every slot): a plain cat as the agent user follows the link
    old_modes(env, ex["gid"])
    r = user_run(ex["member"], ["cat", result])
    assert r.returncode == 0 and r.stdout == SLOT1_SECRET, r.stderr
    # the launcher makes the slot's directories its own again at its next run (as the role does)
    assert cell(ex, "slot0", "echo again") == "again\n"
    assert cell(ex, "slot1", "echo again") == "again\n"
    for s in env["pol"]["slots"]:
        for top in (env["pol"]["workspace_root"], env["pol"]["agent_state_root"]):
            st = os.stat(os.path.join(top, s["name"]))
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (s["uid_base"], s["uid_base"], 0o700)
    r = user_run(ex["member"], ["cat", result])
    assert r.returncode == 1 and "Permission denied" in r.stderr and SLOT1_SECRET not in r.stdout
    # chv-cell read through sudo: every link refused, the slot's own files read (controls)
    for path in ("result.txt", "/workspace/result.txt", "/home/chv/workspace/shadow.txt", "rel.txt"):
        r = read(ex, "slot0", path)
        assert r.returncode == 65 and r.stdout == "", (path, r.stderr)
        assert "symbolic link" in r.stderr and "(never followed)" in r.stderr
    r = read(ex, "slot0", "/workspace/mine.txt")
    assert (r.returncode, r.stdout) == (0, "mine\n"), r.stderr
    r = read(ex, "slot0", "/home/chv/.codex/state.json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"slot": "slot0"}, r.stderr
    # the executor owns every slot's task: it reads slot1's file in slot1 (never through slot0)
    r = read(ex, "slot1", "secret.txt")
    assert (r.returncode, r.stdout) == (0, SLOT1_SECRET), r.stderr
    # never outside the slot's two directories
    for path in ("/etc/shadow", "../slot1/secret.txt", ws(env, "slot1", "secret.txt")):
        r = read(ex, "slot0", path)
        assert r.returncode == 78 and r.stdout == "", (path, r.stderr)
    # the user outside the agent group may not read at all
    r = user_run(ex["other"], [ex["chv_cell"], "read", "--slot", "slot0", "mine.txt"])
    assert r.returncode == 78 and r.stdout == "" and "is not allowed to run cells" in r.stderr


def test_fifo_huge_file_and_hard_links_planted_by_a_cell_are_refused(env, executor):
    ex = executor
    s0, s1 = env["pol"]["slots"]
    cell(ex, "slot1", "echo theirs > /workspace/theirs.txt")
    out = cell(ex, "slot0",
               "echo mine > /workspace/mine.txt; mkfifo /workspace/fifo; truncate -s 10G /workspace/huge; "
               "head -c %d /dev/zero > /workspace/at-limit; "
               "ln /workspace/mine.txt /workspace/mine-hard && echo own-link-ok; "
               "ln /etc/passwd /workspace/passwd-hard 2>/dev/null || echo etc-link-refused; "
               "mknod /workspace/zero c 1 5 2>/dev/null || echo mknod-refused; "
               "ls %s 2>/dev/null || echo other-slot-invisible" % (READ_MAX, ws(env, "slot1")))
    assert out.split() == ["own-link-ok", "etc-link-refused", "mknod-refused", "other-slot-invisible"]
    # outside the cell, slot0's uid cannot link slot1's file either: slot1's directory is slot1's own
    r = subprocess.run(["setpriv", "--reuid=%d" % s0["uid_base"], "--regid=%d" % s0["uid_base"], "--clear-groups",
                        "ln", ws(env, "slot1", "theirs.txt"), ws(env, "slot0", "theirs-hard")],
                       capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr and not os.path.lexists(ws(env, "slot0", "theirs-hard"))
    # control: the same uid links a file of its own slot
    r = subprocess.run(["setpriv", "--reuid=%d" % s0["uid_base"], "--regid=%d" % s0["uid_base"], "--clear-groups",
                        "ln", ws(env, "slot0", "mine.txt"), ws(env, "slot0", "mine-hard2")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    t = time.monotonic()
    r = read(ex, "slot0", "fifo")
    assert r.returncode == 65 and "is a FIFO: only regular files are read" in r.stderr and r.stdout == ""
    assert time.monotonic() - t < 15  # returned: never waited for a writer (user_run's timeout is 20 s)
    r = read(ex, "slot0", "huge")
    assert r.returncode == 67 and r.stdout == "" and "10737418240 bytes, more than read_max_bytes %d" % READ_MAX in r.stderr
    r = read(ex, "slot0", "at-limit")
    assert r.returncode == 0 and len(r.stdout) == READ_MAX
    for path in ("mine-hard", "mine-hard2", "mine.txt"):
        r = read(ex, "slot0", path)
        assert (r.returncode, r.stdout) == (0, "mine\n"), (path, r.stderr)
    assert read(ex, "slot0", "nothing-here").returncode == 66


# ---------------------------------------------------------------- the verdict channel
FAKE_BUSY = "chv-cell: all 1 slot(s) busy (slot0) for 0s; giving up"
FD_PROBE = ("import os, json, sys\n"
            "fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\n"
            "links = {f: os.readlink('/proc/self/fd/%d' % f) for f in fds if os.path.exists('/proc/self/fd/%d' % f)}\n"
            "try:\n"
            "    os.write(int(sys.argv[1]), b'{\"verdict\": \"busy\", \"exit\": 75}\\n')\n"
            "    wrote = 'wrote'\n"
            "except OSError as exc:\n"
            "    wrote = os.strerror(exc.errno)\n"
            "print(json.dumps({'fds': fds, 'links': links, 'write': wrote}))\n")


STATUS_FD = 57  # free here (pytest's own captures use low fds), given to the launcher only


def run_with_status(ex, args, fd=STATUS_FD, **kw):
    """chv-cell run --status-fd FD as the agent user, FD a pipe only the test reads."""
    import fcntl

    r, w = os.pipe()
    with pytest.raises(OSError):
        fcntl.fcntl(fd, fcntl.F_GETFD)  # not in use: never clobber one of pytest's
    os.dup2(w, fd)  # inheritable
    os.close(w)
    try:
        p = as_user(ex["member"], [ex["chv_cell"], "run", "--status-fd", str(fd), *args], stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(fd,), **kw)
    finally:
        os.close(fd)
    out, err = p.communicate(timeout=60)
    with os.fdopen(r, "rb") as fh:
        status = fh.read().decode()
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith(NOISE))
    return p.returncode, out, err, status


def test_a_payload_cannot_forge_the_verdict_nor_reach_the_status_fd(env, executor):
    ex = executor
    # the payload tries the status fd's number (from the executor's command line, say) and prints a fake busy
    script = "python3 -c \"$1\" %d; echo '%s' >&2; exit 75" % (STATUS_FD, FAKE_BUSY)
    rc, out, err, status = run_with_status(ex, ["--slot", "slot0", "--", "sh", "-c", script, "sh", FD_PROBE])
    # what the executor sees on the payload's streams is the same as a real busy
    assert rc == 75 and FAKE_BUSY in err, (rc, out, err, status)
    seen = json.loads(out)
    assert seen["write"] == "Bad file descriptor"
    assert STATUS_FD not in seen["fds"] and seen["fds"] == [0, 1, 2, 3], seen  # 3: the listing's own directory fd
    assert not any(v.startswith("pipe:") and int(k) > 2 for k, v in seen["links"].items()), seen
    # the status record says the payload ran and exited 75: one line, nothing forged in it
    assert status.count("\n") == 1 and "forged" not in status
    assert json.loads(status) == {"verdict": "ran", "exit": 75, "slot": "slot0", "payload_started": True,
                                  "payload_exit": 75}


def test_a_real_busy_and_a_real_refusal_give_their_own_verdicts(env, executor):
    ex = executor
    holder = as_user(ex["member"], [ex["chv_cell"], "run", "--slot", "slot0", "--", "sleep", "30"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rec = os.path.join(env["pol"]["state_dir"], "cells", "slot0.json")
        end = time.monotonic() + 20
        while not os.path.exists(rec):
            assert holder.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        rc, out, err, status = run_with_status(ex, ["--slot", "slot0", "--timeout", "0", "--", "echo", "ran"])
        assert rc == 75 and out == "" and "busy" in err
        assert json.loads(status) == {"verdict": "busy", "exit": 75, "slot": None, "payload_started": False,
                                      "payload_exit": None}
        # control in the same run: the other slot is free, and its payload's verdict is "ran"
        rc, out, err, status = run_with_status(ex, ["--slot", "slot1", "--", "sh", "-c", "echo ran; exit 3"])
        assert (rc, out) == (3, "ran\n") and json.loads(status)["verdict"] == "ran"
        assert json.loads(status)["slot"] == "slot1"
    finally:
        holder.terminate()
        holder.communicate(timeout=30)
    # a request the policy forbids: the config verdict
    rc, out, err, status = run_with_status(ex, ["--shared-network", "--", "echo", "ran"])
    assert rc == 78 and out == ""
    # refused by the wrapper before sudo (the policy is world-readable): no status, exit 78 with the reason
    assert status == "" and "--shared-network is not allowed" in err
    r = user_run(ex["member"], ["sudo", "-n", "-C", "8", ex["agent"], "run", "--shared-network", "--status-fd", "7",
                                "--", "true"])
    assert r.returncode == 78 and "--status-fd 7: that file descriptor is not open" in r.stderr


def test_a_setup_failure_gives_the_setup_verdict(env, executor):
    r, w = os.pipe()
    p = subprocess.run([sys.executable, "-I", ENTRY, "--policy", env["badnet"], "run", "--status-fd", str(w),
                        "--slot", "slot0", "--", "echo", "ran"], capture_output=True, text=True, pass_fds=(w,),
                       timeout=60, check=False)
    os.close(w)
    with os.fdopen(r) as fh:
        status = json.loads(fh.read())
    assert p.returncode == 125 and "ran" not in p.stdout
    assert status == {"verdict": "setup", "exit": 125, "slot": "slot0", "payload_started": False,
                      "payload_exit": None}


def test_without_closefrom_override_sudo_refuses_the_status_fd(env, executor):
    """sudo closes every fd above 2 unless the rule allows -C: the role's
    template has closefrom_override; sudo_env's bare rule does not."""
    dropin = "/etc/sudoers.d/chv-celltest-role-%d" % os.getpid()
    saved = dropin + ".off"
    os.rename(dropin, saved)
    try:
        rc, out, err, status = run_with_status(executor, ["--slot", "slot0", "--", "echo", "ran"])
        assert rc != 0 and out == "" and status == "" and "-C option" in err
    finally:
        os.rename(saved, dropin)
    rc, out, err, status = run_with_status(executor, ["--slot", "slot0", "--", "echo", "ran"])  # control
    assert (rc, out) == (0, "ran\n") and json.loads(status)["verdict"] == "ran"
