#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: lab_disk
short_description: Write a root file system as a bootable CHV guest disk (qcow2) with its kernel and initrd
version_added: 0.3.0
description:
  - Makes an ext4 file system from a root directory without mounting
    anything (C(mkfs.ext4 -d)), puts it as the first partition of an MBR
    disk (C(sfdisk)), and converts the disk to qcow2 (C(qemu-img convert);
    unallocated clusters stay out of the file), compressed with zlib by
    default (I(compress)).
  - Copies the kernel (C(/boot/vmlinuz-*)) and initrd (C(/boot/initrd.img-*))
    of the root file system beside the disk, for direct kernel boot.
  - Reports the sizes and where the space goes (a C(du) of the root file
    system) and writes them to C(NAME.json) beside the disk.
  - Part of the guest image bake (C(chv.fleet_lab.bake_image)); runs on the lab host as root.
extends_documentation_fragment: [ansible.builtin.action_common_attributes, chv.fleet_lab.lab]
options:
  root:
    description: The (generalized) root file system.
    type: path
    required: true
  dest:
    description: Output directory.
    type: path
    required: true
  name:
    description: Stem of the output files (C(NAME.qcow2), C(NAME-vmlinuz), C(NAME-initrd.img), C(NAME.json)).
    type: str
    default: chv-guest
  label:
    description: ext4 label of the root file system (the image's C(/etc/fstab) mounts it by label).
    type: str
    default: chv-root
  min_size_mb:
    description: Smallest size of the root file system (MiB); it is at least the content plus I(free_mb).
    type: int
    default: 3072
  free_mb:
    description: Free space (MiB) the root file system keeps at least.
    type: int
    default: 1024
  compress:
    description:
      - Compress the qcow2's clusters (zlib). Cloud Hypervisor reads
        compressed qcow2 from v50 on; older versions need an uncompressed
        qcow2 or a raw disk (C(qemu-img convert -O raw)). C(NAME.json)
        reports the size of the uncompressed qcow2 either way.
    type: bool
    default: true
  cmdline:
    description: The kernel command line recorded in C(NAME.json) (the one the docs and the VM test use).
    type: str
    default: root=/dev/vda1 rw console=ttyS0
"""

EXAMPLES = r"""
- name: Write the guest disk
  chv.fleet_lab.lab_disk:
    root: /var/lib/chv-fleet-lab/chvbake/chvbake1/rootfs
    dest: /work/main/build/image
"""

RETURN = r"""
qcow2:
  description: Path of the qcow2 disk.
  returned: changed
  type: str
qcow2_bytes:
  description: Size of the qcow2 file.
  returned: changed
  type: int
uncompressed_qcow2_bytes:
  description: Size the same qcow2 takes without compression (C(qemu-img measure)).
  returned: changed
  type: int
kernel:
  description: Path of the kernel for direct kernel boot.
  returned: changed
  type: str
initrd:
  description: Path of the initrd.
  returned: changed
  type: str
kernel_version:
  description: The kernel's release.
  returned: changed
  type: str
used_bytes:
  description: Bytes the root file system's files take (hard links counted once).
  returned: changed
  type: int
fs_mb:
  description: Size of the root file system (MiB).
  returned: changed
  type: int
du:
  description: Bytes per top-level directory and the largest directories three levels down.
  returned: changed
  type: dict
seconds:
  description: Seconds the disk took to write.
  returned: changed
  type: float
"""

import json
import os
import re
import shutil
import time

from ansible.module_utils.basic import AnsibleModule

MIB = 1024 * 1024
SECTOR = 512
PART_START = 2048  # sectors: the partition starts at 1 MiB


def du(root, depth=3):
    """Allocated bytes per directory up to ``depth`` levels below ``root``
    (hard links counted once, mount points not crossed)."""
    sizes = {}
    seen = set()
    dev = os.lstat(root).st_dev
    for top, dirs, files in os.walk(root):
        rel = os.path.relpath(top, root)
        parts = [] if rel == "." else rel.split(os.sep)
        dirs[:] = [d for d in dirs if os.lstat(os.path.join(top, d)).st_dev == dev]
        total = 0
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            st = os.lstat(os.path.join(top, name))
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
        for i in range(0, min(len(parts), depth) + 1):
            key = "/" + "/".join(parts[:i])
            sizes[key] = sizes.get(key, 0) + total
    return sizes


def breakdown(sizes, top_n=15):
    used = sizes.get("/", 0)
    level1 = sorted(((k, v) for k, v in sizes.items() if k.count("/") == 1 and k != "/"), key=lambda kv: -kv[1])
    deep = sorted(((k, v) for k, v in sizes.items() if k.count("/") == 3), key=lambda kv: -kv[1])[:top_n]
    return {"total": used, "top": [{"path": k, "bytes": v} for k, v in level1],
            "largest": [{"path": k, "bytes": v} for k, v in deep]}


def fs_size_mb(used, min_mb, free_mb):
    need = int(used * 1.10 / MIB) + free_mb  # ext4's metadata and reserve
    return max(min_mb, -(-need // 64) * 64)


def kernel_files(root):
    boot = os.path.join(root, "boot")
    versions = sorted((n[len("vmlinuz-"):] for n in os.listdir(boot) if n.startswith("vmlinuz-")),
                      key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.-]", v)])
    for v in reversed(versions):
        initrd = os.path.join(boot, "initrd.img-" + v)
        if os.path.exists(initrd):
            return v, os.path.join(boot, "vmlinuz-" + v), initrd
    return None, None, None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            root=dict(type="path", required=True),
            dest=dict(type="path", required=True),
            name=dict(type="str", default="chv-guest"),
            label=dict(type="str", default="chv-root"),
            min_size_mb=dict(type="int", default=3072),
            free_mb=dict(type="int", default=1024),
            cmdline=dict(type="str", default="root=/dev/vda1 rw console=ttyS0"),
            compress=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    root, dest, name = p["root"], p["dest"], p["name"]
    if os.path.ismount(os.path.join(root, "proc")):
        module.fail_json(msg="%s/proc is mounted: power the guest off first" % root)
    version, vmlinuz, initrd = kernel_files(root)
    if not version:
        module.fail_json(msg="no /boot/vmlinuz-VERSION with its initrd.img-VERSION in %s (install a kernel in the image)" % root)
    if module.check_mode:
        module.exit_json(changed=True, kernel_version=version)
    tools = dict((t, module.get_bin_path(t, required=True)) for t in ("mkfs.ext4", "sfdisk", "qemu-img", "dd", "truncate"))
    start = time.monotonic()
    os.makedirs(dest, mode=0o755, exist_ok=True)
    sizes = du(root)
    used = sizes.get("/", 0)
    fs_mb = fs_size_mb(used, p["min_size_mb"], p["free_mb"])
    part = os.path.join(dest, ".%s.part.raw" % name)
    raw = os.path.join(dest, ".%s.disk.raw" % name)
    qcow2 = os.path.join(dest, name + ".qcow2")
    tmp_qcow2 = os.path.join(dest, ".%s.qcow2.tmp" % name)

    def run(cmd, data=None):
        rc, out, err = module.run_command(cmd, data=data, binary_data=data is not None)
        if rc != 0:
            for f in (part, raw, tmp_qcow2):
                if os.path.exists(f):
                    os.unlink(f)
            module.fail_json(msg="%s failed (rc=%d)" % (cmd[0], rc), cmd=cmd, stderr=err[-3000:], stdout=out[-2000:])
        return out

    for f in (part, raw, tmp_qcow2):
        if os.path.exists(f):
            os.unlink(f)
    run([tools["truncate"], "-s", "%dM" % fs_mb, part])
    # lazy_itable_init leaves the inode tables unwritten: they stay holes, out of the qcow2
    run([tools["mkfs.ext4"], "-q", "-F", "-L", p["label"], "-m", "1", "-E", "lazy_itable_init=1,lazy_journal_init=1",
         "-d", root, part])
    run([tools["truncate"], "-s", "%dM" % (fs_mb + 2), raw])
    run([tools["sfdisk"], "--quiet", "--no-reread", "--no-tell-kernel", raw],
        data="label: dos\nstart=%d, size=%d, type=83, bootable\n" % (PART_START, fs_mb * MIB // SECTOR))
    run([tools["dd"], "if=" + part, "of=" + raw, "bs=1M", "seek=%d" % (PART_START * SECTOR // MIB),
         "conv=notrunc,sparse", "status=none"])
    os.unlink(part)
    measured = json.loads(run([tools["qemu-img"], "measure", "--output=json", "-f", "raw", "-O", "qcow2", raw]))
    run([tools["qemu-img"], "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536"]
        + (["-c", "-o", "compression_type=zlib"] if p["compress"] else []) + [raw, tmp_qcow2])
    os.unlink(raw)
    os.replace(tmp_qcow2, qcow2)
    kernel = os.path.join(dest, name + "-vmlinuz")
    initrd_out = os.path.join(dest, name + "-initrd.img")
    shutil.copyfile(vmlinuz, kernel)
    shutil.copyfile(initrd, initrd_out)
    info = run([tools["qemu-img"], "info", "--output=json", qcow2])
    result = dict(
        changed=True, qcow2=qcow2, qcow2_bytes=os.path.getsize(qcow2), kernel=kernel, initrd=initrd_out,
        kernel_bytes=os.path.getsize(kernel), initrd_bytes=os.path.getsize(initrd_out),
        kernel_version=version, used_bytes=used, compressed=p["compress"],
        uncompressed_qcow2_bytes=measured.get("required"), fs_mb=fs_mb, virtual_bytes=json.loads(info).get("virtual-size"),
        label=p["label"], cmdline=p["cmdline"], du=breakdown(sizes), seconds=round(time.monotonic() - start, 1))
    manifest = dict((k, v) for k, v in result.items() if k != "changed")
    with open(os.path.join(dest, name + ".json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
