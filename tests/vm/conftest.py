"""Guests booted from the baked CHV guest image under qemu (TCG), with the
devices a Cloud Hypervisor guest has: virtio-blk disks (the image through a
qcow2 overlay, the cloud-init NoCloud seed), virtio-net, virtio-rng, a serial
console and a direct kernel boot with the image's kernel, initrd and command
line (docs/chv.md).

The image is $CHV_IMAGE (a path without the .qcow2 suffix; make test-vm
passes build/image/chv-guest-bookworm). Each VM's network is qemu's user
mode with restrict=on: the guest reaches nothing outside the VM (no
download can happen), and its sshd is forwarded to a port on 127.0.0.1.
Everything lives in a temporary directory and is removed, qemu processes
included, when the session ends."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

IMAGE = os.environ.get("CHV_IMAGE", "")
BOOT_TIMEOUT = float(os.environ.get("CHV_VM_BOOT_TIMEOUT", "600"))
REPORT_DIR = os.environ.get("CHV_VM_REPORT_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build", "reports", "vm"))
SSH_OPTS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]


# The static network of a CHV guest whose host serves no DHCP (docs/chv.md), here on
# qemu's user network: the guest 10.0.2.20 (qemu's DHCP would give 10.0.2.15), its gateway and resolver 10.0.2.2/.3.
NETWORK_CONFIG = """\
version: 2
ethernets:
  nic0:
    match:
      macaddress: "%s"
    addresses: [10.0.2.20/24]
    routes:
      - to: 0.0.0.0/0
        via: 10.0.2.2
    nameservers:
      addresses: [10.0.2.3]
"""


# vm1: DHCP, as the image does by itself; qemu's user network with restrict=on answers
# DHCP without a router option, so the seed adds the default route.
NETWORK_CONFIG_DHCP = """\
version: 2
ethernets:
  nic0:
    match:
      macaddress: "%s"
    dhcp4: true
    routes:
      - to: 0.0.0.0/0
        via: 10.0.2.2
"""


# Destinations outside the VM for the audit (test_vm.ALLOWED, DENIED): qemu's
# user network forwards a guest's connection to them, restrict=on or not,
# to a process of its own on this machine (guestfwd cmd:) that answers as
# chv-cell audit's listener does (answer.py). Nothing leaves this machine.
ANSWER = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "answer.py")]
GUESTFWD = ["guestfwd=tcp:%s-cmd:%s" % (dest, " ".join(ANSWER)) for dest in ("10.0.2.100:80", "10.0.2.101:80")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VM(object):
    """One qemu guest booted from the image (an overlay of it) and its own seed."""

    def __init__(self, name, workdir, manifest, key, mac, static=False, mem_mb=2048, cpus=1):
        self.name = name
        self.mac = mac
        # static: a cloud-init network-config with the address (qemu's user network 10.0.2.0/24), as on a CHV
        # host without DHCP; otherwise the image's DHCP fallback
        self.static = static
        self.address = "10.0.2.20" if static else "10.0.2.15"
        self.dir = os.path.join(workdir, name)
        self.manifest = manifest
        self.key = key
        self.mem_mb, self.cpus = mem_mb, cpus
        self.port = free_port()
        self.proc = None
        self.started = None
        self.banner_seconds = None
        self.login_seconds = None
        self.console = os.path.join(self.dir, "console.log")

    def _seed(self):
        seed = os.path.join(self.dir, "seed")
        os.makedirs(seed)
        with open(self.key + ".pub") as f:
            pub = f.read().strip()
        with open(os.path.join(seed, "meta-data"), "w") as f:
            f.write("instance-id: chv-test-%s\nlocal-hostname: %s\n" % (self.name, self.name))
        with open(os.path.join(seed, "user-data"), "w") as f:
            # the resolver: qemu's user network serves DNS at 10.0.2.3 (nothing gets through
            # restrict=on), as a CHV host that serves DNS to its guests at their gateway
            f.write("#cloud-config\nhostname: %s\nmanage_etc_hosts: true\ndisable_root: false\n"
                    "users: []\nssh_authorized_keys:\n  - %s\n"
                    "write_files:\n  - path: /etc/resolv.conf\n    content: |\n      nameserver 10.0.2.3\n"
                    % (self.name, pub))
        files = [os.path.join(seed, "user-data"), os.path.join(seed, "meta-data")]
        with open(os.path.join(seed, "network-config"), "w") as f:
            f.write((NETWORK_CONFIG if self.static else NETWORK_CONFIG_DHCP) % self.mac)
        files.append(os.path.join(seed, "network-config"))
        img = os.path.join(self.dir, "seed.img")
        subprocess.run(["mkfs.vfat", "-n", "CIDATA", "-C", img, "2048"], check=True, capture_output=True)
        subprocess.run(["mcopy", "-i", img] + files + ["::"], check=True, capture_output=True)
        return img

    def argv(self, disk, seed):
        m = self.manifest
        return ["qemu-system-x86_64", "-accel", "tcg", "-machine", "q35", "-cpu", "max",
                "-smp", str(self.cpus), "-m", str(self.mem_mb), "-nodefaults", "-display", "none", "-no-reboot",
                "-kernel", m["kernel"], "-initrd", m["initrd"], "-append", m["cmdline"],
                "-drive", "file=%s,if=virtio,format=qcow2" % disk,
                "-drive", "file=%s,if=virtio,format=raw,readonly=on" % seed,
                "-netdev", "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:%d-%s:22,%s"
                % (self.port, self.address, ",".join(GUESTFWD)),
                "-device", "virtio-net-pci,netdev=net0,mac=%s,romfile=" % self.mac,
                "-device", "virtio-rng-pci",
                "-serial", "file:" + self.console]

    def start(self):
        os.makedirs(self.dir)
        disk = os.path.join(self.dir, "disk.qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", self.manifest["qcow2"], "-F", "qcow2", disk],
                       check=True, capture_output=True)
        seed = self._seed()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv(disk, seed), stdin=subprocess.DEVNULL,
                                     stdout=open(os.path.join(self.dir, "qemu.out"), "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ssh(self):
        """Seconds from starting qemu to the SSH banner, and to the first login with the seed's key."""
        deadline = self.started + BOOT_TIMEOUT
        while self.banner_seconds is None:
            self._check_alive(deadline)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.settimeout(5)
                    if s.recv(4).startswith(b"SSH-"):
                        self.banner_seconds = time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        while self.login_seconds is None:
            self._check_alive(deadline)
            if self.ssh("true", timeout=60, check=False).returncode == 0:
                self.login_seconds = time.monotonic() - self.started
            else:
                time.sleep(1)

    def _check_alive(self, deadline):
        if self.proc.poll() is not None:
            raise AssertionError("%s: qemu exited %s; console tail:\n%s"
                                 % (self.name, self.proc.returncode, self.console_tail()))
        if time.monotonic() > deadline:
            raise AssertionError("%s: no SSH login within %d s; console tail:\n%s"
                                 % (self.name, BOOT_TIMEOUT, self.console_tail()))

    def console_tail(self, n=40):
        try:
            with open(self.console, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def ssh(self, command, timeout=300, check=True, user="root"):
        proc = subprocess.run(["ssh", "-i", self.key, "-p", str(self.port)] + SSH_OPTS
                              + ["%s@127.0.0.1" % user, command],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError("%s: %r exited %d\nstdout: %s\nstderr: %s" % (
                self.name, command, proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:]))
        return proc

    def host_key(self):
        proc = subprocess.run(["ssh-keyscan", "-T", "20", "-t", "ed25519", "-p", str(self.port), "127.0.0.1"],
                              capture_output=True, text=True, timeout=60, check=False)
        keys = [line.split()[-1] for line in proc.stdout.splitlines() if line and not line.startswith("#")]
        return keys[0] if keys else None

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def _load_manifest():
    if not IMAGE:
        pytest.skip("CHV_IMAGE is not set (make test-vm sets it to the baked image)")
    path = IMAGE + ".json"
    if not os.path.exists(path):
        pytest.skip("no baked image at %s.qcow2 (make image)" % IMAGE)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def manifest():
    return _load_manifest()


@pytest.fixture(scope="session")
def report():
    """Figures the tests measure, written to build/reports/vm-<distro>/vm-test.json at the end."""
    data = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    yield data
    data["session_seconds"] = round(time.monotonic() - t0, 1)
    os.makedirs(REPORT_DIR, exist_ok=True)
    with open(os.path.join(REPORT_DIR, "vm-test.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


@pytest.fixture(scope="session")
def vms(manifest, report):
    """Two guests booted at once from the same image: vm1 and vm2."""
    for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.vfat", "mcopy", "ssh", "ssh-keyscan"):
        if not shutil.which(tool):
            pytest.fail("%s is missing (make test-vm installs it)" % tool)
    workdir = tempfile.mkdtemp(prefix="chv-vm-test-")
    key = os.path.join(workdir, "id_ed25519")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    guests = [VM("vm1", workdir, manifest, key, "52:54:00:c4:00:01"),
              VM("vm2", workdir, manifest, key, "52:54:00:c4:00:02", static=True)]
    try:
        for g in guests:
            g.start()
        errors = []

        def wait(g):
            try:
                g.wait_ssh()
            except AssertionError as exc:
                errors.append(str(exc))
        threads = [threading.Thread(target=wait, args=(g,)) for g in guests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, "\n".join(errors)
        report["boot"] = dict((g.name, {"to_ssh_banner_s": round(g.banner_seconds, 1),
                                        "to_ssh_login_s": round(g.login_seconds, 1)}) for g in guests)
        yield guests
    finally:
        for g in guests:
            g.stop()
        os.makedirs(REPORT_DIR, exist_ok=True)
        for g in guests:
            if os.path.exists(g.console):
                shutil.copyfile(g.console, os.path.join(REPORT_DIR, g.name + ".console.log"))
        shutil.rmtree(workdir, ignore_errors=True)
        left = [g.name for g in guests if g.proc and g.proc.poll() is None]
        assert not left, "qemu still running for %s" % left
