#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: lab_guest
short_description: Boot or destroy one local systemd-nspawn lab guest
version_added: 0.1.0
description:
  - Unpacks a cached root file system (see M(chv.fleet_lab.lab_image)), boots it
    with C(systemd-nspawn -b) in cgroups of its own with the unified cgroup
    hierarchy, gives it a veth and a /30 to the lab host, a per-lab SSH key,
    its hostname and /etc/hosts, and waits until its sshd accepts connections.
  - With I(state=absent) stops the guest (orderly poweroff, then SIGKILL) and
    removes its processes, cgroups, veth, mounts, nspawn propagation
    directory and root directory; it fails if anything is left.
  - With I(state=rebooted) powers a running guest off (as I(state=absent)
    does) but keeps its root file system, then boots that root again with the
    same veth, addresses and cgroups. What a guest keeps across a reboot
    (files) stays, what it loses (processes, /run, the kernel's network and
    firewall state) is gone. It fails when the guest was never created.
  - With I(state=stopped) powers the guest off (as I(state=absent) does)
    and keeps its root file system in C(LAB_DIR/NAME/rootfs), for the
    guest image bake to generalize and write as a disk; I(state=absent)
    removes it later.
  - A guest that does not come up is reported with the tail of its console
    and removed (with I(state=rebooted), left stopped, its root kept).
  - Part of the local test lab (C(chv.fleet_lab.lab_up)); runs on the lab host as root.
extends_documentation_fragment: [ansible.builtin.action_common_attributes, chv.fleet_lab.lab]
options:
  name:
    description: Guest (machine and host) name; the host-side veth is C(ve-NAME).
    type: str
    required: true
  lab:
    description: Lab the guest belongs to (names its cgroups).
    type: str
    required: true
  state:
    description: Whether the guest should run.
    type: str
    choices: [started, absent, rebooted, stopped]
    default: started
  lab_dir:
    description: Directory of the lab's guests and state files.
    type: path
    required: true
  image:
    description: Image tarball to unpack. Required with I(state=started).
    type: path
  address:
    description: Guest address on its veth (I(prefixlen) bits). Required with I(state=started).
    type: str
  host_address:
    description: Lab host address on the guest's veth, the guest's default gateway.
    type: str
  ifname:
    description:
      - The guest-side name of its interface (nspawn names it C(host0); the
        lab renames it before configuring it, as a guest with another NIC
        name would have).
    type: str
    default: host0
  prefixlen:
    description: Prefix length of the guest link.
    type: int
    default: 30
  authorized_key:
    description: Public key allowed to log in as root.
    type: str
  nameservers:
    description:
      - Resolvers written to the guest's /etc/resolv.conf. Empty means no
        resolver (no lookup stalls; the guest has no route out).
    type: list
    elements: str
    default: []
  boot_timeout:
    description: Seconds to wait for sshd.
    type: int
    default: 60
"""

EXAMPLES = r"""
- name: Boot guest lab1
  chv.fleet_lab.lab_guest:
    name: lab1
    lab: lab
    lab_dir: /var/lib/chv-fleet-lab/lab
    image: /root/.cache/chv-fleet/images/bookworm-0123456789abcdef.tar.zst
    address: 10.99.0.2
    host_address: 10.99.0.1
    authorized_key: "{{ lookup('file', '/var/lib/chv-fleet-lab/lab/id_ed25519.pub') }}"
"""

RETURN = r"""
pid:
  description: PID of the guest's systemd-nspawn process.
  returned: when started
  type: int
leader:
  description: PID of the guest's init as the lab host sees it.
  returned: when started
  type: int
boot_seconds:
  description: Seconds from spawning nspawn to sshd accepting connections.
  returned: when booted by this run (started or rebooted)
  type: float
root:
  description: The guest's root file system (kept).
  returned: when state is stopped
  type: str
left_behind:
  description: What removal or the poweroff could not clean up (the module fails when not empty).
  returned: when state is absent or stopped
  type: list
  elements: str
"""

import errno
import fcntl
import json
import os
import shutil
import socket
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.chv.fleet_lab.plugins.module_utils import lab


# Loop devices, as a VM has them (docs/lab.md "Loop devices"): the
# cell_runtime role loop-mounts each slot's disk image. The kernel's loop
# devices are the lab host's, shared by every guest: each guest gets
# /dev/loop-control and the nodes of loop0..LOOP_DEVICES-1 bound in, and the
# lab host is given that many (LOOP_CTL_ADD) before a guest boots.
# LOOP_CTL_GET_FREE hands out the lowest free one, so this covers make
# test's ~8 guests x 4 slots with room for the host's own tests; a mount
# beyond it fails (the slot's launcher then refuses, fail closed).
LOOP_DEVICES = 64
LOOP_CONTROL = "/dev/loop-control"
LOOP_CTL_ADD = 0x4C80


def loop_devices(count=LOOP_DEVICES, wait=5.0):
    """The nodes /dev/loop0..count-1, each created (LOOP_CTL_ADD) where
    missing; devtmpfs makes the nodes, waited for up to ``wait`` s."""
    paths = ["/dev/loop%d" % n for n in range(count)]
    missing = [n for n, p in enumerate(paths) if not os.path.exists(p)]
    if missing:
        fd = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
        try:
            for n in missing:
                try:
                    fcntl.ioctl(fd, LOOP_CTL_ADD, n)
                except OSError as exc:
                    if exc.errno != errno.EEXIST:  # another boot added it meanwhile
                        raise lab.LabError("cannot add loop device %d: %s" % (n, exc.strerror))
        finally:
            os.close(fd)
    deadline = time.monotonic() + wait
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise lab.LabError("loop device nodes missing after LOOP_CTL_ADD: %s"
                               % ", ".join(p for p in paths if not os.path.exists(p)))
        time.sleep(0.01)
    return paths


class Guest(object):
    def __init__(self, module):
        self.m = module
        p = module.params
        self.name, self.lab = p["name"], p["lab"]
        self.dir = os.path.join(p["lab_dir"], self.name)
        self.root = os.path.join(self.dir, "rootfs")
        self.state_file = os.path.join(self.dir, "guest.json")
        self.console = os.path.join(p["lab_dir"], self.name + ".console")
        self.ifname = "ve-" + self.name
        self.cgroups = lab.guest_cgroups(self.lab, self.name)

    def read_state(self):
        try:
            with open(self.state_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def running_pid(self):
        pid = self.read_state().get("pid")
        if not pid or not lab.pid_alive(pid):
            return None
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return None
        if argv and argv[0].endswith(b"systemd-nspawn") and self.name.encode() in argv:
            return pid
        return None

    def leader(self, pid):
        try:
            with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def remnants(self):
        left = []
        pid = self.read_state().get("pid")
        if pid and lab.pid_alive(pid):
            left.append("process %d" % pid)
        for cg in self.cgroups:
            if os.path.isdir(cg):
                left.append("cgroup " + cg)
        if os.path.exists("/sys/class/net/" + self.ifname):
            left.append("veth " + self.ifname)
        if os.path.isdir(self.dir):
            left.extend("mount " + mp for mp in lab.mounts_under(self.dir))
            left.append("directory " + self.dir)
        prop = os.path.join(lab.PROPAGATE_DIR, self.name)
        if os.path.lexists(prop):
            left.append("propagate " + prop)
        return left

    def destroy(self):
        self.stop()
        if os.path.isdir(self.dir):
            for mp in lab.mounts_under(self.dir):
                self.m.run_command(["umount", "-l", mp])
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self):
        """Power the guest off and remove what it holds on the lab host (processes,
        cgroups, veth, nspawn's propagation directory); its directory stays."""
        pid = self.read_state().get("pid")
        if pid:
            lab.stop_pids([pid])
        for cg in self.cgroups:
            lab.stop_pids(sorted(lab.cgroup_pids(cg)), term_timeout=2.0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(lab.cgroup_pids(cg) for cg in self.cgroups):
            time.sleep(0.05)
        for cg in self.cgroups:
            lab.remove_cgroup_tree(cg)
        for parent in set(os.path.dirname(cg) for cg in self.cgroups):
            try:
                os.rmdir(parent)  # only succeeds when no other lab guest remains
            except OSError:
                pass
        if os.path.exists("/sys/class/net/" + self.ifname):
            self.m.run_command(["ip", "link", "del", self.ifname])
        prop = os.path.join(lab.PROPAGATE_DIR, self.name)
        if os.path.lexists(prop):
            shutil.rmtree(prop, ignore_errors=True)

    def prepare_root(self):
        p = self.m.params
        os.makedirs(self.root, mode=0o755)
        self.run(["tar", "--zstd", "-xpf", p["image"], "-C", self.root])
        etc = os.path.join(self.root, "etc")
        self.write(os.path.join(etc, "hostname"), self.name + "\n")
        self.write(os.path.join(etc, "hosts"),
                   "127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost\n" % self.name)
        self.write(os.path.join(etc, "resolv.conf"),
                   "".join("nameserver %s\n" % ns for ns in p["nameservers"]))
        self.write(os.path.join(etc, "machine-id"), "")
        ssh_dir = os.path.join(self.root, "root", ".ssh")
        os.makedirs(ssh_dir, mode=0o700, exist_ok=True)
        self.write(os.path.join(ssh_dir, "authorized_keys"), p["authorized_key"].strip() + "\n", 0o600)
        for key in os.listdir(os.path.join(etc, "ssh")):
            if key.startswith("ssh_host_"):
                os.unlink(os.path.join(etc, "ssh", key))
        self.run(["ssh-keygen", "-A", "-f", self.root])  # per-guest host keys

    def boot(self):
        """Start nspawn detached (own session via setsid, own cgroups) and return its pid.

        The shell moves itself into the guest's cgroups, redirects its output to
        the console log and execs nspawn, so the pid it records is nspawn's."""
        p = self.m.params
        nspawn = self.m.get_bin_path("systemd-nspawn", required=True)
        pid_file = os.path.join(self.dir, "nspawn.pid")
        if os.path.exists(pid_file):
            os.unlink(pid_file)  # the previous boot's (state=rebooted)
        script = ('exec >"$1" 2>&1 </dev/null; shift; '
                  'for cg in $CHV_LAB_CGROUPS; do mkdir -p "$cg" && echo $$ > "$cg/cgroup.procs" || exit 97; done; '
                  'echo $$ > "$CHV_LAB_PIDFILE"; exec "$@"')
        cmd = [self.m.get_bin_path("setsid", required=True), "-f", "/bin/sh", "-c", script, "sh", self.console,
               nspawn, "-b", "-D", self.root, "-M", self.name, "--register=no", "--keep-unit",
               "--network-veth", "--resolv-conf=off", "--timezone=off", "--link-journal=no",
               "--bind=" + LOOP_CONTROL] + ["--bind=" + dev for dev in loop_devices()]
        env = dict(SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1", CHV_LAB_CGROUPS=" ".join(self.cgroups),
                   CHV_LAB_PIDFILE=pid_file)
        self.run(cmd, environ_update=env)
        deadline = time.monotonic() + 10
        while not os.path.exists(pid_file) or not open(pid_file).read().strip():
            if time.monotonic() > deadline:
                raise lab.LabError("systemd-nspawn did not start within 10 s")
            time.sleep(0.01)
        with open(pid_file) as f:
            pid = int(f.read())
        self.write(self.state_file, json.dumps({"pid": pid, "address": p["address"]}) + "\n", 0o600)
        return pid

    def configure_network(self, pid):
        p = self.m.params
        deadline = time.monotonic() + 15
        leader = None
        while time.monotonic() < deadline:
            if not lab.pid_alive(pid):
                raise lab.LabError("systemd-nspawn exited")
            leader = self.leader(pid)
            if leader and os.path.exists("/sys/class/net/" + self.ifname):
                break
            time.sleep(0.02)
        else:
            raise lab.LabError("veth %s or the guest's init did not appear within 15 s" % self.ifname)
        self.run(["ip", "addr", "replace", "%s/%d" % (p["host_address"], p["prefixlen"]), "dev", self.ifname])
        self.run(["ip", "link", "set", self.ifname, "up"])
        ns = ["nsenter", "-t", str(leader), "-n", "ip"]
        self.run(ns + ["link", "set", "lo", "up"])
        if p["ifname"] != "host0":
            self.run(ns + ["link", "set", "host0", "name", p["ifname"]])
        self.run(ns + ["addr", "replace", "%s/%d" % (p["address"], p["prefixlen"]), "dev", p["ifname"]])
        self.run(ns + ["link", "set", p["ifname"], "up"])
        self.run(ns + ["route", "replace", "default", "via", p["host_address"]])
        return leader

    def wait_ssh(self, pid):
        p = self.m.params
        deadline = time.monotonic() + p["boot_timeout"]
        while time.monotonic() < deadline:
            if not lab.pid_alive(pid):
                raise lab.LabError("systemd-nspawn exited during boot")
            try:
                with socket.create_connection((p["address"], 22), timeout=0.5) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise lab.LabError("sshd on %s did not answer within %d s" % (p["address"], p["boot_timeout"]))

    def run(self, cmd, environ_update=None):
        rc, out, err = self.m.run_command(cmd, environ_update=environ_update)
        if rc != 0:
            raise lab.LabError("%s failed (rc=%d): %s" % (" ".join(cmd), rc, err.strip()))
        return out

    @staticmethod
    def write(path, content, mode=0o644):
        with open(path, "w") as f:
            f.write(content)
        os.chmod(path, mode)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            lab=dict(type="str", required=True),
            state=dict(type="str", default="started", choices=["started", "absent", "rebooted", "stopped"]),
            lab_dir=dict(type="path", required=True),
            image=dict(type="path"),
            address=dict(type="str"),
            host_address=dict(type="str"),
            ifname=dict(type="str", default="host0"),
            prefixlen=dict(type="int", default=30),
            authorized_key=dict(type="str", no_log=False),
            nameservers=dict(type="list", elements="str", default=[]),
            boot_timeout=dict(type="int", default=60),
        ),
        required_if=[("state", "started", ("image", "address", "host_address", "authorized_key")),
                     ("state", "rebooted", ("address", "host_address"))],
        supports_check_mode=True,
    )
    try:
        lab.validate_name(module.params["name"], "name")
        lab.validate_name(module.params["lab"], "lab")
    except lab.LabError as exc:
        module.fail_json(msg=str(exc))
    guest = Guest(module)

    if module.params["state"] == "absent":
        left = guest.remnants()
        if not left:
            module.exit_json(changed=False, left_behind=[])
        if module.check_mode:
            module.exit_json(changed=True, left_behind=[])
        guest.destroy()
        left = guest.remnants()
        if left:
            module.fail_json(msg="guest %s could not be removed completely" % guest.name, left_behind=left)
        module.exit_json(changed=True, left_behind=[])

    if module.params["state"] == "stopped":
        if not os.path.isdir(guest.root):
            module.fail_json(msg="guest %s has no root file system in %s" % (guest.name, guest.dir))
        was_running = guest.running_pid() is not None
        if module.check_mode:
            module.exit_json(changed=was_running, root=guest.root)
        guest.stop()
        left = [r for r in guest.remnants() if not r.startswith("directory ")]
        if left:
            module.fail_json(msg="guest %s could not be stopped completely" % guest.name, left_behind=left)
        module.exit_json(changed=was_running, root=guest.root, left_behind=[])

    rebooted = module.params["state"] == "rebooted"
    if rebooted and not os.path.isdir(guest.root):
        module.fail_json(msg="guest %s has no root file system in %s to reboot" % (guest.name, guest.dir))
    pid = guest.running_pid()
    if pid and not rebooted:
        module.exit_json(changed=False, pid=pid, leader=guest.leader(pid))
    if module.check_mode:
        module.exit_json(changed=True)
    if rebooted:
        guest.stop()
    else:
        guest.destroy()  # remnants of a guest that died
    start = time.monotonic()
    try:
        if not rebooted:
            guest.prepare_root()
        pid = guest.boot()
        leader = guest.configure_network(pid)
        guest.wait_ssh(pid)
    except (lab.LabError, OSError) as exc:
        console = lab.tail(guest.console)
        if rebooted:
            guest.stop()
        else:
            guest.destroy()
        module.fail_json(msg="guest %s failed to boot: %s" % (guest.name, exc), console_tail=console,
                         left_behind=guest.remnants())
    module.exit_json(changed=True, pid=pid, leader=leader, boot_seconds=round(time.monotonic() - start, 2))


if __name__ == "__main__":
    main()
