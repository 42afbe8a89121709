"""The per-slot disk quota: the launcher's pure parts (chv_guest/cell/disk.py: the
size string, the mount check against fake mountinfo texts, the policy key
disk_max) and the role's (the size in bytes, the fit check of tasks/disk.yml,
the mount units), evaluated as Ansible evaluates them."""

import copy
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cellrt  # noqa: F401  # pylint: disable=unused-import  (puts the launcher package on sys.path)
from chv_guest.cell import disk
from chv_guest.cell import policy as policymod

WS, HOME = "/var/lib/chv-fleet/workspaces", "/var/lib/chv-fleet/agent-state"
IMG = "/var/lib/chv-fleet/disks"


def line(mid, parent, dev, root, mountpoint, opts, fstype, source):
    return "%d %d %s %s %s %s shared:1 - %s %s rw\n" % (mid, parent, dev, root, mountpoint, opts, fstype, source)


ROOT_LINE = line(20, 1, "254:0", "/", "/", "rw,relatime", "ext4", "/dev/vda")


def slot_lines(slot, dev, mid, opts="rw,nosuid,nodev,relatime"):
    """The three mounts the role's units make for one slot."""
    return (line(mid, 20, dev, "/", "%s/%s" % (IMG, slot), opts, "ext4", "/dev/loop%s" % dev.split(":")[1])
            + line(mid + 1, 20, dev, "/workspace", "%s/%s" % (WS, slot), opts, "ext4", "/dev/loop0")
            + line(mid + 2, 20, dev, "/home", "%s/%s" % (HOME, slot), opts, "ext4", "/dev/loop0"))


def own(slot="slot0"):
    return {"workspace": "%s/%s" % (WS, slot), "home": "%s/%s" % (HOME, slot)}


OTHERS = ["%s/slot1" % WS, "%s/slot1" % HOME]


def problems(text, **kw):
    return disk.mount_problems(disk.parse_mountinfo(text), own(), OTHERS, **kw)


# --- sizes ---------------------------------------------------------------
@pytest.mark.parametrize("text, n", [("64M", 64 << 20), ("2G", 2 << 30), ("16M", 16 << 20), ("16384K", 16 << 20),
                                     ("1T", 1 << 40)])
def test_parse_size(text, n):
    assert disk.parse_size(text) == n


@pytest.mark.parametrize("text", ["2", "2GB", "2g", "2 G", "1.5G", "-1G", "0G", "G", "", None, 2048, "15M", "65T",
                                  "2GiB", "02G"])
def test_parse_size_refuses_and_names_the_variable(text):
    with pytest.raises(ValueError) as exc:
        disk.parse_size(text)
    assert "chv_cell_disk_max" in str(exc.value) and repr(text) in str(exc.value)


@given(st.integers(min_value=16, max_value=1 << 20), st.sampled_from(["K", "M", "G", "T"]))
def test_parse_size_is_the_unit_times_the_number(n, unit):
    factor = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}[unit]
    text = "%d%s" % (n, unit)
    if 16 << 20 <= n * factor <= 64 << 40:
        assert disk.parse_size(text) == n * factor
    else:
        with pytest.raises(ValueError):
            disk.parse_size(text)


# --- mountinfo -----------------------------------------------------------
def test_parse_mountinfo_unescapes_and_splits_options():
    m = disk.parse_mountinfo(line(30, 20, "7:3", "/a\\040b", "/mnt/x\\040y", "rw,nodev", "ext4", "/dev/loop3"))
    assert m == [{"dev": "7:3", "root": "/a b", "mountpoint": "/mnt/x y", "options": {"rw", "nodev"},
                  "fstype": "ext4", "source": "/dev/loop3"}]


def test_in_force_with_the_roles_mounts():
    text = ROOT_LINE + slot_lines("slot0", "7:3", 40) + slot_lines("slot1", "7:4", 50)
    assert problems(text, fs_size=60 << 20, disk_max=64 << 20) == []


def test_missing_mounts_are_named():
    # the old layout: the slot's directories are plain directories of /
    got = problems(ROOT_LINE)
    assert len(got) == 2
    assert "the home %s/slot0 is not a mount point" % HOME in got[0] and "mounted at /" in got[0]
    assert "the workspace %s/slot0 is not a mount point" % WS in got[1]


def test_image_mounted_but_binds_missing():
    text = ROOT_LINE + line(40, 20, "7:3", "/", IMG + "/slot0", "rw,nosuid,nodev", "ext4", "/dev/loop3")
    assert len(problems(text)) == 2


def test_one_bind_missing():
    text = ROOT_LINE + "".join(ln + "\n" for ln in slot_lines("slot0", "7:3", 40).splitlines() if "/home" not in ln)
    got = problems(text)
    assert len(got) == 1 and "home" in got[0]


def test_bind_of_a_root_directory_is_not_a_quota():
    # the image mount is missing, the binds were made from the directories under it (on /)
    text = (ROOT_LINE + line(41, 20, "254:0", "/var/lib/chv-fleet/disks/slot0/workspace", WS + "/slot0",
                             "rw,nosuid,nodev", "ext4", "/dev/vda")
            + line(42, 20, "254:0", "/var/lib/chv-fleet/disks/slot0/home", HOME + "/slot0", "rw,nosuid,nodev",
                   "ext4", "/dev/vda"))
    got = problems(text)
    assert len(got) == 2 and all("bind mount of the file system of /" in p for p in got)


def test_other_slot_on_the_same_file_system():
    text = ROOT_LINE + slot_lines("slot0", "7:3", 40) + slot_lines("slot1", "7:3", 50)
    got = problems(text)
    assert len(got) == 2 and all("another slot's" in p for p in got)


def test_workspace_and_home_on_different_file_systems():
    lines = slot_lines("slot0", "7:3", 40).splitlines(True)
    text = ROOT_LINE + lines[0] + lines[1] + lines[2].replace("7:3", "7:9")
    got = problems(text)
    assert any("different file systems" in p for p in got)


def test_options_required():
    text = ROOT_LINE + slot_lines("slot0", "7:3", 40, opts="rw,relatime")
    got = problems(text)
    assert len(got) == 2 and all("without nodev,nosuid" in p for p in got)


def test_file_system_larger_than_disk_max():
    text = ROOT_LINE + slot_lines("slot0", "7:3", 40)
    assert problems(text, fs_size=(64 << 20) + 1, disk_max=64 << 20) != []
    assert problems(text, fs_size=64 << 20, disk_max=64 << 20) == []


def test_a_later_mount_hides_an_earlier_one():
    # a bind of a directory of / mounted over the slot's own: the visible one counts
    text = (ROOT_LINE + slot_lines("slot0", "7:3", 40)
            + line(60, 41, "254:0", "/tmp/x", WS + "/slot0", "rw,nosuid,nodev", "ext4", "/dev/vda"))
    got = problems(text)
    assert got and "workspace" in got[0]


def test_check_slot_reads_the_policy_and_raises(tmp_path, policy):
    pol = copy.deepcopy(policy)
    pol["disk_max"] = "64M"
    pol["workspace_root"], pol["agent_state_root"] = str(tmp_path / "ws"), str(tmp_path / "st")
    slot = pol["slots"][0]
    paths = {"workspace": os.path.join(pol["workspace_root"], "slot0"),
             "agent_state": os.path.join(pol["agent_state_root"], "slot0")}
    mi = tmp_path / "mountinfo"
    mi.write_text(ROOT_LINE)

    class Refused(Exception):
        pass

    with pytest.raises(Refused) as exc:
        disk.check_slot(pol, slot, paths, Refused, mountinfo=str(mi))
    assert "chv_cell_disk_max" in str(exc.value) and paths["workspace"] in str(exc.value)
    pol["disk_max"] = None
    disk.check_slot(pol, slot, paths, Refused, mountinfo=str(mi))  # no quota asked: nothing checked


# --- the policy key ------------------------------------------------------
def test_policy_disk_max(raw_policy):
    assert policymod.merged(raw_policy)["disk_max"] is None
    raw_policy["disk_max"] = "2G"
    assert policymod.validate(raw_policy) == []
    raw_policy["disk_max"] = "2GB"
    errs = policymod.validate(raw_policy)
    assert len(errs) == 1 and errs[0].startswith("disk_max: chv_cell_disk_max '2GB' is not a size")
    raw_policy["disk_max"] = 2
    assert policymod.validate(raw_policy)[0].startswith("disk_max:")


# --- the role's side (vars/main.yml, templates), as Ansible evaluates it --
def role_env(disk_max="64M", slots=2):
    import darwin_render  # pylint: disable=import-outside-toplevel  (needs the collection path of tests/conftest.py)

    v = darwin_render.role_yaml("cell_runtime", "vars", "main.yml")
    env = {"chv_cell_identities": [{"name": "slot%d" % i, "uid_base": 3000000 + i * 65536} for i in range(slots)],
           "chv_cell_disk_max": disk_max, "chv_cell_workspace_root": WS, "chv_cell_agent_state_root": HOME}
    for key in ("__cell_runtime_disk_dir", "__cell_runtime_disk_marker", "__cell_runtime_disk_target"):
        env[key] = v[key]
    return darwin_render, v, env


@pytest.mark.parametrize("text", ["16M", "64M", "2G", "3T", "32768K"])
def test_role_reads_the_size_as_the_launcher_does(text):
    dr, v, env = role_env(text)
    assert int(dr.evaluate(v["__cell_runtime_disk_bytes"], **env)) == disk.parse_size(text)


def test_role_mounts_and_units_pass_the_launchers_mount_check():
    """The units the role renders, mounted as systemd mounts them, make a
    mountinfo that check_slot accepts; without them it refuses."""
    dr, v, env = role_env()
    mounts = dr.evaluate(v["__cell_runtime_disk_mounts"], **env)
    assert [(m["slot"], m["kind"]) for m in mounts] == [(s, k) for s in ("slot0", "slot1")
                                                          for k in ("image", "workspace", "home")]
    assert dr.evaluate(v["__cell_runtime_disk_mounts"], **dict(env, chv_cell_disk_max=None)) == []
    text, mid = ROOT_LINE, 40
    for i, m in enumerate(mounts):
        unit = dr.render("cell_runtime", "chv-cell-disk.mount.j2", __cell_runtime_disk_mount=m, **env)
        assert unit.startswith("# " + v["__cell_runtime_disk_marker"] + "\n")
        sec = dict(ln.split("=", 1) for ln in unit.split("[Mount]\n", 1)[1].splitlines() if "=" in ln)
        opts = set(sec["Options"].split(","))
        assert {"nodev", "nosuid"} <= opts
        if m["kind"] != "image":
            assert ("RequiresMountsFor=%s" % sec["What"]) in unit and "bind" in opts
        dev = "7:%d" % (i // 3)
        root = "/" if m["kind"] == "image" else "/" + m["kind"]
        text += line(mid + i, 20, dev, root, sec["Where"], "rw,nosuid,nodev", "ext4", "/dev/loop%d" % (i // 3))
    assert problems(text) == []
    target = dr.render("cell_runtime", "chv-cell-disks.target.j2", __cell_runtime_disk_unit_names=["a.mount"], **env)
    assert "Wants=a.mount\n" in target and "WantedBy=local-fs.target" in target


def fit_task():
    import darwin_render  # pylint: disable=import-outside-toplevel

    tasks = darwin_render.role_yaml("cell_runtime", "tasks", "disk.yml")
    return next(t for t in tasks if t["name"].startswith("Check that the slot images fit"))


def fit(images, avail, disk_max="1G"):
    """The fit check of tasks/disk.yml: (passes, message) for stat results
    ``images`` ({"exists", "size", "blocks"}) and ``avail`` free bytes."""
    dr, v, env = role_env(disk_max)
    task = fit_task()
    env.update({"__cell_runtime_disk_images": {"results": [{"stat": im} for im in images]},
                "__cell_runtime_disk_df": {"stdout_lines": ["Avail", " %d" % avail]},
                "__cell_runtime_disk_reserve": dr.evaluate(v["__cell_runtime_disk_reserve"])})
    env["__cell_runtime_disk_bytes"] = dr.evaluate(v["__cell_runtime_disk_bytes"], **env)
    for key in ("__cell_runtime_disk_missing", "__cell_runtime_disk_avail"):
        env[key] = dr.evaluate(task["vars"][key], **env)
    that = task["ansible.builtin.assert"]["that"]
    ok = dr.evaluate("{{ %s }}" % that, **env)
    return ok, dr.evaluate(task["ansible.builtin.assert"]["fail_msg"], **env)


def test_fit_check_counts_new_images_and_lost_reservations():
    g = 1 << 30
    new = {"exists": False}
    whole = {"exists": True, "size": g, "blocks": g // 512}
    trimmed = {"exists": True, "size": g, "blocks": (g // 2) // 512}  # an fstrim gave half back
    assert fit([new, new], 3 * g)[0] is True  # 2 G to allocate, 1 G reserve: exactly
    ok, msg = fit([new, new], 3 * g - 1)
    assert ok is False
    assert "chv_cell_disk_max 1G" in msg and "%d more bytes" % (2 * g) in msg and "nothing was changed" in msg
    assert fit([whole, whole], 0)[0] is True  # nothing to allocate: a full disk does not stop a converge
    assert fit([whole, trimmed], g + g // 2)[0] is True
    assert fit([whole, trimmed], g + g // 2 - 1)[0] is False
