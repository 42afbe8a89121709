#!/usr/bin/env python3
"""Build the chv.fleet docs site: `make docs` (python3 hack/build_docs.py).

The site documents what ships: the collection tarball is built and installed
into an empty collections path under build/docs/, antsibull-docs writes the
plugin and role pages from that installed copy, and the Markdown pages
(README.md and every docs/*.md the tarball carries) are taken as they are by
myst-parser. sphinx-build runs with -W --keep-going, so any warning (a broken
link or reference, a heading out of order, a code block that does not lex)
fails the build; antsibull-docs lint-collection-docs runs first on the
installed collection.

The tools come from a venv of their own, build/docs-venv, made from
requirements/docs.lock when that file changes (requirements/docs.in says why
they are not in the toolchain locks). Nothing else is fetched: no Galaxy, no
intersphinx inventories. References into ansible-core's own documentation
(ansible.builtin plugins and their options, two reference pages the generated
pages cite) resolve to links to docs.ansible.com without an inventory: the
ansible.builtin ones are checked against the installed ansible-core by the
lint step (--validate-collection-refs dependent), and anything else that does
not resolve is a warning, and so a failure.

The site lands in build/docs/html/index.html.

This file is also imported by the generated conf.py (for `setup`), so nothing
runs at import time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The order of the guides in the site's table of contents (README's own
# order); any other docs/*.md in the tarball follows, by name.
GUIDE_ORDER = [
    "architecture", "lab", "identities", "cells", "executor", "network",
    "services", "security", "isolation-cases", "operations", "reliability",
    "performance", "releasing",
]

# Labels of the Ansible docsite that antsibull-docs' templates themselves cite
# (the "Return Values" link of every module page, the environment variables
# index). Their pages, relative to the ansible-core docs root.
ANSIBLE_DOCSITE_LABELS = {
    "common_return_values": "reference_appendices/common_return_values.html",
    "ansible_configuration_settings": "reference_appendices/config.html",
    # a callback plugin's page (chv.fleet.fleet_summary)
    "callback_plugins": "plugins/callback.html",
}
_BUILTIN_REF = re.compile(
    r"^ansible_collections\.ansible\.builtin\."
    r"(?P<name>[a-z0-9_]+)_(?P<type>[a-z]+)(?:__(?P<anchor>[a-z]+-[A-Za-z0-9_./-]+))?$"
)


def log(msg: str) -> None:
    print(f"docs: {msg}", flush=True)


def run(cmd: list[str], env: dict, cwd: Path, quiet: bool = False) -> str:
    """Run cmd; on failure show its output and stop."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"docs: FAILED ({proc.returncode}): {' '.join(cmd)}")
    if not quiet and proc.stdout.strip():
        sys.stdout.write(proc.stdout)
    return proc.stdout


def ensure_venv(root: Path, venv: Path) -> None:
    """(Re)create the docs venv when requirements/docs.lock changed."""
    lock = root / "requirements" / "docs.lock"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = venv / ".stamp"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return
    log(f"creating {venv} from {lock.relative_to(root)}")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                    "-r", str(lock)], check=True)
    stamp.write_text(digest + "\n")


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, mode=0o755)
    path.chmod(0o755)  # antsibull-docs wants its dest dir writable by its owner only
    return path


def guide_pages(coll: Path) -> list[str]:
    """README and the docs/*.md the installed collection carries, as docnames."""
    found = sorted(p.stem for p in (coll / "docs").glob("*.md"))
    ordered = [n for n in GUIDE_ORDER if n in found] + [n for n in found if n not in GUIDE_ORDER]
    pages = ["docs/" + n for n in ordered]
    if (coll / "README.md").is_file():
        pages.insert(0, "README")
    return pages


def write_sources(root: Path, src: Path, coll: Path, manifest: dict, pages: list[str], core_docs: str) -> None:
    info = manifest["collection_info"]
    (src / "docs").mkdir()
    for page in pages:
        shutil.copyfile(coll / f"{page}.md", src / f"{page}.md")
    entries = "\n".join(
        f"   Overview <{p}>" if p == "README" else f"   {p}" for p in pages)
    title = f"{info['namespace']}.{info['name']} {info['version']}"
    (src / "index.rst").write_text(f"""\
.. Generated by hack/build_docs.py: the site's root.

{title}
{'=' * len(title)}

{info['description']}

.. toctree::
   :maxdepth: 1
   :caption: Guides

{entries}

.. toctree::
   :maxdepth: 1
   :caption: Reference

   Roles, modules, filters and tests <collections/{info['namespace']}/{info['name']}/index>
   collections/environment_variables
   collections/deprecations

.. toctree::
   :maxdepth: 1
   :caption: Indexes
   :glob:

   collections/index_*
""")
    repo = info.get("repository") or ""
    conf = {
        "project": f"{info['namespace']}.{info['name']}",
        "copyright": ", ".join(info.get("authors") or []),
        "version": info["version"],
        "release": info["version"],
        "html_title": f"{info['namespace']}.{info['name']} {info['version']} documentation",
        "chv_repository": repo,
        "chv_repo_paths": sorted(_repo_paths(root, coll)),
        "chv_core_docs": core_docs,
    }
    lines = [
        "# Generated by hack/build_docs.py; the values come from the installed collection.",
        "import sys",
        f"sys.path.insert(0, {str(HERE)!r})",
        "from build_docs import sphinx_setup as setup  # noqa: E402,F401",
        "",
        "extensions = ['sphinx_antsibull_ext', 'myst_parser']",
        "source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}",
        "root_doc = 'index'",
        "exclude_patterns = []",
        # GitHub's heading anchors (docs/x.md#some-heading) work on the site too.
        "myst_heading_anchors = 4",
        "pygments_style = 'ansible'",
        # A fence without a language is plain text, as on GitHub (antsibull-docs' pages
        # name theirs: code-block:: yaml+jinja).
        "highlight_language = 'none'",
        "html_theme = 'sphinx_ansible_theme'",
        # the theme's top bar: this project's links, not docs.ansible.com's
        "html_theme_options = %r" % {
            "documentation_home_url": repo or "index.html",
            "topbar_links": {k: v for k, v in (("Repository", repo),
                                               ("Issues", info.get("issues") or "")) if v},
            "show_rtd_ethical_ads": False, "show_extranav": False},
        "html_short_title = %r" % f"{info['namespace']}.{info['name']}",
        "html_show_sphinx = False",
        "html_copy_source = False",
        "html_use_index = False",
        "html_use_modindex = False",
        "default_role = 'any'",
        "nitpicky = True",
    ]
    lines += [f"{k} = {v!r}" for k, v in conf.items()]
    (src / "conf.py").write_text("\n".join(lines) + "\n")


def _repo_paths(root: Path, coll: Path) -> set[str]:
    """The files and directories (with a trailing /) a Markdown page may link to as
    repository paths: the checkout's tracked files, else the installed collection's."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True)
    if proc.returncode == 0 and proc.stdout:
        files = [f for f in proc.stdout.decode().split("\0") if f]
    else:
        files = [p.relative_to(coll).as_posix() for p in coll.rglob("*") if p.is_file()]
    out = set(files)
    for f in files:
        parts = f.split("/")[:-1]
        out.update("/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
    return out


# ---------------------------------------------------------------- Sphinx side

def _external(contnode, url: str):
    from docutils import nodes
    ref = nodes.reference("", "", internal=False, refuri=url)
    ref += contnode
    return ref


def _missing_reference(app, env, node, contnode):
    """Resolve, without an inventory, the std:ref references that point into ansible-core's
    docs: ansible.builtin plugins with their options and return values, and the docsite
    labels antsibull-docs' templates cite. Anything else stays unresolved (a warning, and
    with -W a failure)."""
    if node.get("refdomain") != "std" or node.get("reftype") != "ref":
        return None
    base = app.config.chv_core_docs
    target = node.get("reftarget", "")
    if target in ANSIBLE_DOCSITE_LABELS:
        return _external(contnode, base + ANSIBLE_DOCSITE_LABELS[target])
    m = _BUILTIN_REF.match(target)
    if m:
        url = f"{base}collections/ansible/builtin/{m['name']}_{m['type']}.html"
        return _external(contnode, url + ("#" + m["anchor"] if m["anchor"] else ""))
    return None


def _repo_link_transform():
    from sphinx import addnodes
    from sphinx.transforms.post_transforms import SphinxPostTransform

    class RepoPathLinks(SphinxPostTransform):
        """A Markdown link to a file or directory of the shipped collection that is not a
        page of the site (README's "docs/") links to it in the repository, as on GitHub.
        Runs before myst's resolver (priority 9); a path that does not exist is left to it,
        and its warning fails the build."""

        default_priority = 8

        def run(self, **kwargs):
            cfg = self.app.config
            if not cfg.chv_repository:
                return
            paths = set(cfg.chv_repo_paths)
            for node in list(self.document.findall(addnodes.pending_xref)):
                if node.get("reftype") != "myst" or node.get("refdomain"):
                    continue
                target = node["reftarget"]
                path, _, anchor = target.partition("#")
                if not path or "://" in path:
                    continue
                docdir = os.path.dirname(node.get("refdoc", self.env.docname))
                rel = os.path.normpath(os.path.join(docdir, path))
                if rel.startswith(".."):
                    continue
                if rel + "/" in paths:
                    url = f"{cfg.chv_repository}/tree/main/{rel}"
                elif rel in paths:
                    url = f"{cfg.chv_repository}/blob/main/{rel}"
                else:
                    continue
                node.replace_self(_external(node[0].deepcopy(), url + ("#" + anchor if anchor else "")))

    return RepoPathLinks


def sphinx_setup(app):
    app.add_config_value("chv_repository", "", "env")
    app.add_config_value("chv_repo_paths", [], "env")
    app.add_config_value("chv_core_docs", "", "env")
    app.connect("missing-reference", _missing_reference)
    app.add_post_transform(_repo_link_transform())
    return {"parallel_read_safe": True, "parallel_write_safe": True}


# ---------------------------------------------------------------- the build

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.environ.get("ROOT") or str(HERE.parent),
                    help="the collection's checkout (default: $ROOT, else this script's repo)")
    ap.add_argument("--out", help="output directory (default: ROOT/build/docs)")
    ap.add_argument("--venv", help="the docs venv (default: ROOT/build/docs-venv)")
    args = ap.parse_args()
    t0 = time.monotonic()
    root = Path(args.root).resolve()
    out = Path(args.out).resolve() if args.out else root / "build" / "docs"
    venv = Path(args.venv).resolve() if args.venv else root / "build" / "docs-venv"
    ensure_venv(root, venv)
    t_venv = time.monotonic()

    bindir = venv / "bin"
    out.mkdir(parents=True, exist_ok=True)
    dist, colls, src, html, doctrees = (fresh_dir(out / d) for d in
                                        ("dist", "collections", "src", "html", "doctrees"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ANSIBLE_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update({
        "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        # only the tarball just installed: no dev symlink, no user or system collections
        "ANSIBLE_COLLECTIONS_PATH": str(colls),
        "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "false",
        "ANSIBLE_ROLES_PATH": str(out / "no-roles"),
        "ANSIBLE_CONFIG": str(out / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(out / "tmp"),
        "ANSIBLE_HOME": str(out / "ansible-home"),
        "PYTHONDONTWRITEBYTECODE": "1",
        # build/ is in .gitignore: antsibull-docs, finding the installed collection inside
        # this checkout's work tree, would copy only the files git does not ignore (none)
        # and lint an empty collection. Git stops looking for a repository here.
        "GIT_CEILING_DIRECTORIES": str(out),
    })

    (out / "ansible.cfg").write_text("# hack/build_docs.py: ansible's defaults, no project or user config\n")
    run([str(bindir / "ansible-galaxy"), "collection", "build", "--force",
         "--output-path", str(dist), str(root)], env, out, quiet=True)
    tarballs = sorted(dist.glob("*.tar.gz"))
    if len(tarballs) != 1:
        raise SystemExit(f"docs: expected one tarball in {dist}, found {tarballs}")
    run([str(bindir / "ansible-galaxy"), "collection", "install", "--offline", "--force",
         "-p", str(colls), str(tarballs[0])], env, out, quiet=True)
    manifests = list(colls.glob("ansible_collections/*/*/MANIFEST.json"))
    if len(manifests) != 1:
        raise SystemExit(f"docs: expected one installed collection, found {manifests}")
    coll = manifests[0].parent
    manifest = json.loads(manifests[0].read_text())
    fqcn = f"{manifest['collection_info']['namespace']}.{manifest['collection_info']['name']}"
    log(f"{tarballs[0].name} installed into {colls.relative_to(out.parent)}")
    t_install = time.monotonic()

    inside = subprocess.run(["git", "-C", str(coll), "rev-parse", "--is-inside-work-tree"],
                            env=env, capture_output=True, text=True)
    if inside.returncode == 0:
        raise SystemExit(f"docs: {coll} is seen inside a git work tree: antsibull-docs would"
                         " lint only the files git does not ignore")
    # Schemas and markup of every plugin and role, their references (to this collection
    # and to ansible.builtin), docs/docsite/links.yml and extra docs.
    run([str(bindir / "antsibull-docs"), "lint-collection-docs", "--plugin-docs",
         "--validate-collection-refs", "dependent", "--disallow-unknown-collection-refs",
         str(coll)], env, coll)
    log("antsibull-docs lint-collection-docs: clean")
    t_lint = time.monotonic()

    repo = manifest["collection_info"].get("repository") or ""
    cfg = out / "antsibull-docs.cfg"
    cfg.write_text(f"""\
breadcrumbs = true
indexes = true
use_html_blobs = false
add_antsibull_docs_version = false
collection_url = {{
  * = "{repo or 'https://galaxy.ansible.com/ui/repo/published/{namespace}/{name}/'}"
}}
collection_install = {{
  * = "ansible-galaxy collection install {tarballs[0].name}"
}}
""")
    run([str(bindir / "antsibull-docs"), "--config-file", str(cfg), "collection",
         "--use-current", "--fail-on-error", "--dest-dir", str(src), fqcn], env, out, quiet=True)
    pages = guide_pages(coll)
    core = run([str(bindir / "python"), "-c",
                "from ansible.release import __version__ as v; print('.'.join(v.split('.')[:2]))"],
               env, out, quiet=True).strip()
    write_sources(root, src, coll, manifest, pages,
                  f"https://docs.ansible.com/projects/ansible-core/{core}/")
    t_gen = time.monotonic()

    warnings = out / "warnings.txt"
    proc = subprocess.run(
        [str(bindir / "sphinx-build"), "-b", "html", "-E", "-q", "-W", "--keep-going",
         "-w", str(warnings), "-d", str(doctrees), "-c", str(src), str(src), str(html)],
        env=env, cwd=out, text=True)
    t_sphinx = time.monotonic()
    n_warn = sum(1 for line in warnings.read_text().splitlines()
                 if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line))
    if proc.returncode != 0 or n_warn:
        raise SystemExit(f"docs: FAILED: sphinx-build exit {proc.returncode}, {n_warn} warning(s)"
                         f" (listed above and in {warnings})")

    # Every page the sources promise was written (guards against a page silently dropped).
    built = {p.relative_to(html).with_suffix("").as_posix() for p in html.rglob("*.html")}
    sources = {p.relative_to(src).with_suffix("").as_posix()
               for p in src.rglob("*") if p.suffix in (".rst", ".md")}
    missing = sorted(sources - built)
    if missing:
        raise SystemExit(f"docs: FAILED: no HTML for {missing}")
    plugin_pages = [s for s in sources if s.startswith(f"collections/{fqcn.replace('.', '/')}/")
                    and not s.endswith("/index")]
    # ... and every role, module, filter and test the tarball ships has its page.
    shipped = ([f"{p.name}_role" for p in (coll / "roles").glob("*") if p.is_dir()]
               + [f"{p.stem}_module" for p in (coll / "plugins" / "modules").glob("*.py")
                  if p.name != "__init__.py"]
               + [f"{p.stem}_filter" for p in (coll / "plugins" / "filter").glob("*.yml")]
               + [f"{p.stem}_test" for p in (coll / "plugins" / "test").glob("*.yml")])
    undocumented = sorted(set(shipped) - {s.rsplit("/", 1)[-1] for s in plugin_pages})
    if undocumented:
        raise SystemExit(f"docs: FAILED: shipped but without a page: {undocumented}")
    log(f"{len(sources)} pages ({len(pages)} guides from README.md and docs/*.md,"
        f" {len(plugin_pages)} role/plugin pages, {len(sources) - len(pages) - len(plugin_pages)}"
        f" index pages), 0 warnings: {html / 'index.html'}")
    log(f"time {t_sphinx - t0:.1f}s (venv {t_venv - t0:.1f}, build+install {t_install - t_venv:.1f},"
        f" lint {t_lint - t_install:.1f}, antsibull-docs {t_gen - t_lint:.1f},"
        f" sphinx-build {t_sphinx - t_gen:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
