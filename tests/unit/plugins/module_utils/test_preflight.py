"""chv.fleet.preflight's checks on fake host trees: each passes on a host
that has what cells need and fails, named, when that one thing is taken away."""

import os

import pytest

from ansible_collections.chv.fleet.plugins.module_utils import preflight as pf
from fake_tree import write

RELEASE = "6.1.0-test-amd64"


@pytest.fixture
def host(tmp_path):
    write(tmp_path, "/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    write(tmp_path, "/proc/sys/user/max_user_namespaces", "63424\n")
    write(tmp_path, "/sys/module/veth/refcnt", "0\n")
    write(tmp_path, "/lib/modules/%s/modules.dep" % RELEASE,
          "kernel/net/netfilter/nf_tables.ko.xz: kernel/lib/libcrc32c.ko.xz\n")
    os.chmod(write(tmp_path, "/usr/sbin/ip"), 0o755)
    write(tmp_path, "/proc/meminfo", "MemTotal:       16384000 kB\nMemFree:         1000 kB\n")
    return tmp_path


def names_failed(root, slots=2, memory_max="4G"):
    return [(n, d) for n, ok, d in pf.run_checks(str(root), RELEASE, slots, memory_max) if not ok]


def test_a_host_with_everything_passes_every_check(host):
    checks = pf.run_checks(str(host), RELEASE, 2, "4G")
    assert [n for n, ok, d in checks] == ["cgroup2", "user namespaces", "kernel modules", "iproute2", "memory"]
    assert all(ok for n, ok, d in checks), checks


@pytest.mark.parametrize("remove,name,needle", [
    ("/sys/fs/cgroup/cgroup.controllers", "cgroup2", "not cgroup2"),
    ("/proc/sys/user/max_user_namespaces", "user namespaces", "no user namespaces"),
    ("/sys/module/veth/refcnt", "kernel modules", "has no veth (loaded"),
    ("/usr/sbin/ip", "iproute2", "no ip command"),
])
def test_each_missing_feature_fails_its_own_check(host, remove, name, needle):
    os.unlink(os.path.join(str(host), remove.lstrip("/")))
    if remove.startswith("/sys/module/veth"):
        os.rmdir(os.path.join(str(host), "sys/module/veth"))
    failed = names_failed(host)
    assert [n for n, d in failed] == [name] and needle in failed[0][1], failed


def test_a_module_list_without_nf_tables_fails(host):
    write(host, "/lib/modules/%s/modules.dep" % RELEASE, "kernel/net/netfilter/nf_conntrack.ko.xz:\n")
    assert names_failed(host) == [("kernel modules", "kernel %s has no nf_tables (loaded, built in, as a module "
                                                     "or in its config)" % RELEASE)]


def test_zero_user_namespaces_fail(host):
    write(host, "/proc/sys/user/max_user_namespaces", "0\n")
    assert names_failed(host) == [("user namespaces", "user.max_user_namespaces is 0: cells run in a user "
                                                      "namespace of their own")]


def test_a_built_in_module_counts(host):
    os.unlink(os.path.join(str(host), "lib/modules/%s/modules.dep" % RELEASE))
    write(host, "/lib/modules/%s/modules.builtin" % RELEASE, "kernel/net/netfilter/nf_tables.ko\n")
    assert names_failed(host) == []
    # a name that only contains the module's is not it
    write(host, "/lib/modules/%s/modules.builtin" % RELEASE, "kernel/net/netfilter/nf_tables_set.ko\n")
    assert [n for n, d in names_failed(host)] == ["kernel modules"]


def test_a_kernel_config_counts_and_no_source_at_all_is_not_a_failure(host):
    os.unlink(os.path.join(str(host), "lib/modules/%s/modules.dep" % RELEASE))
    write(host, "/boot/config-%s" % RELEASE, "CONFIG_NF_TABLES=m\n# CONFIG_VETH is not set\n")
    assert names_failed(host) == []  # veth from /sys/module
    os.unlink(os.path.join(str(host), "sys/module/veth/refcnt"))
    os.rmdir(os.path.join(str(host), "sys/module/veth"))
    assert [d for n, d in names_failed(host)] == ["kernel %s has no veth (loaded, built in, as a module or in its "
                                                  "config)" % RELEASE]
    # a live probe that made a veth pair is proof enough
    assert [n for n, ok, d in pf.run_checks(str(host), RELEASE, 2, "4G", proven=["veth"]) if not ok] == []
    # no module list and no config: nothing to go by, so not a failure (the health gate proves it later)
    os.unlink(os.path.join(str(host), "boot/config-%s" % RELEASE))
    checks = dict((n, (ok, d)) for n, ok, d in pf.run_checks(str(host), RELEASE, 2, "4G"))
    assert checks["kernel modules"][0] and "veth, nf_tables not verifiable here" in checks["kernel modules"][1]


def test_memory_is_slots_times_memory_max(host):
    # 16384000 kB is 16000 MiB: 3 x 4G fits, 4 x 4G (16384 MiB) does not
    assert names_failed(host, 3, "4G") == []
    assert names_failed(host, 4, "4G") == [("memory", "4 slots x MemoryMax 4G = 16384 MiB, more than this host's "
                                                      "16000 MiB of memory")]
    assert names_failed(host, 1000, "infinity") == [] and names_failed(host, 1000, "50%") == []


@pytest.mark.parametrize("text,size", [("4G", 4 * 2 ** 30), ("512M", 2 ** 29), ("1024", 1024), ("2T", 2 * 2 ** 40),
                                       ("infinity", None), ("80%", None)])
def test_sizes(text, size):
    assert pf.parse_size(text) == size


@pytest.mark.parametrize("text", ["4GB", "-1", "lots", "4.5G", ""])
def test_bad_sizes_are_named(text):
    with pytest.raises(ValueError, match="MemoryMax %r is not a size" % text):
        pf.parse_size(text)
