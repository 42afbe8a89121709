"""No two task files share a block of six or more lines (issue 30): the
YAML half of `duplicates`, which reads no YAML. The task files are those
under roles/*/tasks and playbooks/ (but its vars); a line counts with its
white space folded, blank lines, comments and "---" left out. A shared
block is a place for a task file of _common or an include, not a copy.

KNOWN lists the blocks that are shared today, each by its two files and
its first line: any other shared block fails, and so does a known one
that is gone (then strike it here).
"""

import glob
import os
import sys

from testpaths import ROOT

MIN_LINES = 6
PATTERNS = ("roles/*/tasks/**/*.y*ml", "playbooks/**/*.y*ml")

KNOWN = {
    # being split by the broker/browser change of issue 30 (not this file's to fix)
    ("roles/browser/tasks/darwin.yml", "roles/browser/tasks/linux.yml",
     "- name: Install Playwright for Python into the service's venv"),
    # a play's keywords cannot come from a file: the two plays' headers
    ("playbooks/remove.yml", "playbooks/site.yml", "become: true"),
    # the cell identity settings, passed to the preflight and to cell_identity
    ("playbooks/validate.yml", "roles/cell_runtime/tasks/linux.yml", "ifname_prefix: \"{{ chv_cell_ifname_prefix }}\""),
    # cell_runtime's two platforms: the agent user, the launcher's package
    ("roles/cell_runtime/tasks/darwin.yml", "roles/cell_runtime/tasks/linux.yml",
     "- name: Create the agent user (only when missing)"),
    ("roles/cell_runtime/tasks/darwin.yml", "roles/cell_runtime/tasks/linux.yml", "tags: [configure]"),
}


def task_files():
    found = set()
    for pattern in PATTERNS:
        found.update(glob.glob(os.path.join(ROOT, pattern), recursive=True))
    return sorted(os.path.relpath(f, ROOT) for f in found if "/vars/" not in f)


def counted_lines(path):
    """(folded text, line number) of each line that counts."""
    out = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            text = " ".join(line.split())
            if text and not text.startswith("#") and text != "---":
                out.append((text, number))
    return out


def shared_blocks(files):
    """{(file a, file b, first line): "a:from-to ~ b:from-to"} of the longest blocks two files share."""
    lines = {f: counted_lines(f) for f in files}
    windows = {}
    for f, ls in lines.items():
        for i in range(len(ls) - MIN_LINES + 1):
            windows.setdefault(tuple(t for t, _ in ls[i:i + MIN_LINES]), []).append((f, i))
    out = {}
    for places in windows.values():
        for k, (fa, ia) in enumerate(places):
            for fb, ib in places[k + 1:]:
                if fa == fb:
                    continue
                (fa, ia), (fb, ib) = sorted([(fa, ia), (fb, ib)])
                la, lb = lines[fa], lines[fb]
                while ia > 0 and ib > 0 and la[ia - 1][0] == lb[ib - 1][0]:
                    ia, ib = ia - 1, ib - 1
                n = MIN_LINES
                while ia + n < len(la) and ib + n < len(lb) and la[ia + n][0] == lb[ib + n][0]:
                    n += 1
                out[(fa, fb, la[ia][0])] = "%s:%d-%d ~ %s:%d-%d" % (
                    fa, la[ia][1], la[ia + n - 1][1], fb, lb[ib][1], lb[ib + n - 1][1])
    return out


def test_no_two_task_files_share_a_block():
    found = shared_blocks(task_files())
    new = sorted(where for key, where in found.items() if key not in KNOWN)
    assert not new, "task files sharing %d or more lines:\n%s" % (MIN_LINES, "\n".join(new))
    assert not KNOWN - set(found), "known shared blocks that are gone (strike them): %s" % sorted(KNOWN - set(found))


def test_the_check_finds_a_shared_block(tmp_path, monkeypatch):
    """Positive control: a block copied into a second file is found, a shorter one is not."""
    block = "".join("- name: step %d\n  ansible.builtin.debug: {msg: '%d'}\n" % (i, i) for i in range(3))
    (tmp_path / "a.yml").write_text("---\n# a comment\n" + block)
    (tmp_path / "b.yml").write_text("- name: other\n" + block.replace("  ", "    "))
    (tmp_path / "c.yml").write_text(block[:block.index("- name: step 2")])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert list(shared_blocks(["a.yml", "b.yml", "c.yml"]).values()) == ["a.yml:3-8 ~ b.yml:2-7"]
