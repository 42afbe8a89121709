"""The lab guest Molecule converged is a real systemd machine reached over SSH."""


def test_guest_runs_systemd_as_pid1(host):
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"


def test_guest_is_running(host):
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), state


def test_guest_has_unified_cgroup_hierarchy(host):
    assert host.file("/sys/fs/cgroup/cgroup.controllers").exists
    assert host.run("stat -fc %T /sys/fs/cgroup").stdout.strip() == "cgroup2fs"


def test_role_packages_installed(host):
    for pkg in ("systemd-container", "iproute2", "python3"):
        assert host.package(pkg).is_installed, pkg


def test_install_path_installed_what_the_image_lacked(host):
    """On the minimal image (scenario `install`) the roles installed their
    packages from the Debian mirror after the guest booted; on baked images
    they came with the image, installed before the guest booted."""
    boot = int(host.run("date -d \"$(ps -o lstart= -p 1)\" +%s").stdout)
    line = host.run("grep ' status installed systemd-container:' /var/log/dpkg.log | tail -n1").stdout
    installed = int(host.run("date -d '%s' +%%s" % " ".join(line.split()[:2])).stdout)
    minimal = host.backend.get_hostname().startswith("mins")
    assert (installed >= boot) == minimal, (line, boot)
