#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: lab_generalize
short_description: Generalize a converged guest's root file system into a guest image
version_added: 0.3.0
description:
  - Works on the root file system of a powered-off lab guest (see
    M(chv.fleet_lab.lab_guest) with I(state=stopped)) that C(site.yml)
    converged, so that every guest booted from the image it becomes is a
    machine of its own.
  - Removes what belongs to one machine, so that each booted guest makes its
    own on first boot or at its first C(site.yml) run - the machine-id
    (emptied; systemd makes one on first boot), the SSH host keys
    (cloud-init, or C(ssh-keygen -A) before sshd, makes new ones), the slot
    identity ledger and the cell policy rendered from it (the guest's first
    C(site.yml) run allocates its identities against its own interfaces and
    routes; until then C(chv-cell) refuses to start cells), the lab's SSH
    keys, cloud-init's instance state, the logs and journals, apt's package
    lists and caches, temporary files and the random seed.
  - Writes what a VM needs and an nspawn guest does not have - C(/etc/fstab)
    with the root file system by label, C(systemd-networkd) enabled with a
    DHCP fallback for the VM's NIC, cloud-init's datasources (NoCloud,
    ConfigDrive), an sshd drop-in that makes missing host keys, a neutral
    hostname and C(/etc/hosts).
  - Part of the guest image bake (C(chv.fleet_lab.bake_image)); runs on the lab host as root.
extends_documentation_fragment: [ansible.builtin.action_common_attributes, chv.fleet_lab.lab]
options:
  root:
    description: The root file system to generalize (the guest must be powered off).
    type: path
    required: true
  hostname:
    description: Hostname of the image until cloud-init sets the guest's own.
    type: str
    default: chv-guest
  label:
    description: File system label of the root file system (C(/etc/fstab) mounts it by label).
    type: str
    default: chv-root
  ledger:
    description: The slot identity ledger (chv_cell_ledger), relative to I(root).
    type: str
    default: var/lib/chv-fleet/identities.json
  policy:
    description: The cell policy (chv_cell_policy_path), relative to I(root).
    type: str
    default: etc/chv-fleet/cell-policy.json
"""

EXAMPLES = r"""
- name: Generalize the converged guest
  chv.fleet_lab.lab_generalize:
    root: /var/lib/chv-fleet-lab/chvbake/chvbake1/rootfs
"""

RETURN = r"""
removed:
  description: Paths (relative to I(root)) removed or emptied.
  returned: always
  type: list
  elements: str
written:
  description: Paths (relative to I(root)) written.
  returned: always
  type: list
  elements: str
"""

import glob
import os
import shutil

from ansible.module_utils.basic import AnsibleModule

# Per-machine state, relative to the root: globs of files or directories to remove.
REMOVE = [
    "etc/ssh/ssh_host_*",
    "root/.ssh/authorized_keys",
    "home/*/.ssh/authorized_keys",
    "root/.ansible",
    "home/*/.ansible",
    "root/.bash_history",
    "root/.cache",
    "var/lib/cloud",
    "var/lib/systemd/random-seed",
    "var/lib/systemd/credential.secret",
    "var/log/journal/*",
    "var/cache/apt/*.bin",
    "var/cache/apt/archives/*.deb",
    "var/cache/debconf/*-old",
    "var/lib/apt/lists/*_*",
    "tmp/*",
    "var/tmp/*",
]

FALLBACK_NETWORK = """\
# chv.fleet guest image: DHCP on the VM's NIC when cloud-init wrote no
# network configuration of its own (its files, 10-cloud-init-*.network,
# come first). Only en*/eth* NICs: the cells' host-side veths are
# configured by chv-cell, never by networkd.
[Match]
Name=en* eth*
Type=ether

[Network]
DHCP=ipv4
LinkLocalAddressing=no
IPv6AcceptRA=no
"""

CLOUD_CFG = """\
# chv.fleet guest image: the SSH key and the hostname come from a NoCloud
# seed (a disk labelled cidata) or a config drive; nothing is asked of a
# metadata service.
datasource_list: [NoCloud, ConfigDrive, None]
preserve_hostname: false
# the one locale the image has without locale-gen (cloud-init's default,
# en_US.UTF-8, is not generated: update-locale would fail)
locale: C.UTF-8
ssh_deletekeys: true
ssh_genkeytypes: [ed25519, ecdsa, rsa]
# a seed's network-config is written for systemd-networkd (the image has no
# ifupdown and no netplan)
system_info:
  network:
    renderers: [networkd]
"""

SSH_DROPIN = """\
# chv.fleet guest image: the image carries no SSH host keys; make the
# missing ones before sshd checks its configuration (cloud-init makes
# them first when it runs).
[Service]
ExecStartPre=
ExecStartPre=/usr/bin/ssh-keygen -A
ExecStartPre=/usr/sbin/sshd -t
"""

NETWORKD_LINKS = {
    "etc/systemd/system/multi-user.target.wants/systemd-networkd.service": "systemd-networkd.service",
    "etc/systemd/system/sockets.target.wants/systemd-networkd.socket": "systemd-networkd.socket",
    "etc/systemd/system/dbus-org.freedesktop.network1.service": "systemd-networkd.service",
}


def unit_dir(root):
    for d in ("usr/lib/systemd/system", "lib/systemd/system"):
        if os.path.exists(os.path.join(root, d, "systemd-networkd.service")):
            return "/" + d
    return None


def plan(root, hostname, label, ledger, policy):
    """What generalizing ``root`` removes and writes: (removals, files, links)."""
    removals = []
    for pattern in REMOVE + [ledger, ledger + ".lock", policy]:
        removals.extend(sorted(glob.glob(os.path.join(root, pattern))))
    dbus_id = os.path.join(root, "var/lib/dbus/machine-id")
    if os.path.isfile(dbus_id) and not os.path.islink(dbus_id):
        removals.append(dbus_id)  # a copy of the bake guest's machine-id (a link to /etc/machine-id is kept)
    for path in sorted(glob.glob(os.path.join(root, "var/log/**"), recursive=True)):
        if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) > 0 \
                and not path.startswith(os.path.join(root, "var/log/journal")):
            removals.append(path)  # emptied, not removed (the packages' log files stay)
    files = {
        "etc/machine-id": ("", 0o444),
        "etc/hostname": (hostname + "\n", 0o644),
        "etc/hosts": ("127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost ip6-loopback\n" % hostname, 0o644),
        "etc/resolv.conf": ("", 0o644),
        "etc/fstab": ("LABEL=%s / ext4 rw,errors=remount-ro 0 1\n" % label, 0o644),
        "etc/systemd/network/90-chv-image-fallback.network": (FALLBACK_NETWORK, 0o644),
        "etc/cloud/cloud.cfg.d/91-chv-image.cfg": (CLOUD_CFG, 0o644),
        "etc/systemd/system/ssh.service.d/chv-image-host-keys.conf": (SSH_DROPIN, 0o644),
    }
    units = unit_dir(root)
    links = dict((k, units + "/" + v) for k, v in NETWORKD_LINKS.items()) if units else {}
    return removals, files, links


def main():
    module = AnsibleModule(
        argument_spec=dict(
            root=dict(type="path", required=True),
            hostname=dict(type="str", default="chv-guest"),
            label=dict(type="str", default="chv-root"),
            ledger=dict(type="str", default="var/lib/chv-fleet/identities.json"),
            policy=dict(type="str", default="etc/chv-fleet/cell-policy.json"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    root = p["root"]
    if not os.path.isfile(os.path.join(root, "etc/os-release")) and not os.path.islink(os.path.join(root, "etc/os-release")):
        module.fail_json(msg="%s is not a root file system (no etc/os-release)" % root)
    if os.path.ismount(os.path.join(root, "proc")):
        module.fail_json(msg="%s/proc is mounted: power the guest off first" % root)
    removals, files, links = plan(root, p["hostname"], p["label"], p["ledger"].lstrip("/"), p["policy"].lstrip("/"))
    if not links:
        module.fail_json(msg="systemd-networkd.service not found in %s" % root)
    rel = [os.path.relpath(x, root) for x in removals]
    written = sorted(list(files) + list(links))
    if module.check_mode:
        module.exit_json(changed=True, removed=rel, written=written)
    for path in removals:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif path.startswith(os.path.join(root, "var/log/")) and not path.startswith(os.path.join(root, "var/log/journal")):
            with open(path, "w"):
                pass
        else:
            os.unlink(path)
    for name, (content, mode) in files.items():
        path = os.path.join(root, name)
        if os.path.islink(path):
            os.unlink(path)  # e.g. a resolv.conf link: the image gets a file
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
        os.chmod(path, mode)
    for name, target in links.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
    module.exit_json(changed=True, removed=rel, written=written)


if __name__ == "__main__":
    main()
