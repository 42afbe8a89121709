#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: chv.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: lab_image
short_description: Build or reuse a cached Debian root file system for lab guests
version_added: 0.1.0
description:
  - Builds a Debian root file system with C(mmdebstrap) from the Debian
    mirror the controller's apt uses, compressed as a zstd tarball in a
    cache directory outside the checkout.
  - The cache entry is keyed by distribution, package list and apt sources;
    a matching entry is reused without touching the network.
  - Part of the local test lab (C(chv.fleet_lab.lab_up)); runs on the lab host.
extends_documentation_fragment: [ansible.builtin.action_common_attributes, chv.fleet_lab.lab]
options:
  distro:
    description: Debian release of the image.
    type: str
    choices: [bookworm, trixie]
    required: true
  packages:
    description:
      - Packages installed on top of the lab's base set (systemd, sshd, python3, ...).
    type: list
    elements: str
    default: []
  cache_dir:
    description: Directory holding the cached tarballs.
    type: path
    required: true
  mirror:
    description:
      - Debian archive URI. Default is the one the lab host's apt sources use.
    type: str
  security_mirror:
    description:
      - Debian security archive URI. Default is the one the lab host's apt sources use.
    type: str
"""

EXAMPLES = r"""
- name: Image with the roles' packages baked in
  chv.fleet_lab.lab_image:
    distro: bookworm
    packages: [systemd-container, nftables]
    cache_dir: /root/.cache/chv-fleet/images
  register: image
"""

RETURN = r"""
path:
  description: Path of the cached image tarball.
  returned: always
  type: str
  sample: /root/.cache/chv-fleet/images/bookworm-0123456789abcdef.tar.zst
key:
  description: Cache key (hash of distro, packages and sources).
  returned: always
  type: str
packages:
  description: Full package list of the image.
  returned: always
  type: list
  elements: str
sources:
  description: Apt source lines the image was built from.
  returned: always
  type: list
  elements: str
"""

import fcntl
import glob
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.chv.fleet_lab.plugins.module_utils import lab


def _host_mirrors():
    deb822, lists = [], []
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with open(path) as f:
            deb822.append(f.read())
    for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
        if os.path.exists(path):
            with open(path) as f:
                lists.append(f.read())
    return lab.parse_apt_sources(deb822, lists)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            distro=dict(type="str", required=True, choices=sorted(lab.DISTROS)),
            packages=dict(type="list", elements="str", default=[]),
            cache_dir=dict(type="path", required=True),
            mirror=dict(type="str"),
            security_mirror=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    archive, security = _host_mirrors()
    archive = p["mirror"] or archive
    security = p["security_mirror"] or security
    if not archive:
        module.fail_json(msg="no Debian mirror found in the lab host's apt sources; set mirror")
    sources = lab.image_sources(p["distro"], archive, security)
    packages = sorted(set(lab.BASE_PACKAGES) | set(p["packages"]))
    key = lab.image_key(p["distro"], packages, sources)
    path = os.path.join(p["cache_dir"], "%s-%s.tar.zst" % (p["distro"], key))
    result = dict(changed=False, path=path, key=key, packages=packages, sources=sources)
    if os.path.exists(path):
        module.exit_json(**result)
    result["changed"] = True
    if module.check_mode:
        module.exit_json(**result)
    mmdebstrap = module.get_bin_path("mmdebstrap", required=True)
    os.makedirs(p["cache_dir"], mode=0o755, exist_ok=True)
    with open(os.path.join(p["cache_dir"], ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per cache at a time
        if os.path.exists(path):
            result["changed"] = False
            module.exit_json(**result)
        tmp = "%s.tmp-%d.tar.zst" % (path[:-len(".tar.zst")], os.getpid())
        start = time.monotonic()
        cmd = [mmdebstrap, "--mode=root", "--variant=minbase", "--format=tar",
               "--include=" + ",".join(packages), p["distro"], tmp] + sources
        rc, out, err = module.run_command(cmd)
        if rc != 0:
            if os.path.exists(tmp):
                os.unlink(tmp)
            module.fail_json(msg="mmdebstrap failed for %s (rc=%d)" % (p["distro"], rc),
                             stderr_tail=err.splitlines()[-30:], cmd=cmd)
        os.replace(tmp, path)
    result["build_seconds"] = round(time.monotonic() - start, 1)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
