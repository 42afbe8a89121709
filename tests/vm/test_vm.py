"""The baked CHV guest image on a real VM kernel (qemu TCG, the devices of a
CHV guest; conftest.py): two guests from one image are distinct machines, a
generalized guest refuses cells until its first site.yml run allocates its
own slot identities (per-host overrides applied, nothing downloaded: the
VMs reach nothing outside), and then, in the VM, cells run with their
network, the broker answers a cell and rejects the guest, a cell cannot read
/etc/chv or reach the guest's services, and the isolation catalog
(`chv-cell audit`) passes. Each negative check runs beside its positive
control; a cell that did not start (exit 125) is never a pass.

Figures (boot to SSH, converge, cell start) go to build/reports/vm-<distro>/vm-test.json:
they are TCG figures, not CHV/KVM ones."""

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest

from testpaths import ROOT

REPORTS = os.environ.get("CHV_VM_REPORT_DIR", os.path.join(ROOT, "build", "reports", "vm"))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="qemu guests and their checks run as root here")

BIN = os.path.dirname(sys.executable)
LEDGER = "/var/lib/chv-fleet/identities.json"
POLICY = "/etc/chv-fleet/cell-policy.json"
CLIENT = "/usr/lib/chv-fleet/chv_guest/broker/client.py"
PLAYWRIGHT = "1.65.2"  # lab/roles/lab/defaults/main.yml lab_playwright_version: the wheels the lab downloaded
EXIT_SETUP = 125  # chv-cell: the cell did not start


# What the cells need of the guest kernel (docs/chv.md), as built in (y) or modules (m).
KERNEL_FEATURES = [
    "CONFIG_NAMESPACES", "CONFIG_USER_NS", "CONFIG_PID_NS", "CONFIG_NET_NS", "CONFIG_UTS_NS", "CONFIG_IPC_NS",
    "CONFIG_CGROUPS", "CONFIG_MEMCG", "CONFIG_CGROUP_PIDS", "CONFIG_CGROUP_SCHED", "CONFIG_CFS_BANDWIDTH",
    "CONFIG_SECCOMP", "CONFIG_SECCOMP_FILTER", "CONFIG_VETH", "CONFIG_NF_TABLES", "CONFIG_NF_TABLES_INET",
    "CONFIG_NFT_NAT", "CONFIG_NFT_MASQ", "CONFIG_NFT_CT", "CONFIG_NF_CONNTRACK",
    "CONFIG_OVERLAY_FS", "CONFIG_TMPFS", "CONFIG_VIRTIO_BLK", "CONFIG_VIRTIO_NET", "CONFIG_VIRTIO_PCI",
    "CONFIG_HW_RANDOM_VIRTIO", "CONFIG_SERIAL_8250_CONSOLE", "CONFIG_VFAT_FS", "CONFIG_ISO9660_FS",
]


def by_name(vms, name):
    return next(g for g in vms if g.name == name)


def ledger_slots(vm):
    out = vm.ssh("cat %s" % LEDGER).stdout
    data = json.loads(out)
    slots = data.get("slots", data.get("identities", data))
    return data, (sorted(slots) if isinstance(slots, dict) else sorted(s.get("slot", s.get("name")) for s in slots))


def test_systemd_is_pid1_on_the_image_kernel(vms, manifest, report):
    for g in vms:
        assert g.ssh("cat /proc/1/comm").stdout.strip() == "systemd"
        assert g.ssh("uname -r").stdout.strip() == manifest["kernel_version"]
        assert g.ssh("findmnt -n -o SOURCE /").stdout.strip() == "/dev/vda1"
        state = g.ssh("systemctl is-system-running --wait", check=False, timeout=600).stdout.strip()
        failed = g.ssh("systemctl --failed --no-legend --plain", check=False).stdout.strip()
        report.setdefault("system_state", {})[g.name] = {"state": state, "failed_units": failed}
        assert state == "running", "%s: %s; failed units: %s" % (g.name, state, failed)
        # cloud-init took the hostname from the seed
        assert g.ssh("hostname").stdout.strip() == g.name
        # cgroup2 with the controllers the cells' limits need (unlike the nspawn lab)
        controllers = g.ssh("cat /sys/fs/cgroup/cgroup.controllers").stdout.split()
        assert {"memory", "pids", "cpu"} <= set(controllers), controllers
    config = dict(re.findall(r"^(CONFIG_\w+)=(\S+)$", vms[0].ssh("cat /boot/config-$(uname -r)").stdout, re.M))
    missing = [f for f in KERNEL_FEATURES if config.get(f) not in ("y", "m")]
    report["kernel_features"] = dict((f, config.get(f)) for f in KERNEL_FEATURES)
    assert not missing, missing
    # vm2 took the static address of its seed's network-config, vm1 the image's DHCP fallback
    for g in vms:
        addrs = g.ssh("ip -4 -o addr show scope global").stdout
        files = g.ssh("ls /etc/systemd/network /run/systemd/network 2>/dev/null || true").stdout.split()
        report.setdefault("network", {})[g.name] = {"addresses": addrs.strip(), "networkd_files": files}
        assert "%s/24" % g.address in addrs, (g.name, addrs)


def test_two_guests_are_distinct_machines(vms, report):
    ids = dict((g.name, g.ssh("cat /etc/machine-id").stdout.strip()) for g in vms)
    keys = dict((g.name, g.host_key()) for g in vms)
    report["machine_ids"], report["host_keys"] = ids, keys
    for g in vms:
        assert re.match(r"^[0-9a-f]{32}$", ids[g.name]), ids
        assert keys[g.name], "no ed25519 host key from %s" % g.name
    assert ids["vm1"] != ids["vm2"]
    assert keys["vm1"] != keys["vm2"]


def test_generalized_guest_refuses_cells_until_converged(vms):
    for g in vms:
        # the image carries no slot identities and no policy of the bake guest...
        assert g.ssh("test -e %s || test -e %s" % (LEDGER, POLICY), check=False).returncode == 1
        # ...so the launcher refuses to start a cell (fail closed): the payload never runs
        proc = g.ssh("chv-cell run -- sh -c 'echo payload-ran'", check=False)
        assert proc.returncode != 0 and "payload-ran" not in proc.stdout, proc
        # the control: the image's launcher and services are there
        assert g.ssh("test -x /usr/lib/chv-fleet/chv-cell && systemctl is-enabled chv-broker.socket").returncode == 0


# Stand-ins for destinations outside the VM, which qemu's user network
# (restrict=on) forwards to this machine (guestfwd, conftest.py): one the
# cells may reach, one the egress policy denies (cell_nat_egress_deny below).
ALLOWED, DENIED = "10.0.2.100:80", "10.0.2.101:80"


def run_site(vms, log_name):
    """site.yml on both guests in one batch: (process, seconds, recap by guest)."""
    workdir = os.path.dirname(vms[0].dir)
    inventory = os.path.join(workdir, "inventory.json")
    if not os.path.exists(inventory):
        pyver = vms[0].ssh("python3 -c 'import sys; print(\"%d%d\" % sys.version_info[:2])'").stdout.strip()
        arch = vms[0].ssh("uname -m").stdout.strip()
        wheels = os.path.expanduser("~/.cache/chv-fleet/wheels/playwright-%s-cp%s-%s" % (PLAYWRIGHT, pyver, arch))
        hosts = {
            "vm1": {"ansible_host": "127.0.0.1", "ansible_port": by_name(vms, "vm1").port, "chv_cell_slots": 3},
            "vm2": {"ansible_host": "127.0.0.1", "ansible_port": by_name(vms, "vm2").port},
        }
        group_vars = {
            "ansible_user": "root", "ansible_ssh_private_key_file": vms[0].key,
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
            "ansible_python_interpreter": "/usr/bin/python3", "ansible_pipelining": True,
            "chv_browser_playwright_version": PLAYWRIGHT,
            # the preflight refuses more slots x MemoryMax than the guest's memory (2 GiB here)
            "chv_cell_properties": {"MemoryMax": "512M"},
            # TCG: chromium's first launch in the VM takes longer than the defaults' 60 s
            "chv_broker_browser_timeout": 300, "chv_browser_request_timeout": 300,
            # the denied stand-in (NET-05 of the audit)
            "cell_nat_egress_deny": [{"cidr": DENIED.split(":")[0] + "/32", "comment": "the VM test's denied stand-in"}],
            # the allowed stand-in is in qemu's 10.0.2.0/24, denied by default: a carve-out (its
            # resolver 10.0.2.3, from DHCP, is read by the role and accepted on port 53 only)
            "cell_nat_egress_allow": [{"cidr": ALLOWED.split(":")[0] + "/32", "comment": "the VM test's allowed stand-in"}],
        }
        if os.path.isdir(wheels):
            group_vars["chv_browser_wheel_dir"] = wheels
        with open(inventory, "w") as f:
            json.dump({"chv_fleet": {"hosts": hosts, "vars": group_vars}}, f)
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_COLLECTIONS_PATH=os.path.join(ROOT, "build", "dev-collections"),
               ANSIBLE_ROLES_PATH=os.path.join(ROOT, "roles"), ANSIBLE_TIMEOUT="60")
    start = time.monotonic()
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", inventory, os.path.join(ROOT, "site.yml"),
                           "-e", '{"chv_fleet_batches": [2]}'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    seconds = time.monotonic() - start
    os.makedirs(REPORTS, exist_ok=True)
    with open(os.path.join(REPORTS, log_name), "w") as f:
        f.write(proc.stdout + proc.stderr)
    recap = dict(re.findall(r"^(vm\d)\s+:\s+(.*)$", proc.stdout.split("PLAY RECAP")[-1], re.M))
    return proc, seconds, recap


@pytest.fixture(scope="session")
def converged(vms, report):
    """site.yml on both guests in one batch, vm1 with a host_vars override
    (chv_cell_slots: 3), the other with the defaults (2 slots), both with
    MemoryMax 512M per cell (3 x 512M fit the 2 GiB guest) and the denied
    stand-in in the egress policy; the VMs reach nothing outside, so
    nothing can be downloaded."""
    proc, seconds, recap = run_site(vms, "converge.log")
    report["converge"] = {"seconds": round(seconds, 1), "rc": proc.returncode, "recap": recap}
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-3000:])
    return recap


def test_first_converge_allocates_per_guest_ledgers_offline(vms, converged, report):
    _, slots1 = ledger_slots(by_name(vms, "vm1"))
    _, slots2 = ledger_slots(by_name(vms, "vm2"))
    report["ledgers"] = {"vm1": slots1, "vm2": slots2}
    # each guest allocated its own identities, with its own host_vars
    assert len(slots1) == 3 and len(slots2) == 2, (slots1, slots2)
    for name in ("vm1", "vm2"):
        assert "failed=0" in converged[name] and "unreachable=0" in converged[name], converged
    # nothing was fetched: apt's package lists are still empty (the image carries none)
    for g in vms:
        assert g.ssh("ls /var/lib/apt/lists | grep -c _ || true").stdout.strip() == "0"


def test_second_converge_changes_nothing(vms, converged, report):
    proc, seconds, recap = run_site(vms, "converge-again.log")
    report["converge_again"] = {"seconds": round(seconds, 1), "rc": proc.returncode, "recap": recap}
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-3000:])
    assert sorted(recap) == ["vm1", "vm2"], recap
    for name, line in recap.items():
        counts = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line))
        # the control: the run did reach the guest and ran the roles' tasks
        assert counts["ok"] > 50 and counts["failed"] == 0 and counts["unreachable"] == 0, (name, line)
        assert counts["changed"] == 0, (name, line, [t for t in proc.stdout.splitlines() if t.startswith("changed:")])


def cell(vm, script, check=True, timeout=300):
    proc = vm.ssh("chv-cell run -- sh -c %s" % shquote(script), check=False, timeout=timeout)
    assert proc.returncode != EXIT_SETUP, "the cell did not start: %s" % proc.stderr[-2000:]
    if check:
        assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def shquote(s):
    return "'" + s.replace("'", "'\\''") + "'"


def test_cell_runs_with_its_network_in_the_vm(vms, converged, report):
    vm = by_name(vms, "vm1")
    out = cell(vm, "cat /proc/1/comm; ip -4 -o addr show dev eth0; ip route show default").stdout
    assert re.search(r"inet 10\.200\.\d+\.\d+/24", out), out
    assert "default via 10.200." in out, out
    # cell start to exit, measured inside the VM (TCG)
    times = []
    for _ in range(5):
        t = vm.ssh("s=$(date +%s%N); chv-cell run -- true; rc=$?; e=$(date +%s%N); echo $rc $(( (e - s) / 1000000 ))").stdout.split()
        assert t[0] == "0", t
        times.append(int(t[1]))
    report["cell_run_true_ms"] = {"runs": times, "median": statistics.median(times)}


def test_broker_answers_the_cell_and_rejects_the_guest(vms, converged, report):
    vm = by_name(vms, "vm1")
    in_cell = cell(vm, "python3 %s '{\"op\": \"ping\"}'" % CLIENT)
    reply = json.loads(in_cell.stdout.strip().splitlines()[-1])
    assert reply.get("ok") is True and reply.get("result", {}).get("pong") is True, reply
    # the same client and request from the guest (root, outside every cell): refused
    guest = vm.ssh("python3 %s '{\"op\": \"ping\"}'" % CLIENT, check=False)
    report["broker"] = {"cell": reply, "guest": guest.stdout.strip(), "guest_exit": guest.returncode}
    assert guest.returncode == 1, guest
    assert json.loads(guest.stdout.strip()).get("ok") is False


def test_cell_cannot_read_etc_chv(vms, converged):
    vm = by_name(vms, "vm1")
    # loosen the guest's own permissions for the test, so that only the cell's boundary is left
    vm.ssh("install -d -m 0700 /etc/chv && stat -c %a /etc/chv > /root/.chv-mode && chmod 0755 /etc/chv && "
           "echo vm-secret > /etc/chv/vm-test && chmod 0644 /etc/chv/vm-test")
    try:
        # control: a plain user on the guest reads it now
        assert vm.ssh("runuser -u nobody -- cat /etc/chv/vm-test").stdout.strip() == "vm-secret"
        out = cell(vm, "cat /etc/os-release >/dev/null && echo control-ok; "
                       "cat /etc/chv/vm-test 2>&1 && echo probe-read || echo probe-denied").stdout
        assert "control-ok" in out and "probe-denied" in out and "vm-secret" not in out, out
    finally:
        vm.ssh("rm -f /etc/chv/vm-test; chmod $(cat /root/.chv-mode) /etc/chv; rm -f /root/.chv-mode", check=False)


PROBE = r"""
import socket, sys
def probe(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print("control", probe("127.0.0.1", srv.getsockname()[1]))
for target in sys.argv[1:]:
    h, p = target.rsplit(":", 1)
    print(target, probe(h, int(p)))
"""


def test_cell_cannot_reach_the_guests_services(vms, converged, report):
    vm = by_name(vms, "vm1")
    guest_ip = vm.ssh("ip -4 -o route get 1.1.1.1 | sed -n 's/.* src \\([0-9.]*\\).*/\\1/p'").stdout.strip()
    assert guest_ip, "no guest address"
    # control from the guest: its sshd answers on that address
    assert vm.ssh("python3 -c 'import socket; socket.create_connection((\"%s\", 22), 3); print(1)'" % guest_ip).stdout.strip() == "1"
    gw = cell(vm, "ip route show default").stdout.split()[2]
    targets = ["%s:22" % guest_ip, "%s:22" % gw]
    out = cell(vm, "python3 -c %s %s" % (shquote(PROBE), " ".join(targets)), timeout=120).stdout
    lines = dict(line.rsplit(" ", 1) for line in out.strip().splitlines())
    report["guest_services"] = lines
    assert lines.get("control") == "connected", out
    for t in targets:
        # the ruleset drops: no answer at all (a refusal would mean the packet got through)
        assert lines.get(t) == "TimeoutError", out


def test_browser_opens_the_allowed_page_for_a_cell(vms, converged, report):
    """The door's positive case, and chromium's first (slow, under TCG)
    launch before the audit's BRW cases, whose requests wait 90 s at most."""
    vm = by_name(vms, "vm1")
    request = json.dumps({"op": "browser", "action": "open", "url": "http://%s/" % ALLOWED})
    start = time.monotonic()
    out = cell(vm, "CHV_BROKER_TIMEOUT=400 python3 %s %s" % (CLIENT, shquote(request)), timeout=600).stdout
    report["browser_first_open_s"] = round(time.monotonic() - start, 1)
    reply = json.loads(out.strip().splitlines()[-1])
    assert reply.get("ok") is True, reply
    # the page's heading reached the cell's snapshot (served outside the VM, through the door)
    assert "chv-audit" in json.dumps(reply["result"]), reply


def test_isolation_catalog_passes_in_the_vm(vms, converged, report):
    vm = by_name(vms, "vm1")
    start = time.monotonic()
    # the stand-ins outside the VM: --allow (NET-01), --deny (NET-05) and the page chv-browser opens (BRW)
    proc = vm.ssh("chv-cell audit --json --runs 10 --metadata-stand-in --trusted /etc/chv-fleet/nft/cell-nat.nft "
                  "--allow %s --deny %s --allow-url http://%s/ "
                  "--report-dir /var/lib/chv-fleet/audit --label image=%s"
                  % (ALLOWED, DENIED, ALLOWED, os.path.basename(os.environ.get("CHV_IMAGE", ""))),
                  check=False, timeout=1800)
    seconds = time.monotonic() - start
    rep = json.loads(proc.stdout)
    cases = dict((c["id"], c["verdict"]) for c in rep["cases"])
    report["audit"] = {"exit": proc.returncode, "verdict": rep["verdict"], "counts": rep["counts"],
                       "seconds": round(seconds, 1), "skipped": sorted(k for k, v in cases.items() if v == "skip"),
                       "not_passed": sorted(k for k, v in cases.items() if v not in ("pass", "skip"))}
    os.makedirs(REPORTS, exist_ok=True)
    with open(os.path.join(REPORTS, "audit-vm1.json"), "w") as f:
        f.write(proc.stdout)
    assert proc.returncode == 0 and rep["verdict"] == "passed", report["audit"]
    # every case ran in the VM, each beside its control: none skipped
    assert rep["counts"]["error"] == 0 and report["audit"]["skipped"] == [], report["audit"]
    assert rep["counts"]["pass"] == len(rep["cases"]) >= 40, report["audit"]
    for c in rep["cases"]:
        assert c["probe"] and c["control"], c
