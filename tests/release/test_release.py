"""The released collection as an operator gets it (make release-check).

`ansible-galaxy collection build` of this checkout, then:
- the tarball's members: LICENSE, operator content only (no tests, Molecule,
  benchmarks, helper scripts, tool configuration or the test lab), the
  guest-side programs the roles install (src/) among it;
- installed into an empty collections path: ansible-doc lists exactly the
  roles and plugins of the repository's operator content, and
  chv.fleet.site passes --syntax-check;
- installed, the roles' filters import the launcher from the collection's
  src/ and find each role's part of it there (chv.fleet.guest_tree);
- the execution environment: `ansible-builder create` with
  docs/examples/execution-environment holds the collection, and the
  context's own introspection (the script the image build runs) finds the
  collection's controller needs (netaddr, the ssh client);
- the changelog: antsibull-changelog lint, and CHANGELOG.rst lists the
  version galaxy.yml builds.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml

from testpaths import ROOT

BIN = os.path.dirname(sys.executable)
GALAXY = yaml.safe_load(open(os.path.join(ROOT, "galaxy.yml"), encoding="utf-8"))
VERSION = GALAXY["version"]
EE_EXAMPLE = os.path.join(ROOT, "docs", "examples", "execution-environment")

# Top-level entries of the tarball: operator content, and nothing else.
SHIPPED_TOP = {"MANIFEST.json", "FILES.json", "README.md", "LICENSE", "CHANGELOG.rst", "site.yml", "remove.yml",
               "requirements.txt", "bindep.txt", "meta", "playbooks", "roles", "plugins", "docs", "changelogs", "src"}
# What must never ship, named (a second look beside the allow-list above).
NEVER = ("tests/", "molecule/", "bench/", "hack/", "lab/", ".config/", ".ci/", "requirements/",
         "roles/lab/", "plugins/modules/lab_", "plugins/module_utils/lab.py", "playbooks/lab_",
         ".ansible-lint", "mypy.ini", "changelogs/fragments/", "Makefile", "pytest.ini")


def run(cmd, env=None, cwd="/tmp"):
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, check=False)
    assert proc.returncode == 0, "%s: rc %d\n%s\n%s" % (cmd, proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout


@pytest.fixture(scope="module")
def tarball(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run([os.path.join(BIN, "ansible-galaxy"), "collection", "build", "--force", "--output-path", str(out), ROOT])
    path = out / ("chv-fleet-%s.tar.gz" % VERSION)
    assert path.is_file()
    return path


def only(path):
    """An environment in which Ansible sees the collections under ``path``
    and nothing else: not the checkout, which tests/conftest.py puts on
    PYTHONPATH (Ansible scans sys.path for collections by default)."""
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(path), ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
               ANSIBLE_ROLES_PATH=str(path / "no-roles"))
    env.pop("PYTHONPATH", None)
    return env


def install(tarball, path):
    """``tarball`` installed into the empty collections path ``path``; the
    environment that sees only it."""
    env = only(path)
    out = run([os.path.join(BIN, "ansible-galaxy"), "collection", "install", "-p", str(path), str(tarball)], env=env)
    assert "chv.fleet:%s was installed successfully" % VERSION in out, out
    listed = json.loads(run([os.path.join(BIN, "ansible-galaxy"), "collection", "list", "chv.fleet", "--format", "json"],
                            env=env))
    assert list(listed) == [str(path / "ansible_collections")], listed
    return env


@pytest.fixture(scope="module")
def installed(tarball, tmp_path_factory):
    """The tarball installed into an empty collections path; the env that sees only it."""
    path = tmp_path_factory.mktemp("collections")
    return path, install(tarball, path)


def members(tarball):
    with tarfile.open(tarball) as tar:
        return [m.name for m in tar.getmembers()]


def test_the_tarball_holds_the_license_and_operator_content_only(tarball):
    names = members(tarball)
    assert {n.split("/")[0] for n in names} <= SHIPPED_TOP, sorted({n.split("/")[0] for n in names} - SHIPPED_TOP)
    leaked = [n for n in names if any(n == p.rstrip("/") or n.startswith(p) for p in NEVER)]
    assert leaked == []
    with tarfile.open(tarball) as tar:
        text = tar.extractfile("LICENSE").read().decode()
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as fh:
        assert text == fh.read()
    assert "GNU GENERAL PUBLIC LICENSE" in text and "Version 3, 29 June 2007" in text
    # the positive side: the content an operator runs is there
    for needed in ("site.yml", "remove.yml", "playbooks/site.yml", "meta/runtime.yml", "meta/execution-environment.yml",
                   "requirements.txt", "roles/cell_runtime/tasks/main.yml", "plugins/modules/cell_identity.py",
                   "CHANGELOG.rst", "changelogs/changelog.yaml"):
        assert needed in names, needed
    # the code the roles install on the guests: every file of src/ (no __pycache__)
    source = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _dirs, files in os.walk(os.path.join(ROOT, "src"))
                    if "__pycache__" not in d for f in files)
    assert "src/chv_guest/cell/policy.py" in source and "src/chv-cell" in source
    assert sorted(n for n in names if n.startswith("src/") and tarfile_is_file(tarball, n)) == source


def tarfile_is_file(tarball, name):
    with tarfile.open(tarball) as tar:
        return tar.getmember(name).isfile()


def repo_plugins(kind):
    """The repository's operator plugins of a kind (plugins/<kind>/*), by name."""
    if kind == "module":
        return {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py"))}
    # filters and tests: each documented by a .yml of the same name
    return {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(ROOT, "plugins", kind, "*.yml"))
            if not os.path.basename(p).startswith("_")}


@pytest.mark.parametrize("kind", ["module", "filter", "test"])
def test_ansible_doc_lists_exactly_the_operator_plugins(installed, kind):
    _, env = installed
    listed = json.loads(run([os.path.join(BIN, "ansible-doc"), "-t", kind, "-l", "chv.fleet", "-j"], env=env))
    names = {n.split(".", 2)[2] for n in listed}
    assert names == repo_plugins(kind)
    assert not any("lab" in n for n in names)


def test_ansible_doc_lists_exactly_the_roles(installed):
    _, env = installed
    listed = json.loads(run([os.path.join(BIN, "ansible-doc"), "-t", "role", "-l", "chv.fleet", "-j"], env=env))
    roles = {n.split(".", 2)[2] for n in listed}
    # the operator roles (metrics: opt-in, docs/observability.md), and _common, the internal one they
    # include (documented by its argument specs)
    assert roles == {"cell_runtime", "cell_nat", "broker", "browser", "metrics", "_common"}
    assert os.path.isdir(os.path.join(ROOT, "lab", "roles", "lab"))  # the lab stays in the repository


def test_the_installed_site_playbook_passes_syntax_check(installed):
    _, env = installed
    run([os.path.join(BIN, "ansible-playbook"), "chv.fleet.site", "--syntax-check", "-i", "localhost,"], env=env)
    run([os.path.join(BIN, "ansible-playbook"), "chv.fleet.remove", "--syntax-check", "-i", "localhost,"], env=env)


GUEST_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        dest: "{{ out }}"
        content: "{{ {'errors': {'version': 1, 'workspace_root': 'relative'} | chv.fleet.cell_policy_errors,
                      'resolvers': 'nameserver 192.0.2.53' | chv.fleet.cell_resolvers,
                      'trees': ['cell_runtime', 'broker', 'browser']
                               | map('chv.fleet.guest_tree', '/usr/lib/chv-fleet') | list} | to_json }}"
      delegate_to: localhost
"""


def test_the_installed_roles_find_the_guest_tree_in_the_collection(installed, tmp_path):
    """From the tarball installed, nothing of the checkout: the launcher's validator and
    resolver rule import from the installed src/, and each role's part of src/ is found
    there, every file with its name on the guest."""
    path, env = installed
    play, out = tmp_path / "play.yml", tmp_path / "out.json"
    play.write_text(GUEST_PLAY)
    run([os.path.join(BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "-e", "out=%s" % out,
         "-e", "ansible_python_interpreter=%s" % sys.executable], env=env)
    got = json.loads(out.read_text())
    assert any(e.startswith("chv_cell_workspace_root: 'relative' must be") for e in got["errors"]), got["errors"]
    assert got["resolvers"] == ["192.0.2.53"]
    coll = path / "ansible_collections" / "chv" / "fleet"
    for role, tree in zip(("cell_runtime", "broker", "browser"), got["trees"]):
        assert tree["sources"], role
        for source in tree["sources"]:
            assert source["src"] == str(coll / "src" / source["name"]), source
            assert os.path.isfile(source["src"]), source
        assert tree["dirs"][0] == "/usr/lib/chv-fleet/chv_guest"
    names = {role: {s["name"] for s in tree["sources"]} for role, tree in zip(("cell_runtime", "broker", "browser"),
                                                                           got["trees"])}
    assert "chv_guest/wire/wire.py" in names["broker"] & names["browser"]
    assert not any(n.startswith("chv_guest/browser/") for n in names["broker"])
    assert not any(n.startswith(("chv_guest/broker/", "chv_guest/wire/")) for n in names["cell_runtime"])
    assert set(got["trees"][0]["scripts"]) == {"chv-cell", "chv-cell-agent"}


def test_the_execution_environment_context_holds_the_collection_and_its_controller_needs(tarball, tmp_path):
    shutil.copytree(EE_EXAMPLE, tmp_path / "ee")
    shutil.copy(tarball, tmp_path / "ee" / "chv-fleet.tar.gz")
    context = tmp_path / "context"
    run([os.path.join(BIN, "ansible-builder"), "create", "-f", "execution-environment.yml", "-c", str(context)],
        cwd=str(tmp_path / "ee"))
    build = context / "_build"
    shipped = build / "collections" / "chv-fleet.tar.gz"
    assert shipped.read_bytes() == tarball.read_bytes()
    requirements = yaml.safe_load((build / "requirements.yml").read_text())
    assert requirements["collections"] == [{"name": "/build/collections/chv-fleet.tar.gz", "type": "file"}]
    containerfile = next(p for p in (context / "Containerfile", context / "Dockerfile") if p.exists()).read_text()
    assert "COPY _build/collections/ /build/collections/" in containerfile
    assert "introspect" in containerfile

    # The build installs the collection, then runs _build/scripts/introspect.py
    # on it: the same script here, on the same tarball installed.
    coll = tmp_path / "usr-share-ansible"
    install(shipped, coll)
    found = yaml.safe_load(run([sys.executable, str(build / "scripts" / "introspect.py"), "introspect", "--sanitize",
                                str(coll)]))
    assert any(line.startswith("netaddr") and "chv.fleet" in line for line in found["python"]), found
    assert any(line.startswith("openssh-client [platform:dpkg]") for line in found["system"]), found


def test_the_changelog_lints_and_lists_this_version():
    run([os.path.join(BIN, "antsibull-changelog"), "lint"], cwd=ROOT)
    changes = yaml.safe_load(open(os.path.join(ROOT, "changelogs", "changelog.yaml"), encoding="utf-8"))
    assert VERSION in changes["releases"]
    with open(os.path.join(ROOT, "CHANGELOG.rst"), encoding="utf-8") as fh:
        text = fh.read()
    assert "v%s" % VERSION in text
