"""A statement in docs is a claim: every test, file and variable a page of
docs/ (or README.md) names in backticks exists in this checkout.

What is checked, in `code spans` only (prose is not parsed):
- a repository path (`roles/...`, `tests/...`, `molecule/...`, ...; a `*`
  is a glob) exists; `path.py::test_name` also names a test defined there;
- a bare test file name (`test_doors.py`) exists somewhere under tests/ or
  molecule/, and `test_doors.py::test_x` names a test defined in it;
- a test name (`test_...`; a trailing `...` or `*` makes it a prefix or a
  glob) is defined by some test module;
- a variable of the collection (`chv_...`, `cell_nat_...`, `lab_...`) is
  named somewhere in the code (roles, plugins, playbooks, lab, molecule).
Guest-side paths (`/etc/...`) and anything else are not checked here.
"""

import fnmatch
import functools
import glob
import os
import re

import pytest

from testpaths import ROOT

DOCS = sorted([os.path.join(ROOT, "README.md")]
              + [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")])
TOP = ("roles", "plugins", "tests", "molecule", "docs", "lab", "bench", "hack", "playbooks", "src",
       "changelogs", "meta", "requirements", ".config", ".ci")
TOP_FILES = ("site.yml", "remove.yml", "Makefile", "galaxy.yml", "ansible.cfg", "README.md", "DEVELOPERS.md", "bindep.txt",
             "requirements.txt", ".ansible-lint", ".ansible-lint-ignore")
CODE_DIRS = ("roles", "plugins", "playbooks", "lab", "molecule", "src", "site.yml", "remove.yml", "meta", "Makefile",
             "tests", "hack", "bench", ".config")
SKIP_DIRS = {".git", ".venv", ".venv312", "build", "__pycache__", "node_modules"}
TEST_NAME = re.compile(r"^(test_[A-Za-z0-9_]+)(\.\.\.|\*)?$")
TEST_FILE = re.compile(r"^(test_[A-Za-z0-9_]+\.py)(?:::(test_[A-Za-z0-9_]+)(\.\.\.|\*)?)?$")
# a variable, a prefix glob of variables (`chv_cell_*`) or a setting (`chv_cell_slots: 0`)
VARIABLE_SPAN = re.compile(r"^(chv_[a-z0-9_]+?|cell_nat_[a-z0-9_]+?|lab_[a-z0-9_]+?)(_?\*)?(?::\s.*)?$")
FQCN = re.compile(r"^chv\.(fleet|fleet_lab)\.([a-z0-9_]+)$")
PY_FILE = re.compile(r"^([A-Za-z0-9_]+\.py)$")


def _walk(top):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            yield os.path.join(dirpath, f)


# a test function's definition in a module's text
DEF = re.compile(r"^\s*(?:async\s+)?def\s+(test_[A-Za-z0-9_]+)", re.M)


@functools.lru_cache(maxsize=None)
def _test_modules():
    """{relative path: set of test function names} of every test module."""
    out = {}
    for top in ("tests", "molecule"):
        for path in _walk(os.path.join(ROOT, top)):
            if os.path.basename(path).startswith("test_") and path.endswith(".py"):
                with open(path, encoding="utf-8") as fh:
                    out[os.path.relpath(path, ROOT)] = set(DEF.findall(fh.read()))
    return out


@functools.lru_cache(maxsize=None)
def _code_text():
    parts = []
    for top in CODE_DIRS:
        path = os.path.join(ROOT, top)
        for f in ([path] if os.path.isfile(path) else _walk(path)):
            if f == os.path.abspath(__file__):
                continue  # its own made-up names
            if f.endswith((".py", ".yml", ".yaml", ".j2", ".json", ".cfg", ".ini", ".toml", ".nft", ".sh")) \
                    or os.path.basename(f) in ("Makefile", "chv-cell", "chv-cell-agent"):
                with open(f, encoding="utf-8", errors="replace") as fh:
                    parts.append(fh.read())
    return "\n".join(parts)


def _names_match(names, name, suffix):
    if suffix == "...":
        return any(n.startswith(name) for n in names)
    if suffix == "*":
        return any(fnmatch.fnmatch(n, name + "*") for n in names)
    return name in names


def _defined_anywhere(name, suffix):
    return any(_names_match(names, name, suffix) for names in _test_modules().values())


def check_span(span):
    """None if the span's claim holds (or it is not a claim checked here), else why not."""
    span = span.strip()
    head, _, test = span.partition("::")
    test_m = TEST_NAME.match(test) if test else None
    if head.split("/")[0] in TOP and "/" in head or head in TOP_FILES:
        path = head.rstrip("/").split(" ")[0]
        if not path or re.search(r"[<>{}$]", path):
            return None
        # a module named without .py, a role's file named from inside a role (meta/main.yml)
        matches = [m for pattern in (path, path + ".py", "roles/*/" + path)
                   for m in glob.glob(os.path.join(ROOT, pattern)) if os.path.exists(m)]
        if not matches:
            return "no such path: %s" % path
        if test_m:
            rel = os.path.relpath(matches[0], ROOT)
            if not _names_match(_test_modules().get(rel, set()), test_m.group(1), test_m.group(2)):
                return "%s defines no test %s" % (rel, test)
        return None
    m = TEST_FILE.match(span)
    if m:
        files = [rel for rel in _test_modules() if os.path.basename(rel) == m.group(1)]
        if not files:
            return "no test file named %s under tests/ or molecule/" % m.group(1)
        if m.group(2) and not any(_names_match(_test_modules()[f], m.group(2), m.group(3)) for f in files):
            return "%s defines no test %s" % (m.group(1), m.group(2) + (m.group(3) or ""))
        return None
    m = TEST_NAME.match(span[2:] if span.startswith("::") else span)
    if m:
        return None if _defined_anywhere(m.group(1), m.group(2)) else "no test named %s" % span
    m = VARIABLE_SPAN.match(span)
    if m:
        name, glob_ = m.group(1), m.group(2)
        pattern = r"\b%s%s\b" % (re.escape(name), r"\w*" if glob_ else "")
        return None if re.search(pattern, _code_text()) else "no variable %s in the code" % span
    m = FQCN.match(span)
    if m:
        return None if _fqcn_exists(m.group(1), m.group(2)) else "no plugin, role or playbook %s" % span
    m = PY_FILE.match(span)
    if m:
        return None if m.group(1) in _basenames() else "no file named %s" % span
    return None


@functools.lru_cache(maxsize=None)
def _basenames():
    return {os.path.basename(f) for f in _walk(ROOT)}


def _fqcn_exists(collection, name):
    root = os.path.join(ROOT, "lab") if collection == "fleet_lab" else ROOT
    candidates = ["roles/%s" % name, "playbooks/%s.yml" % name] + \
        ["plugins/%s/%s.py" % (kind, name) for kind in ("filter", "test", "modules", "lookup", "inventory", "callback")]
    if any(os.path.exists(os.path.join(root, c)) for c in candidates):
        return True
    # filters and tests: several in one file, registered by name
    for kind in ("filter", "test"):
        for f in glob.glob(os.path.join(root, "plugins", kind, "*.py")):
            with open(f, encoding="utf-8") as fh:
                if re.search(r"[\"']%s[\"']\s*:" % re.escape(name), fh.read()):
                    return True
    return False


# a code span of a page
SPAN = re.compile(r"`([^`\n]+)`")


def _claims():
    for doc in DOCS:
        with open(doc, encoding="utf-8") as fh:
            text = fh.read()
        # fenced blocks are commands and output, not claims about names
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in SPAN.findall(text):
            for part in re.split(r",\s*|\s+/\s+", span):
                yield os.path.relpath(doc, ROOT), part


@pytest.mark.parametrize("doc", [os.path.relpath(d, ROOT) for d in DOCS])
def test_every_name_a_page_gives_exists(doc):
    bad = sorted({"%s: `%s`" % (why, part) for page, part in _claims() if page == doc
                  for why in [check_span(part)] if why})
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("span, holds", [
    ("tests/unit/test_docs_claims.py", True),
    ("tests/unit/test_docs_claims.py::test_every_name_a_page_gives_exists", True),
    ("test_docs_claims.py::test_every_name_a_page_gives_exists", True),
    ("test_every_name_a_page_gives...", True),
    ("chv_cell_disk_max", True),
    ("tests/unit/test_no_such_file.py", False),
    ("test_docs_claims.py::test_a_made_up_test_name", False),
    ("test_a_made_up_test_name", False),
    ("chv_a_made_up_variable", False),
    ("chv_cell_disk_*", True),
    ("chv_cell_slots: 0", True),
    ("chv_a_made_up_*", False),
    ("::test_every_name_a_page_gives_exists", True),
    ("chv.fleet.layered", True),
    ("chv.fleet.cell_runtime", True),
    ("chv.fleet.no_such_filter", False),
    ("counterproof.py", True),
    ("no_such_module.py", False),
])
def test_the_checker_tells_a_true_claim_from_a_false_one(span, holds):
    assert (check_span(span) is None) is holds, check_span(span)
