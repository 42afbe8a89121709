"""Unit properties -> cgroup v2 files (chv_cell.limits), and the launcher's
use of them on a fake cgroup tree (regular files; the real-cell tests run
against this host's cgroup2, which has no controllers)."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chv_guest.cell import errors
from chv_guest.cell import limits
from chv_guest.cell import cgroups, checks
from chv_guest.cell.policy import merged

G = 1 << 30


@pytest.mark.parametrize(
    "prop, value, expected",
    [
        ("MemoryMax", "4G", ("memory", "memory.max", str(4 * G))),
        ("MemoryMax", "512M", ("memory", "memory.max", str(512 << 20))),
        ("MemoryMax", "1.5G", ("memory", "memory.max", str(3 * G // 2))),
        ("MemoryMax", 1048576, ("memory", "memory.max", "1048576")),
        ("MemoryMax", "infinity", ("memory", "memory.max", "max")),
        ("MemoryMax", "50%", ("memory", "memory.max", str(G))),
        ("MemoryHigh", "1K", ("memory", "memory.high", "1024")),
        ("MemorySwapMax", "0", ("memory", "memory.swap.max", "0")),
        ("TasksMax", 1024, ("pids", "pids.max", "1024")),
        ("TasksMax", "512", ("pids", "pids.max", "512")),
        ("TasksMax", "infinity", ("pids", "pids.max", "max")),
        ("TasksMax", "10%", ("pids", "pids.max", "409")),
        ("CPUQuota", "200%", ("cpu", "cpu.max", "200000 100000")),
        ("CPUQuota", "50%", ("cpu", "cpu.max", "50000 100000")),
        ("CPUQuota", "0.5%", ("cpu", "cpu.max", "1000 100000")),
        ("CPUWeight", 100, ("cpu", "cpu.weight", "100")),
    ],
)
def test_convert(prop, value, expected):
    lim = limits.convert(prop, value, mem_total=2 * G, tasks_total=4096)
    assert (lim.controller, lim.file, lim.value) == expected
    assert lim.prop == prop


@pytest.mark.parametrize(
    "prop, value, reason",
    [
        ("IOWeight", 100, "not a property the launcher can map"),
        ("DeviceAllow", "/dev/null rw", "not a property the launcher can map"),
        ("MemoryMax", "lots", "expected bytes"),
        ("MemoryMax", "4Q", "expected bytes"),
        ("MemoryMax", "150%", "above 100%"),
        ("TasksMax", 0, "at least one task"),
        ("TasksMax", "many", "expected a number of tasks"),
        ("CPUQuota", "2", "expected a percentage"),
        ("CPUQuota", "0%", "expected a percentage"),
        ("CPUWeight", 0, "between 1 and 10000"),
        ("CPUWeight", True, "not a value"),
    ],
)
def test_convert_refuses(prop, value, reason):
    with pytest.raises(limits.LimitError) as e:
        limits.convert(prop, value, mem_total=G, tasks_total=4096)
    assert reason in str(e.value) and prop in str(e.value)


def test_percentages_need_host_facts():
    with pytest.raises(limits.LimitError, match="host's memory size"):
        limits.convert("MemoryMax", "10%")
    with pytest.raises(limits.LimitError, match="task limit"):
        limits.convert("TasksMax", "10%")
    assert limits.convert("MemoryMax", "1G").value == str(G)  # no facts needed without %


def test_plan_collects_every_problem():
    lims, errs = limits.plan({"MemoryMax": "1G", "TasksMax": 5, "IOWeight": 10, "CPUQuota": "x"})
    assert [lim.prop for lim in lims] == ["MemoryMax", "TasksMax"]
    assert len(errs) == 2 and any("IOWeight" in e for e in errs) and any("CPUQuota" in e for e in errs)


@given(n=st.integers(min_value=0, max_value=1 << 40), unit=st.sampled_from(["", "K", "M", "G", "T"]),
       b=st.sampled_from(["", "B"]))
def test_sizes_are_base_1024(n, unit, b):
    lim = limits.convert("MemoryMax", "%d%s%s" % (n, unit, b))
    assert int(lim.value) == n * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]


@given(pct=st.integers(min_value=1, max_value=6400))
def test_cpu_quota_is_pct_of_one_cpu_per_period(pct):
    lim = limits.convert("CPUQuota", "%d%%" % pct)
    q, per = (int(x) for x in lim.value.split())
    assert per == 100000 and q == max(1000, pct * 1000)
    assert limits.matches(lim, lim.value)
    assert not limits.matches(lim, "max 100000")


@given(nbytes=st.integers(min_value=0, max_value=1 << 44))
def test_memory_matches_at_page_granularity(nbytes):
    lim = limits.convert("MemoryMax", str(nbytes))
    kernel = nbytes // 4096 * 4096  # the kernel keeps pages, rounding down
    assert limits.matches(lim, "%d\n" % kernel)
    assert not limits.matches(lim, "%d\n" % (kernel + 4096))
    assert not limits.matches(lim, "max\n")


def test_matches_other_kinds():
    tasks = limits.convert("TasksMax", 512)
    assert limits.matches(tasks, "512\n") and not limits.matches(tasks, "max\n") and not limits.matches(tasks, "511")
    inf = limits.convert("TasksMax", "infinity")
    assert limits.matches(inf, "max\n") and not limits.matches(inf, "512")
    cpu = limits.convert("CPUQuota", "200%")
    assert limits.matches(cpu, "400000 200000")  # same ratio, another period
    assert not limits.matches(cpu, "100000 100000") and not limits.matches(cpu, "garbage")


def test_unavailable_names_controller_or_file():
    lims, dummy = limits.plan({"MemoryMax": "1G", "TasksMax": 5, "CPUQuota": "100%"})
    bad = limits.unavailable(lims, {"cpu", "pids"}, {"cpu.max"})
    assert [(lim.prop, r) for lim, r in bad] == [
        ("MemoryMax", "controller memory is not available"),
        ("TasksMax", "pids.max is absent"),
    ]
    assert limits.unavailable(lims, {"cpu", "pids", "memory"}, {"cpu.max", "pids.max", "memory.max"}) == []
    assert "MemoryMax (memory.max): controller memory" in limits.describe(bad)


def test_scope_dir_walks_up():
    unit = "chv-cell-slot0-42.scope"
    assert limits.scope_dir("/system.slice/%s/payload" % unit, unit) == "/system.slice/" + unit
    assert limits.scope_dir("/system.slice/" + unit, unit) == "/system.slice/" + unit
    assert limits.scope_dir("/system.slice/chv-cell-slot0-43.scope/payload", unit) is None
    assert limits.scope_dir("/", unit) is None


# ---------------------------------------------------------------- launcher on a fake cgroup tree
def fake_tree(tmp_path, controllers, files):
    parent = tmp_path / "parent"
    cell = parent / "chv-cell-slot0"
    cell.mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text(" ".join(controllers) + "\n")
    for f in files:
        (cell / f).write_text("max\n")
    return str(cell)


def launcher(policy, **kw):
    """The policy of a launcher with ``kw`` (checks.py's functions take the policy)."""
    policy.update(kw)
    return policy


def test_standalone_limits_written_when_controllers_are_there(tmp_path, policy):
    cell = fake_tree(tmp_path, ["cpu", "memory", "pids"], ["memory.max", "pids.max", "cpu.max"])
    la = launcher(policy, properties={"MemoryMax": "2G", "TasksMax": 512, "CPUQuota": "150%"})
    checks.apply_standalone_limits(la, policy["slots"][0], cell)
    assert open(cell + "/memory.max").read() == "%d\n" % (2 * G)
    assert open(cell + "/pids.max").read() == "512\n"
    assert open(cell + "/cpu.max").read() == "150000 100000\n"


def test_standalone_limits_refused_naming_property_and_controller(tmp_path, policy, capsys):
    cell = fake_tree(tmp_path, ["cpu"], ["cpu.max"])
    la = launcher(policy, properties={"MemoryMax": "2G", "CPUQuota": "150%"})
    with pytest.raises(errors.SetupError) as e:
        checks.apply_standalone_limits(la, policy["slots"][0], cell)
    msg = str(e.value)
    assert "MemoryMax (memory.max): controller memory is not available" in msg
    assert "require_limits" in msg and "CPUQuota" not in msg
    assert open(cell + "/cpu.max").read() == "max\n"  # nothing written before the refusal


def test_standalone_limits_warn_and_apply_the_rest_without_require_limits(tmp_path, policy, capsys):
    cell = fake_tree(tmp_path, ["cpu"], ["cpu.max"])
    la = launcher(policy, properties={"MemoryMax": "2G", "CPUQuota": "150%", "IOWeight": 50}, require_limits=False)
    checks.apply_standalone_limits(la, policy["slots"][0], cell)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WARNING: resource limits NOT enforced" in err
    assert "MemoryMax (memory.max): controller memory" in err and "IOWeight" in err
    assert open(cell + "/cpu.max").read() == "150000 100000\n"


def test_standalone_unmappable_property_refused(tmp_path, policy):
    cell = fake_tree(tmp_path, ["cpu", "memory", "pids", "io"], ["memory.max", "pids.max", "cpu.max"])
    la = launcher(policy, properties={"IOWeight": 50})
    with pytest.raises(errors.SetupError, match="IOWeight is not a property the launcher can map"):
        checks.apply_standalone_limits(la, policy["slots"][0], cell)


def test_no_properties_no_check(tmp_path, policy):
    la = launcher(policy, properties={})
    checks.apply_standalone_limits(la, policy["slots"][0], None)  # nothing asked, nothing needed


def test_no_cgroup2_refused(policy):
    la = launcher(policy, properties={"TasksMax": 10})
    with pytest.raises(errors.SetupError, match="TasksMax .*no cgroup2 hierarchy"):
        checks.apply_standalone_limits(la, policy["slots"][0], None)


def test_scope_limit_problems(tmp_path):
    lims, dummy = limits.plan({"MemoryMax": "1G", "TasksMax": 100, "CPUQuota": "200%"})
    d = tmp_path / "chv-cell-slot0-1.scope"
    d.mkdir()
    (d / "pids.max").write_text("100\n")
    (d / "cpu.max").write_text("max 100000\n")
    probs = cgroups.scope_limit_problems(lims, str(d), page=4096)
    assert len(probs) == 2
    assert any(p.startswith("MemoryMax (memory.max): memory.max is absent") and "controller memory not delegated" in p
               for p in probs)
    assert any(p.startswith("CPUQuota (cpu.max): reads 'max 100000'") for p in probs)
    (d / "memory.max").write_text("%d\n" % G)
    (d / "cpu.max").write_text("200000 100000\n")
    assert cgroups.scope_limit_problems(lims, str(d), page=4096) == []


def test_policy_defaults_keep_limits_required():
    assert merged({})["require_limits"] is True
    assert os.path.basename(limits.MAPPING["TasksMax"][1]) == "pids.max"
