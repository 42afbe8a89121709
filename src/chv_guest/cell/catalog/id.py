"""ID: who a cell's processes are on the guest and what the kernel lets them do."""

from __future__ import annotations

from typing import Any, List, Optional, Set, Tuple

from .. import policy as policymod
from .case import Case, Judge, Result, pair, skip
from .facts import Facts, denied
from .loosen import Context, Loosening, unless

# drop_capabilities a loosening may keep: in systemd-nspawn's default
# bounding set (so keeping it really gives it to the cell), not in the floor
KEEPABLE_CAPS = ("CAP_SYS_NICE", "CAP_LINUX_IMMUTABLE", "CAP_AUDIT_CONTROL")


def _caps(hexmask: Any) -> Optional[Set[str]]:
    try:
        value = int(hexmask, 16)
    except (TypeError, ValueError):
        return None
    return set(name for bit, name in enumerate(policymod.CAP_NAMES) if value >> bit & 1)


def _id01(case: Case, facts: Facts) -> Result:
    a, slot_a = facts["a"], facts["slot_a"]
    umap = a["uid_map"]
    return pair(umap[:1] == ["0"] and umap[1:2] == [str(slot_a["uid_base"])] and slot_a["uid_base"] > 0,
                "uid_map %s, slot uid_base %d" % (" ".join(umap), slot_a["uid_base"]),
                a["uid"] == 0, "uid in the cell: %s" % a["uid"])


def _id02(case: Case, facts: Facts) -> Result:
    if facts.get("slot_b") is None:
        return skip("a second slot")
    b = facts.get("b")
    umap, bmap = facts["a"]["uid_map"], (b or {}).get("uid_map", [])
    ranges: List[Tuple[int, int]] = []
    for m in (umap, bmap):
        if len(m) >= 3:
            ranges.append((int(m[1]), int(m[1]) + int(m[2])))
    disjoint = len(ranges) == 2 and (ranges[0][1] <= ranges[1][0] or ranges[1][1] <= ranges[0][0])
    return pair(disjoint, "A %s, B %s" % (" ".join(umap), " ".join(bmap)), b is not None,
                "cell B ran: %s" % (b is not None))


def _cap_set(field: str) -> Judge:
    """The judge of ID-03 (CapEff) or ID-04 (CapBnd)."""
    def judge(case: Case, facts: Facts) -> Result:
        dropped = set(facts["policy"]["drop_capabilities"])
        have = _caps(facts["a"].get(field))
        kept = sorted(dropped & have) if have is not None else ["unreadable"]
        return pair(not kept, "%s %s; dropped ones present: %s"
                    % (field, facts["a"].get(field), ", ".join(kept) or "none"),
                    have is not None and "CAP_CHOWN" in have and "CAP_CHOWN" not in dropped,
                    "CAP_CHOWN in %s: %s" % (field, have is not None and "CAP_CHOWN" in have))
    return judge


def _id05(case: Case, facts: Facts) -> Result:
    nnp = facts["a"]["NoNewPrivs"]
    return pair(nnp == "1", "NoNewPrivs %s" % nnp, nnp in ("0", "1"), "field present")


def _id06(case: Case, facts: Facts) -> Result:
    k = facts["a"]["kernel"]
    return pair(k["io_uring_setup"] == "EPERM", "io_uring_setup: %s" % k["io_uring_setup"],
                k["syscall_getpid"] == "ok", "getpid: %s" % k["syscall_getpid"])


def _call(probe_key: str, control_key: str) -> Judge:
    """The judge of a case whose probe is one call the kernel must refuse
    and whose control is another it must allow (both in the kernel facts)."""
    def judge(case: Case, facts: Facts) -> Result:
        k = facts["a"]["kernel"]
        return pair(denied(k[probe_key]), "%s: %s" % (probe_key, k[probe_key]), k[control_key] == "ok",
                    "%s: %s" % (control_key, k[control_key]))
    return judge


def _command(probe_key: str, control_key: str) -> Judge:
    """As _call, for a command run in the cell (its exit code)."""
    def judge(case: Case, facts: Facts) -> Result:
        k = facts["a"]["kernel"]
        tried = k[probe_key]
        return pair(tried["rc"] not in (0, None), "%s: rc %s %s" % (probe_key, tried["rc"], tried["err"][:80]),
                    k[control_key]["rc"] == 0, "%s: rc %s" % (control_key, k[control_key]["rc"]))
    return judge


def _id12(case: Case, facts: Facts) -> Result:
    k = facts["a"]["kernel"]
    guest, init = k["nsenter_guest"], k["nsenter_init"]
    held = [guest["rc"] not in (0, None), init["rc"] not in (0, None), denied(k["setns_own"]),
            denied(k["open_guest_ns"])]
    return pair(all(held), "nsenter guest: rc %s %s; nsenter 1: rc %s %s; setns: %s; open guest ns: %s"
                % (guest["rc"], guest["err"][:80], init["rc"], init["err"][:80], k["setns_own"], k["open_guest_ns"]),
                k["nsenter_version"]["rc"] == 0 and k["open_own_ns"] == "ok",
                "nsenter --version: rc %s; own ns: %s" % (k["nsenter_version"]["rc"], k["open_own_ns"]))


def _id13(case: Case, facts: Facts) -> Result:
    k, alive = facts["a"]["kernel"], facts["guest"].get("marker_alive")
    return pair(k["marker_seen"] == [] and denied(k["kill0_guest"]),
                "marked process seen: %s; kill(pid, 0): %s" % (k["marker_seen"] or "no", k["kill0_guest"]),
                k["own_pid_listed"] and alive is True,
                "own pid listed: %s; guest sees the marked process: %s" % (k["own_pid_listed"], alive))


def _kept_cap(ctx: Context) -> List[str]:
    dropped = set(ctx["pol"]["drop_capabilities"])
    floor = policymod.REQUIRED_DROPPED_CAPS | {policymod.USERNS_GUARD_CAP}
    return [c for c in KEEPABLE_CAPS if c in dropped and c not in floor][:1]


# one loosening, both capability sets: keeping a capability puts it in either
KEEP_A_CAP = Loosening("keep a dropped capability outside the floor (%s)" % " or ".join(KEEPABLE_CAPS),
                       edit=lambda raw, ctx: raw.update(drop_capabilities=[c for c in ctx["pol"]["drop_capabilities"]
                                                                           if c not in _kept_cap(ctx)]),
                       needs=unless("the policy drops none of %s" % ", ".join(KEEPABLE_CAPS), _kept_cap),
                       name="ID-03/04")

# the section of cell A's report these cases read (Case.probes)
KERNEL = ("kernel",)

CASES = [
    Case("ID-01", (), "Cell root is the slot's own unprivileged guest uid",
         "the cell's uid_map maps 0 to the slot's uid_base, not to guest root",
         "the payload runs as uid 0 of the cell", _id01,
         "the launcher always maps the slot's uid range; no policy runs a cell as guest root"),
    Case("ID-02", (), "Slots get disjoint uid ranges", "cells A and B map to disjoint guest uid ranges",
         "both cells ran", _id02,
         "the policy check refuses partly overlapping uid ranges; identical ones (the shared-uid mode) would need "
         "slot B's workspace re-owned for the run"),
    Case("ID-03", (), "Dropped capabilities are absent from the effective set",
         "no capability of drop_capabilities in CapEff",
         "CAP_CHOWN is in CapEff", _cap_set("CapEff"), KEEP_A_CAP),
    Case("ID-04", (), "Dropped capabilities are absent from the bounding set",
         "no capability of drop_capabilities in CapBnd",
         "CAP_CHOWN is in CapBnd", _cap_set("CapBnd"), KEEP_A_CAP),
    Case("ID-05", (), "NoNewPrivs is set", "NoNewPrivs of /proc/self/status is 1", "the field is there", _id05,
         "the policy check refuses no_new_privileges: false"),
    Case("ID-06", KERNEL, "io_uring is refused (EPERM)", "io_uring_setup", "getpid through syscall()", _id06,
         "the policy check refuses a syscall_deny without the io_uring calls (the floor)"),
    Case("ID-07", KERNEL, "No new user namespace", "unshare(CLONE_NEWUSER)", "unshare(0)",
         _call("unshare_user", "unshare_none"),
         Loosening("allow_user_namespaces: true", edit=lambda raw, ctx: raw.update(allow_user_namespaces=True))),
    Case("ID-08", KERNEL, "No mount", "mount a tmpfs", "mkdir the mount point", _call("mount_tmpfs", "mkdir"),
         "the policy check refuses a drop_capabilities without CAP_SYS_ADMIN (the floor)"),
    Case("ID-09", KERNEL, "No device nodes", "mknod a character device (1,3)", "mkfifo", _call("mknod_chr", "mkfifo"),
         "two layers: CAP_MKNOD (the floor) and the kernel, which refuses device nodes in a user namespace"),
    Case("ID-10", KERNEL, "No raw sockets", "socket(AF_INET, SOCK_RAW)", "socket(AF_INET, SOCK_DGRAM)",
         _call("raw_socket", "dgram_socket"),
         "the policy check refuses a drop_capabilities without CAP_NET_RAW (the floor)"),
    Case("ID-11", KERNEL, "ptrace cannot reach a guest process",
         "PTRACE_ATTACH to the audit's guest process; kill(pid, 0)",
         "the probe signals its own child (kill(pid, 0))", _call("ptrace_guest", "kill0_own_child"),
         "the policy check refuses keeping CAP_SYS_PTRACE (the floor), and the cell has its own PID namespace"),
    Case("ID-12", KERNEL, "nsenter cannot enter the guest's namespaces",
         "nsenter -t <guest pid> and -t 1; setns() into the cell's own network namespace",
         "nsenter --version runs; /proc/self/ns/net opens", _id12,
         "the policy check refuses keeping CAP_SYS_ADMIN (the floor), and the guest's namespaces are not in "
         "the cell's /proc"),
    Case("ID-13", KERNEL, "Guest processes are invisible",
         "look for the audit's marked guest process in the cell's /proc; kill(pid, 0)",
         "the cell lists its own pid; the guest sees the marked process", _id13,
         "every cell has its own PID namespace; no policy shares the guest's"),
    Case("ID-14", KERNEL, "No address change in the cell",
         "ip addr add on the cell's interface",
         "ip addr show of the interface", _command("ip_addr_add", "ip_addr_show"),
         "the policy check refuses keeping CAP_NET_ADMIN (the floor)"),
    Case("ID-15", KERNEL, "No route change in the cell", "ip route add", "ip route show",
         _command("ip_route_add", "ip_route_show"), "as ID-14"),
]
