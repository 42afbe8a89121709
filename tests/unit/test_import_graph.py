"""The import graph of the guest-side programs and the controller plugins:
no import circle between the programs' modules (lazy imports inside
functions count: a circle held together by them is still a circle; imports
under ``if TYPE_CHECKING:`` never run and do not), and no
code that imports by file path (importlib's spec_from_file_location,
SourceFileLoader, imp, runpy by path) or edits sys.path in the plugins or
the programs: each is imported by its one normal import path."""

import ast
import os

import pytest

from testpaths import ROOT

# The guest-side package (src/chv_guest): its import name -> directory.
PACKAGES = {"chv_guest": os.path.join(ROOT, "src", "chv_guest")}
NO_PATH_IMPORTS = [os.path.join(ROOT, "plugins")] + list(PACKAGES.values())
BY_PATH = {("importlib.util", "spec_from_file_location"), ("importlib.machinery", "SourceFileLoader"),
           ("runpy", "run_path"), ("imp", "load_source")}


def _modules():
    """{module name: path} of every module of the packages."""
    out = {}
    for top, directory in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), directory)[:-3].replace(os.sep, ".")
                    name = top if rel == "__init__" else "%s.%s" % (top, rel[:-len(".__init__")] if rel.endswith(
                        ".__init__") else rel)
                    out[name] = os.path.join(dirpath, f)
    return out


def _type_only(tree):
    """The nodes under ``if TYPE_CHECKING:`` (imports for the type checker
    only, never run: they make no circle at run time)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def _imports(name, path, known):
    """The package modules ``name`` imports at run time (anywhere in the
    file, inside functions too; not the type checker's imports)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + ["%s.%s" % (base, a.name) for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def graph():
    mods = _modules()
    return dict((name, _imports(name, path, mods)) for name, path in mods.items())


def test_the_programs_have_no_import_circle():
    circles = _circles(graph())
    # a package's __init__ importing its own modules is no circle of interest
    circles = [c for c in circles if not any(m in PACKAGES for m in c)]
    assert circles == [], circles


def test_the_graph_sees_the_launchers_imports():
    """The circle test reads real edges (a graph of nothing has no circle)."""
    g = graph()
    assert {"chv_guest.cell.launcher", "chv_guest.cell.cgroups"} <= g["chv_guest.cell.runner"]
    assert "chv_guest.cell.runner" in g["chv_guest.cell.warm"]
    assert "chv_guest.cell.actions" in g["chv_guest.cell.agent"] and "chv_guest.cell.agent" in g["chv_guest.cell.cli"]


def test_the_circle_finder_finds_a_circle_and_no_false_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _by_path(path):
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            full = ast.unparse(owner) if hasattr(ast, "unparse") else owner_name
            if (full, node.func.attr) in BY_PATH or (owner_name == "path" and node.func.attr in ("insert", "append")
                                                     and "sys" in full):
                bad.append("%s:%d: %s.%s" % (os.path.relpath(path, ROOT), node.lineno, full, node.func.attr))
        if isinstance(node, ast.ImportFrom) and (node.module, ) and any(
                (node.module, a.name) in BY_PATH for a in node.names):
            bad.append("%s:%d: from %s import ..." % (os.path.relpath(path, ROOT), node.lineno, node.module))
    return bad


def _py_files(top):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


@pytest.mark.parametrize("top", [os.path.relpath(t, ROOT) for t in NO_PATH_IMPORTS])
def test_no_import_by_file_path_and_no_sys_path_edits(top):
    bad = [b for f in _py_files(os.path.join(ROOT, top)) for b in _by_path(f)]
    assert bad == [], "\n".join(bad)


def test_the_path_import_finder_sees_each_way(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import importlib.util, sys\n"
                 "spec = importlib.util.spec_from_file_location('m', '/x/m.py')\n"
                 "sys.path.insert(0, '/x')\n"
                 "from importlib.util import spec_from_file_location\n")
    assert len(_by_path(str(p))) == 3


def test_lazy_imports_count_and_type_checking_imports_do_not(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    known = {"p", "p.a", "p.b"}
    assert _imports("p.a", str(tmp_path / "a.py"), known) == {"p", "p.b"}  # the package, then its module
    assert _imports("p.b", str(tmp_path / "b.py"), known) == set()  # type-checker only
