"""The socket family filter (chv_guest/cell/families.py): the rule plan, the
policy key, and the filter libseccomp builds from it, loaded in a forked
child that then tries sockets (no cell needed: a seccomp filter holds for
the process that loads it)."""

import errno
import os
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chv_guest.cell import errors
from chv_guest.cell import families
from chv_guest.cell import policy as policymod
from chv_guest.cell import runner

DEFAULT = families.numbers(list(families.DEFAULT_FAMILIES))


def test_plan_of_the_default_families_denies_exactly_the_others():
    rules = families.plan(DEFAULT)
    assert DEFAULT == [1, 2, 10, 16]
    assert rules[0] == ("lt", 1) and rules[-1] == ("gt", 16)
    assert sorted(v for op, v in rules if op == "eq") == [3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15]
    for n in range(0, 64):
        assert families.denies(rules, n) == (n not in DEFAULT), n


@given(st.sets(st.integers(0, 60), min_size=1), st.integers(0, 2**64 - 1))
def test_plan_denies_every_value_outside_the_allowed_set(allowed, value):
    """Property: a 64-bit argument is denied iff it is not an allowed family
    (high bits set: denied, although the kernel would truncate them)."""
    rules = families.plan(allowed)
    assert families.denies(rules, value) == (value not in allowed)
    assert all(op in ("lt", "gt", "eq") for op, dummy in rules)


def test_plan_needs_a_family():
    with pytest.raises(ValueError):
        families.plan([])


@pytest.mark.parametrize("value, expected", [
    (list(families.DEFAULT_FAMILIES), None),
    ("any", None),
    (["AF_UNIX", "AF_NETLINK"], None),
    (["AF_UNIX", "AF_INET"], "must include AF_NETLINK"),
    (["AF_INET", "AF_NETLINK"], "must include AF_UNIX"),
    (["AF_UNIX", "AF_NETLINK", "AF_VSOK"], "unknown address family 'AF_VSOK'"),
    (["AF_UNIX", "AF_NETLINK", "AF_UNSPEC"], "AF_UNSPEC"),
    ([], "non-empty list"),
    ("all", "non-empty list"),
    (None, "non-empty list"),
    ([1, 16], "non-empty list"),
])
def test_policy_key(raw_policy, value, expected):
    raw_policy["socket_families"] = value
    errors = policymod.validate(raw_policy)
    if expected is None:
        assert errors == []
    else:
        assert any(expected in e and e.startswith("socket_families:") for e in errors), errors


def test_the_default_policy_filters():
    assert policymod.DEFAULTS["socket_families"] == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    assert families.numbers("any") is None


def _seccomp_or_skip():
    try:
        return families.load_seccomp()
    except families.FilterUnavailable as exc:
        pytest.skip(str(exc))


def _in_filtered_child(allowed, tries):
    """Load the filter for ``allowed`` in a forked child, try socket(fam,
    type) for each of ``tries``, return {fam: "ok" or errno name}."""
    flt = families.build(allowed, _seccomp_or_skip())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        try:
            os.close(r)
            flt.load()
            out = []
            for fam, typ in tries:
                try:
                    socket.socket(fam, typ).close()
                    out.append("ok")
                except OSError as exc:
                    out.append(errno.errorcode[exc.errno])
            os.write(w, " ".join(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return dict(zip([t[0] for t in tries], data.split()))


def test_the_built_filter_denies_with_eafnosupport_and_allows_the_rest():
    got = _in_filtered_child(DEFAULT, [(1, socket.SOCK_STREAM), (2, socket.SOCK_DGRAM), (16, socket.SOCK_RAW),
                                       (40, socket.SOCK_STREAM), (17, socket.SOCK_DGRAM), (0, socket.SOCK_STREAM)])
    assert got == {1: "ok", 2: "ok", 16: "ok", 40: "EAFNOSUPPORT", 17: "EAFNOSUPPORT", 0: "EAFNOSUPPORT"}
    # a narrower list: AF_INET is then denied too (the same builder, another plan)
    got = _in_filtered_child([1, 16], [(1, socket.SOCK_STREAM), (2, socket.SOCK_STREAM)])
    assert got == {1: "ok", 2: "EAFNOSUPPORT"}


def test_the_built_filter_kills_on_a_foreign_abi_and_keeps_no_new_privs_off():
    sc = _seccomp_or_skip()
    flt = families.build(DEFAULT, sc)
    assert flt.get_attr(sc.Attr.ACT_BADARCH) & 0xFFFFFFFF == sc.KILL_PROCESS & 0xFFFFFFFF
    assert flt.get_attr(sc.Attr.CTL_NNP) == 0
    # the native ABI only: the others meet the bad-architecture action
    native = sc.system_arch() & 0xFFFFFFFF  # the binding mixes signed and unsigned tokens
    others = [a for a in (sc.Arch.X86, sc.Arch.X32, sc.Arch.X86_64) if a & 0xFFFFFFFF != native]
    assert len(others) == 2 and not any(flt.exist_arch(a) for a in others)


def test_the_binding_is_found_outside_sys_path_and_missing_is_named(monkeypatch):
    _seccomp_or_skip()
    monkeypatch.delitem(sys.modules, "seccomp", raising=False)
    mod = families.load_seccomp()
    assert hasattr(mod, "SyscallFilter")
    monkeypatch.delitem(sys.modules, "seccomp", raising=False)
    monkeypatch.setattr(families, "SECCOMP_DIRS", ("/nonexistent",))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not os.path.exists(os.path.join(p, "seccomp.py"))
                                      and "dist-packages" not in p])
    with pytest.raises(families.FilterUnavailable, match="python3-seccomp"):
        families.load_seccomp()


def test_spawn_refuses_without_the_binding_unless_the_policy_says_any(policy, monkeypatch):
    monkeypatch.delitem(sys.modules, "seccomp", raising=False)
    monkeypatch.setattr(families, "SECCOMP_DIRS", ("/nonexistent",))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "dist-packages" not in p])
    with pytest.raises(errors.SetupError, match=r"python3-seccomp.*refusing to start the cell.*socket_families"):
        runner.Launcher(policy).spawn(["/bin/true"], [])
    proc = runner.Launcher(dict(policy, socket_families="any")).spawn(["/bin/true"], [])
    assert proc.wait(10) == 0
