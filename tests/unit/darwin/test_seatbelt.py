"""The Seatbelt profiles of macOS cells, rendered from the cell_runtime
role's template (templates/cell.sb.j2, the chv.fleet.seatbelt_profile
filter, the launcher's chv_cell.seatbelt) for several policy variants, read
as s-expressions and checked: (version 1) then (deny default); each
inaccessible path denied explicitly, in its written and its resolved form,
after every allow; writes only to the slot's own directories and the
writable bind sources; no inbound, no localhost. Each check is also shown to
reject a profile broken in the way it guards against."""

import pytest

from darwin_render import Regex, Str, darwin_policy, parse_sexprs, render
from chv_guest.cell import darwin as darwinmod
from chv_guest.cell import seatbelt

# macOS's first-level links as the test knows them (the profile must use the
# resolved form: Seatbelt matches the real path), and /run (synthetic.conf).
LINKS = {"/etc": "/private/etc", "/tmp": "/private/tmp", "/var": "/private/var", "/run": "/private/var/run"}


def real(path):
    for link, target in LINKS.items():
        if path == link or path.startswith(link + "/"):
            return target + path[len(link):]
    return path


VARIANTS = {
    "defaults": {},
    "one slot, more hidden": {"slots": 1, "inaccessible_extra": ["/var/db/secrets", "/Users/chv/.ssh"]},
    "five slots, other roots": {"slots": 5, "workspace_root": "/opt/cells/ws", "agent_state_root": "/opt/cells/state",
                                "agent_home": "/Users/agent"},
    "quoted path, extra bind": {"inaccessible_extra": ['/opt/odd "name"/x'],
                                "readonly_extra": [{"source": "/opt/tools", "target": "/opt/tools", "optional": True}]},
}


def rendered(policy, slot):
    return render("cell_runtime", "cell.sb.j2", __cell_runtime_policy=policy, __cell_runtime_seatbelt_slot=slot)


def forms(text):
    return parse_sexprs(text)


def paths_of(form, kind="subpath"):
    return [arg[1] for arg in form[1:] if isinstance(arg, list) and arg and arg[0] == kind]


def check_profile(text, policy, slot):
    """Every property the issue asks of a profile; AssertionError naming the first that fails."""
    top = forms(text)
    assert top[:2] == [["version", "1"], ["deny", "default"]], top[:2]
    assert not any(f[:2] == ["allow", "default"] for f in top)
    ops = [(i, f) for i, f in enumerate(top)]
    denies = {}
    for i, f in ops:
        if f[:3] == ["deny", "file-read*", "file-write*"]:
            for p in paths_of(f):
                denies[p] = i
    last_allow = max(i for i, f in ops if f[0] == "allow" and any(str(a).startswith("file-") for a in f[1:2]))
    for path in policy["inaccessible"]:
        for form in {path, real(path)}:
            assert form in denies, "inaccessible %s (%s) is not denied" % (path, form)
            assert denies[form] > last_allow, "the deny of %s comes before an allow (the last match wins)" % form
    # writes: exactly the slot's own directories and the writable bind sources
    own = ["%s/%s" % (policy["workspace_root"], slot["name"]), "%s/%s" % (policy["agent_state_root"], slot["name"]),
           "/private/var/tmp/chv-fleet/%s" % slot["name"]]
    allowed = set()
    for p in own + [b["source"] for b in policy["writable_binds"]]:
        allowed |= {p, real(p)}
    written = set()
    for _i, f in ops:
        if f[0] == "allow" and "file-write*" in f[1:2]:
            written |= set(paths_of(f))
            assert not paths_of(f, "literal") and all(isinstance(a, list) for a in f[2:])
            regexes = [a[1] for a in f[2:] if a[0] == "regex"]
            assert all(isinstance(r, Regex) and r.startswith("^/dev/tty") for r in regexes), regexes
    assert written == allowed, (sorted(written), sorted(allowed))
    # every path literal is a plain string, never a symbol
    assert all(isinstance(p, Str) for _i, f in ops for p in paths_of(f))
    # network: no inbound, localhost denied after the IP allow, Unix sockets only under the writable binds
    assert ["deny", "network-inbound"] in top
    ip_allow = [i for i, f in ops if f[0] == "allow" and f[1] == "network-outbound"
                and any(a[0] == "remote" for a in f[2:])]
    local_deny = [i for i, f in ops if f == ["deny", "network-outbound", ["remote", "ip", Str("localhost:*")]]]
    assert ip_allow and local_deny and min(local_deny) > max(ip_allow)
    sockets = set()
    for _i, f in ops:
        if f[0] == "allow" and f[1] == "network-outbound":
            sockets |= set(paths_of(f)) | set(paths_of(f, "literal"))
    assert sockets == {real(b["source"]) for b in policy["writable_binds"]} | {"/private/var/run/mDNSResponder"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_slot_profile_of_every_variant_is_well_formed(variant):
    policy = darwin_policy(**VARIANTS[variant])
    for slot in policy["slots"]:
        text = rendered(policy, slot)
        check_profile(text, policy, slot)
        # the template is the launcher's generator: a run accepts exactly this file
        assert text == seatbelt.profile(policy, slot)


def test_profiles_of_two_slots_write_only_their_own_directories():
    policy = darwin_policy(slots=2)
    a, b = (rendered(policy, s) for s in policy["slots"])
    assert "/slot0" in a and "/slot1" not in a
    assert "/slot1" in b and "/slot0" not in b


def _drop_line(text, needle):
    lines = text.split("\n")
    hit = [i for i, line in enumerate(lines) if needle in line]
    assert hit, needle
    del lines[hit[0]]
    return "\n".join(lines)


BREAKAGES = {
    "a deny rule dropped": lambda t: _drop_line(t, '(deny file-read* file-write* (subpath "/private/etc/chv"))'),
    "deny default dropped": lambda t: _drop_line(t, "(deny default)"),
    "allow default added": lambda t: t.replace("(deny default)", "(deny default)\n(allow default)"),
    "a deny moved before the allows": lambda t: _drop_line(
        t, '(deny file-read* file-write* (subpath "/etc/chv"))').replace(
        "(deny default)", '(deny default)\n(deny file-read* file-write* (subpath "/etc/chv"))'),
    "a write outside the slot": lambda t: t.replace("(allow file-write* ", '(allow file-write* (subpath "/Users") ', 1),
    "localhost allowed": lambda t: _drop_line(t, '(deny network-outbound (remote ip "localhost:*"))'),
    "inbound allowed": lambda t: _drop_line(t, "(deny network-inbound)"),
    "unbalanced": lambda t: t + "(allow file-read*",
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_checks_reject_a_broken_profile(breakage):
    policy = darwin_policy()
    slot = policy["slots"][0]
    good = rendered(policy, slot)
    check_profile(good, policy, slot)  # control
    broken = BREAKAGES[breakage](good)
    assert broken != good
    with pytest.raises((AssertionError, ValueError)):
        check_profile(broken, policy, slot)


def test_the_reader_reads_strings_regexes_and_comments():
    got = parse_sexprs(';; c\n(allow file-read* (subpath "/a \\"b\\"") (regex #"^/dev/x$")) ; tail\n(x)')
    assert got == [["allow", "file-read*", ["subpath", '/a "b"'], ["regex", "^/dev/x$"]], ["x"]]
    assert isinstance(got[0][2][1], Str) and isinstance(got[0][3][1], Regex)
    for bad in ("(a", "a)", '(a "b)'):
        with pytest.raises(ValueError):
            parse_sexprs(bad)


def test_the_launcher_refuses_a_profile_file_that_differs_or_others_can_write(tmp_path):
    policy = darwin_policy()
    slot = policy["slots"][0]
    expected = seatbelt.profile(policy, slot)

    class St:
        def __init__(self, uid, mode):
            self.st_uid, self.st_mode = uid, mode

    def read(text):
        return lambda _path: text

    darwinmod.check_profile("/p.sb", expected, stat=lambda _p: St(0, 0o100644), read=read(expected))
    for stat, text in ((lambda _p: St(0, 0o100644), expected.replace("(deny default)\n", "")),
                       (lambda _p: St(501, 0o100644), expected),
                       (lambda _p: St(0, 0o100666), expected)):
        with pytest.raises(darwinmod.Refused):
            darwinmod.check_profile("/p.sb", expected, stat=stat, read=read(text))
    with pytest.raises(darwinmod.Refused):
        darwinmod.check_profile(str(tmp_path / "missing.sb"), expected)


def test_a_path_seatbelt_cannot_carry_is_refused():
    with pytest.raises(ValueError):
        seatbelt.quote("/opt/a\nb")
    assert seatbelt.quote('/a "b"') == '"/a \\"b\\""'
