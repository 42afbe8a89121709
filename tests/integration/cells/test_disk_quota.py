"""The per-slot disk quota with real cells on this machine (root, nspawn, loop).

slot0 gets its disk as the cell_runtime role makes it: an image of the
role's size reading (vars/main.yml __cell_runtime_disk_bytes), reserved with
fallocate and formatted with the role's mkfs command
(__cell_runtime_disk_mkfs), then the role's mount units
(templates/chv-cell-disk.mount.j2 rendered for __cell_runtime_disk_mounts)
mounted as systemd mounts a unit: mount What Where -t Type -o Options.
slot1 keeps plain directories on this machine's root file system, the old
layout.

- In slot0 a cell's small write succeeds and its large one stops with
  ENOSPC at the quota, in the workspace and in the home; the bytes filled
  the image's own file system, and the root file system gave the
  preallocated image not one block more.
- Control (the old behaviour): the same large write in slot1 without a
  quota succeeds, and the root file system loses the bytes.
- With disk_max in the policy, slot1 (mounts missing) is refused with exit
  125, the message naming the slot and its workspace, while slot0 under the
  same policy runs (its payload's own exit code).

Uses veths lth60/lth61, subnets 10.231.60.0/24 and 10.231.61.0/24, a private
state dir and a temporary directory; touches nothing else.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

import cellrt
import darwin_render as render

pytestmark = cellrt.real_cells_marks(("systemd-nspawn", "ip", "nsenter", "mkfs.ext4", "fallocate", "mount"),
                                     "real cells and loop mounts need root")

TAG = "dq%d" % os.getpid()
QUOTA = "64M"
MIB = 1 << 20

# The payload: a small write in the workspace and in the home, then in each
# a large one until it is done or fails (the files stay); one JSON line of
# what happened; exit 42.
PAYLOAD = r"""
import errno, json, os, sys
big = int(sys.argv[1])
out = {}
places = ("/workspace", os.environ["HOME"])
for where in places:
    with open(where + "/small", "wb") as fh:
        fh.write(b"s" * 4096)
        fh.flush()
        os.fsync(fh.fileno())
for where in places:
    written, err = 0, None
    try:
        with open(where + "/big", "wb") as fh:
            while written < big:
                fh.write(b"\0" * (1 << 20))
                written += 1 << 20
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        err = errno.errorcode.get(exc.errno, str(exc.errno))
    out[where] = {"small": os.path.getsize(where + "/small"), "written": written, "error": err}
print(json.dumps(out))
sys.exit(42)
"""


def slot(i):
    return cellrt.make_slot(i, base=60, host_prefix="lth6")


def role_vars():
    return render.role_yaml("cell_runtime", "vars", "main.yml")


def free_of(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def systemd_mount(unit):
    """Mount a rendered mount unit as systemd does (mount What Where -t Type
    -o Options, Where made with DirectoryMode)."""
    sec = dict(ln.split("=", 1) for ln in unit.split("[Mount]\n", 1)[1].splitlines() if "=" in ln)
    os.makedirs(sec["Where"], mode=int(sec.get("DirectoryMode", "0755"), 8), exist_ok=True)
    subprocess.run(["mount", sec["What"], sec["Where"], "-t", sec["Type"], "-o", sec["Options"]], check=True)
    return sec["Where"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("diskq")
    v = role_vars()
    slots = [slot(0), slot(1)]
    variables = {
        "chv_cell_identities": [slots[0]], "chv_cell_disk_max": QUOTA,
        "chv_cell_workspace_root": str(root / "ws"), "chv_cell_agent_state_root": str(root / "state"),
        "__cell_runtime_disk_dir": str(root / "disks"),
        "__cell_runtime_disk_marker": v["__cell_runtime_disk_marker"],
        "__cell_runtime_disk_target": v["__cell_runtime_disk_target"],
    }
    size = int(render.evaluate(v["__cell_runtime_disk_bytes"], **variables))
    variables["__cell_runtime_slot_dirs"] = render.evaluate(v["__cell_runtime_slot_dirs"], **variables)
    mounts = render.evaluate(v["__cell_runtime_disk_mounts"], **variables)
    os.makedirs(variables["__cell_runtime_disk_dir"], mode=0o700)
    state_dir = "/run/chv-fleet-%s" % TAG
    mounted = []
    try:
        for m in mounts:
            if m["kind"] == "image":  # tasks/disk.yml: fallocate, the role's mkfs, rename
                subprocess.run(["fallocate", "-l", str(size), m["what"] + ".new"], check=True)
                subprocess.run(v["__cell_runtime_disk_mkfs"] + [m["what"] + ".new"], check=True)
                os.rename(m["what"] + ".new", m["what"])
            unit = render.render("cell_runtime", "chv-cell-disk.mount.j2", __cell_runtime_disk_mount=m, **variables)
            mounted.append(systemd_mount(unit))
            if m["kind"] == "image":  # tasks/disk.yml: the image's directories, as the slot dirs
                for d in render.evaluate(v["__cell_runtime_disk_dirs"], **variables):
                    os.mkdir(d["path"], int(d["mode"], 8))
                    os.chown(d["path"], int(d["owner"]), int(d.get("group", d["owner"])))
        for kind in ("ws", "state"):  # slot1: plain directories of / (the old layout)
            os.makedirs(root / kind / "slot1", mode=0o700)
            os.chown(root / kind / "slot1", slots[1]["uid_base"], slots[1]["uid_base"])
        pol = {
            "version": 1,
            "state_dir": state_dir,
            "workspace_root": str(root / "ws"),
            "agent_state_root": str(root / "state"),
            "agent_state_mount": "/home/chv",  # the agent's HOME, as the role renders it
            "writable_binds": [],
            "dns_servers": ["192.0.2.53"],
            "claim_timeout": 0,
            "stop_grace": 1,
            "require_ruleset": False,
            "slots": slots,
        }
        paths = {}
        for name, extra in (("quota", {"disk_max": QUOTA}), ("none", {})):
            paths[name] = str(root / (name + ".json"))
            with open(paths[name], "w") as fh:
                json.dump(dict(pol, **extra), fh)
        yield {"policy": paths, "size": size, "mounts": mounts, "root": root}
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", where], check=False)
        shutil.rmtree(state_dir, ignore_errors=True)


def run(policy, slot_name, big):
    argv = [sys.executable, "-I", cellrt.ENTRY, "--policy", policy, "run", "--slot", slot_name, "--",
            "python3", "-c", PAYLOAD, str(big)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True) if not ln.startswith(cellrt.NOISE))
    return r


def test_the_image_is_preallocated(env):
    img = next(m["what"] for m in env["mounts"] if m["kind"] == "image")
    st = os.stat(img)
    assert st.st_size == env["size"] == 64 * MIB
    assert st.st_blocks * 512 >= st.st_size  # reserved, not sparse (mkfs nodiscard kept it)


def big_files(env, name):
    return [os.path.join(str(env["root"]), d, name, "big") for d in ("ws", "state")]


def remove(paths):
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def test_cell_gets_enospc_at_its_quota_and_the_root_is_untouched(env):
    image = next(m for m in env["mounts"] if m["kind"] == "image")
    # what the root file system gives the image (preallocated) and what the image's own file system has free:
    # noise-free, unlike the root's free space, which the other work on this machine moves meanwhile
    blocks_before, image_free_before = os.stat(image["what"]).st_blocks, free_of(image["where"])
    try:
        r = run(env["policy"]["quota"], "slot0", 200 * MIB)
        blocks_after, image_free_after = os.stat(image["what"]).st_blocks, free_of(image["where"])
    finally:
        remove(big_files(env, "slot0"))
    assert r.returncode == 42, r.stderr  # the cell started and the payload ran to its end
    out = json.loads(r.stdout)
    ws, home = out["/workspace"], out["/home/chv"]
    assert ws["small"] == home["small"] == 4096, out  # control: small writes succeed
    assert ws["error"] == home["error"] == "ENOSPC", out  # past the quota: the slot's file system is full
    assert ws["written"] >= 32 * MIB, out  # the workspace took most of the 64M...
    assert ws["written"] + home["written"] < 64 * MIB, out  # ...and the home the rest: one quota for both
    # what the cell wrote went into the reserved image (its file system filled by that much), and the root
    # file system gave the image not one block more: the cell's bytes took nothing of /
    assert image_free_before - image_free_after >= ws["written"] + home["written"] - MIB, \
        (image_free_before, image_free_after, out)
    assert blocks_after == blocks_before, (blocks_before, blocks_after)


def test_control_without_quota_the_write_fills_the_root(env):
    """The old layout (slot directories on /, no disk_max): the same writes
    succeed and the root file system loses the bytes, so the test above
    can fail."""
    root_dev = os.stat("/").st_dev
    try:
        r = run(env["policy"]["none"], "slot1", 150 * MIB)
        # what the root file system gave the cell's files: their allocated blocks on its device (noise-free,
        # unlike the root's free space, which the other work on this machine moves meanwhile)
        # (lstat: a link the cell left is not followed; one call per file)
        held = [(st.st_dev, st.st_blocks * 512) for st in map(os.lstat, big_files(env, "slot1"))]
    finally:
        remove(big_files(env, "slot1"))
    assert r.returncode == 42, r.stderr
    out = json.loads(r.stdout)
    for where, got in out.items():
        assert got == {"small": 4096, "written": 150 * MIB, "error": None}, (where, got)
    assert [dev for dev, _n in held] == [root_dev, root_dev], (root_dev, held)
    assert all(n >= 150 * MIB for _dev, n in held), held


def test_launcher_refuses_a_slot_without_its_mounts(env):
    r = run(env["policy"]["quota"], "slot1", MIB)
    assert r.returncode == 125, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""  # the payload never ran
    ws = os.path.join(str(env["root"]), "ws", "slot1")
    assert "slot slot1: disk quota (disk_max 64M, role variable chv_cell_disk_max) not in force" in r.stderr
    assert "the workspace %s is not a mount point" % ws in r.stderr, r.stderr
    # the positive control in the same policy: slot0, whose mounts are there, runs
    try:
        ok = run(env["policy"]["quota"], "slot0", MIB)
    finally:
        remove(big_files(env, "slot0"))
    assert ok.returncode == 42, ok.stderr
    assert json.loads(ok.stdout)["/workspace"] == {"small": 4096, "written": MIB, "error": None}
