"""freeze.py: which cgroup of a cell chv-broker freezes for its sync (pure parts)."""
import pytest

from chv_guest.broker.freeze import FreezeError, cell_cgroup_path, unit_of


@pytest.mark.parametrize("text, want", [
    ("0::/chv-cell-slot0\n", "/chv-cell-slot0"),
    ("0::/system.slice/chv-cell-slot0-r1.scope/payload\n", "/system.slice/chv-cell-slot0-r1.scope"),
    # the cell moved its leader into a child cgroup: still the whole cell
    ("0::/x/chv-cell-slot0/inner/chv-cell-slot0\n", "/x/chv-cell-slot0"),
    ("12:pids:/\n1:name=systemd:/chv-cell-slot0\n0::/a/chv-cell-slot0/b\n", "/a/chv-cell-slot0"),
])
def test_cell_cgroup_is_the_outermost_of_the_slot(text, want):
    assert cell_cgroup_path(text, "slot0") == want


@pytest.mark.parametrize("text", ["0::/\n", "0::/chv-cell-slot01\n", "0::/chv-cell-slot1-r.scope\n",
                                  "1:name=systemd:/chv-cell-slot0\n"])
def test_no_cgroup_of_the_slot_refuses(text):
    with pytest.raises(FreezeError):
        cell_cgroup_path(text, "slot0")


def test_unit_of():
    assert unit_of("/sys/fs/cgroup/system.slice/chv-cell-s-r.scope") == "chv-cell-s-r.scope"
    assert unit_of("/sys/fs/cgroup/chv-cell-s") is None
