"""The lab guest Molecule converged is a real systemd machine reached over SSH."""


def test_guest_runs_systemd_as_pid1(host):
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"


def test_guest_is_running(host):
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), state


def test_guest_has_unified_cgroup_hierarchy(host):
    assert host.file("/sys/fs/cgroup/cgroup.controllers").exists
    assert host.run("stat -fc %T /sys/fs/cgroup").stdout.strip() == "cgroup2fs"
