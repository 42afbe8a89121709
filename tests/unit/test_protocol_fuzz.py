"""The fuzz run of what a cell (or an operator's typo) can hand the
collection's parsers (docs/reliability.md): chv-broker's request line and
dispatch, chv-browser's dispatch, and the launcher's policy validator, each
fed generated inputs by hypothesis with an oracle of what may be accepted.

- A crash is any exception other than the parser's own refusal.
- A forbidden operation accepted: the broker forwarding to chv-browser
  anything but a known action with exactly its string fields and an
  http(s) URL, or running a disabled op; chv-browser reaching a handler
  with an unchecked slot, name or URL; the validator passing a policy below
  the floor (capabilities, system calls, no_new_privileges, binds of
  protected paths, overlapping or root uid ranges).

CHV_FUZZ_EXAMPLES sets the examples per target: make test runs 1,000 per
target (3,000 in all), `make fuzz` 34,000 (102,000). The last test checks
that each target really ran that many and writes the counts to
build/fuzz-counts.json."""

import copy
import io
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import broker_helpers  # noqa: F401  # pylint: disable=unused-import  # puts chv_broker on sys.path
from browser_helpers import Recorder
from cellrt import BASE_POLICY
from chv_guest.wire import protocol as bprotocol
from chv_guest.broker import server as bserver
from chv_guest.wire import wire as bwire
from chv_guest.browser import policy as bpolicy
from chv_guest.browser import server as wserver
from chv_guest.cell import policy as policymod
from testpaths import ROOT

EXAMPLES = int(os.environ.get("CHV_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])
COUNTS = {"broker": 0, "browser": 0, "policy": 0}
CELL = {"slot": "slot0", "pid": 4242, "uid_base": 100000, "uid_size": 65536}

# JSON values, and requests shaped like the real ones with hostile fields
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=10)
tricky_text = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["http://127.0.0.1/", "https://example.invalid/", "file:///etc/chv/broker/git-credentials",
                     "javascript:alert(1)", "data:text/html,<h1>x</h1>", "HTTP://EXAMPLE.INVALID/", "http:/x",
                     "//example.invalid/", "chrome://settings", "view-source:http://x/", "http://[::1]/",
                     "../../etc/passwd", "slot0/../slot1", "a" * 9000, "shot.png", "..", "slot0", "",
                     "ftp://example.invalid/", " http://example.invalid/", "http://example.invalid/\n"]))
requests = st.one_of(
    json_values,
    st.fixed_dictionaries({"op": st.sampled_from(sorted(bprotocol.OPS) + ["x", "", "PING"]) | json_values},
                          optional={"action": st.sampled_from(sorted(bprotocol.BROWSER_ACTIONS)
                                                              + sorted(bprotocol.SYNC_ACTIONS)) | tricky_text
                                    | json_values,
                                    "url": tricky_text | json_values, "name": tricky_text | json_values,
                                    "repo": tricky_text | json_values, "slot": tricky_text | json_values,
                                    "extra": json_values}))


# ------------------------------------------------------------- chv-broker

def _broker():
    cfg = bserver.merge(copy.deepcopy(bserver.DEFAULTS), {"sync": {"enabled": False}})
    return bserver.Broker(cfg, log=io.StringIO())


BROKER = _broker()
FORWARDED = []


def _fake_call(path, request, timeout, max_reply_bytes=0):  # pylint: disable=unused-argument
    FORWARDED.append(request)
    return {"ok": True, "result": {"title": "t", "url": request.get("url"), "aria_snapshot": "", "truncated": False,
                                   "status": 200}}


@FUZZ
@given(st.one_of(requests.map(lambda v: json.dumps(v).encode()), st.binary(max_size=200)))
def test_broker_refuses_or_forwards_only_what_a_cell_may_ask(line):
    COUNTS["broker"] += 1
    try:
        req = bwire.parse_object(line.replace(b"\n", b" "))
    except bwire.WireError:
        return
    assert isinstance(req, dict)
    del FORWARDED[:]
    saved, bserver.wire.call = bserver.wire.call, _fake_call
    try:
        result = BROKER.dispatch(CELL, req)
    except bserver.OpError:
        assert not FORWARDED
        return
    finally:
        bserver.wire.call = saved
    op = req["op"]
    assert op in ("ping", "browser"), req  # sync is disabled in this broker: never run
    if op == "ping":
        assert result == {"pong": True, "slot": "slot0"} and not FORWARDED
        return
    assert len(FORWARDED) == 1, FORWARDED
    fwd = FORWARDED[0]
    action = fwd["action"]
    assert action in bprotocol.BROWSER_ACTIONS
    assert set(fwd) == {"slot", "action", "cell"} | set(bprotocol.BROWSER_ACTIONS[action])
    assert fwd["slot"] == "slot0"  # the peer check's slot, never the request's
    assert fwd["cell"] == "4242"  # the peer check's cell (its run), never the request's
    assert all(isinstance(fwd[k], str) for k in bprotocol.BROWSER_ACTIONS[action])
    if "url" in fwd:
        assert bprotocol.url_scheme_allowed(fwd["url"]) and fwd["url"].split(":", 1)[0].lower() in ("http", "https")


# ------------------------------------------------------------- chv-browser

ENGINE = Recorder()
SERVER = wserver.Server(wserver.DEFAULTS, ENGINE)


@FUZZ
@given(requests)
def test_browser_reaches_a_handler_only_with_checked_arguments(req):
    COUNTS["browser"] += 1
    del ENGINE.calls[:]
    if not isinstance(req, dict):
        return  # the wire refuses a non-object before dispatch (parse_object)
    try:
        SERVER.dispatch(req)
    except bpolicy.Refused:
        assert not ENGINE.calls
        return
    assert len(ENGINE.calls) == 1
    op, slot = ENGINE.calls[0][:2]
    action = req["action"]
    assert action in bprotocol.BROWSER_ACTIONS and op == SERVER.actions[action]
    assert bpolicy.check_slot(slot) == slot == req["slot"]
    for field, value in zip(bprotocol.BROWSER_ACTIONS[action], ENGINE.calls[0][2:]):
        assert bpolicy.FIELD_CHECKS[field](value) == value
        if field == "url":
            assert value.split(":", 1)[0].lower() in ("http", "https")


# ------------------------------------------------------------- the policy validator

SLOT_VALUES = [0, -1, 1, 65536, 3000000, 3065536, 2 ** 32, "x", None, "eth0", "lo", "10.231.10.0/24", "a" * 20]


@st.composite
def policies(draw):
    """A valid policy with a few keys replaced, list entries dropped or
    added, or slots changed."""
    pol = copy.deepcopy(BASE_POLICY)
    pol["drop_capabilities"] = sorted(policymod.REQUIRED_DROPPED_CAPS | {policymod.USERNS_GUARD_CAP, "CAP_SYS_TIME"})
    pol["syscall_deny"] = sorted(policymod.REQUIRED_DENIED_SYSCALLS)
    for dummy in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(set(pol) | {"no_new_privileges", "allow_user_namespaces", "nspawn",
                                                      "readonly_binds", "writable_binds", "inaccessible"})))
        how = draw(st.sampled_from(["replace", "drop-one", "add-one", "slot"]))
        if how == "replace":
            pol[key] = draw(json_values | tricky_text)
        elif how == "drop-one" and isinstance(pol.get(key), list) and pol[key]:
            del pol[key][draw(st.integers(0, len(pol[key]) - 1))]
        elif how == "add-one" and isinstance(pol.get(key), list):
            pol[key].append(draw(st.one_of(tricky_text, json_values, st.fixed_dictionaries(
                {"source": st.sampled_from(["/run/chv-fleet", "/etc/chv", "/etc/chv/broker", "/", "/srv/data",
                                            "/var/lib/chv-fleet/identities.json", "relative", "/a:b"]),
                 "target": st.sampled_from(["/mnt/x", "/etc", "/usr", "/", "/run/chv-fleet", "rel"])}))))
        elif how == "slot" and isinstance(pol.get("slots"), list) and pol["slots"]:
            slot = pol["slots"][draw(st.integers(0, len(pol["slots"]) - 1))]
            if not isinstance(slot, dict) or not slot:
                continue
            slot[draw(st.sampled_from(sorted(slot)))] = draw(st.sampled_from(SLOT_VALUES))
    return pol


def _ranges_disjoint(slots):
    """Disjoint, or identical (the policy's shared-uid mode)."""
    spans = sorted(set((s["uid_base"], s["uid_base"] + s["uid_size"]) for s in slots))
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@FUZZ
@given(policies())
def test_the_validator_never_crashes_and_never_passes_a_policy_below_the_floor(pol):
    COUNTS["policy"] += 1
    errors = policymod.validate(pol)
    assert isinstance(errors, list) and all(isinstance(e, str) for e in errors)
    if errors:
        return
    p = policymod.merged(pol)
    assert policymod.REQUIRED_DROPPED_CAPS <= set(p["drop_capabilities"])
    assert p["allow_user_namespaces"] or policymod.USERNS_GUARD_CAP in p["drop_capabilities"]
    assert policymod.REQUIRED_DENIED_SYSCALLS <= set(p["syscall_deny"])
    assert p["no_new_privileges"] is True
    for bind in p["readonly_binds"] + p["writable_binds"]:
        for protected in policymod.PROTECTED_PATHS + (p["state_dir"],):
            assert not policymod.is_under(protected, bind["source"].replace("{slot}", "slot"))
    assert all(s["uid_base"] > 0 and s["uid_size"] > 0 for s in p["slots"])
    assert _ranges_disjoint(p["slots"])


def test_each_target_ran_its_examples():
    """Last in the file: the counts behind docs/reliability.md."""
    assert all(n >= EXAMPLES for n in COUNTS.values()), COUNTS
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    with open(os.path.join(ROOT, "build", "fuzz-counts.json"), "w") as fh:
        json.dump(dict(COUNTS, total=sum(COUNTS.values())), fh)
