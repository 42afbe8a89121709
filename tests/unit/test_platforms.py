"""The platforms chv.fleet supports and each role's platform variables.

The one list is the _common role's __common_platforms
(vars/main.yml); its set_vars entry point, the start of every role, checks
the host against it (its `platform` entry point) and then loads
vars/<os_family>.yml, vars/<distribution>.yml and
vars/<distribution>_<major>.yml where they exist. Here: every listed
platform gets every platform variable of every role and has a Molecule
scenario, the roles' Galaxy metadata names the same platforms, a platform
file holds only private names (include_vars outranks the inventory, so a
public knob there could not be overridden) and something real, no Debian
path is written into the roles anywhere else, and the chromium the browser
role drives is one the cell runtime hides from cells. The integration test
tests/integration/playbooks/test_site_platforms.py runs the check itself."""

import glob
import os
import re

import pytest
import yaml
from ansible.module_utils.facts.system.distribution import Distribution

from testpaths import ROOT

ROLES = {"cell_runtime": "__cell_runtime_", "cell_nat": "__cell_nat_", "broker": "__broker_", "browser": "__browser_"}


def load(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def platforms():
    return load("roles", "_common", "vars", "main.yml")["__common_platforms"]


def platform_files(role):
    """The role's platform variable files (every vars/*.yml but main.yml): {name: content}."""
    return dict((os.path.basename(p)[:-4], load(p)) for p in sorted(glob.glob(os.path.join(ROOT, "roles", role, "vars", "*.yml")))
                if os.path.basename(p) != "main.yml")


def loaded(role, distribution, major):
    """What tasks/set_vars.yml loads for a platform: the files of its family, distribution and
    release that exist, in that order, a later one overriding an earlier one (the family by
    Ansible's own map, as the setup module reports it)."""
    files = platform_files(role)
    names = [Distribution.OS_FAMILY.get(distribution, distribution), distribution, "%s_%s" % (distribution, major)]
    out = {}
    for name in dict.fromkeys(names):
        out.update(files.get(name) or {})
    return out


def test_the_list_names_each_platform_once():
    found = platforms()
    assert found and all(set(p) == {"distribution", "major", "release"} for p in found), found
    assert all(isinstance(v, str) and v for p in found for v in p.values()), found
    assert len({(p["distribution"], p["major"]) for p in found}) == len(found)
    assert [(p["distribution"], p["major"]) for p in found] == [("Debian", "12"), ("Debian", "13"),
                                                                ("MacOSX", "14"), ("MacOSX", "15")]


def family(distribution):
    return Distribution.OS_FAMILY.get(distribution, distribution)


# macOS (os_family Darwin, tasks/darwin.yml) needs variables Linux does not
# (dscl, synthetic.conf, launchd labels) and the other way round (nspawn,
# nft): each family's platforms get every variable of that family's files,
# and the names the roles' shared files (vars/main.yml, defaults, templates)
# use, every platform of every family.
@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_supported_platform_gets_every_platform_variable_of_the_role(role):
    files = platform_files(role)
    every = set().union(*(set(f) for f in files.values()))
    assert every, "%s has no platform variables" % role
    families = {}
    for p in platforms():
        families.setdefault(family(p["distribution"]), []).append(p)
    assert sorted(families) == ["Darwin", "Debian"]
    for fam, members in families.items():
        of_family = set().union(*(set(loaded(role, p["distribution"], p["major"])) for p in members))
        for p in members:
            assert set(loaded(role, p["distribution"], p["major"])) == of_family, (role, p)
    shared = shared_names(role, every)
    for p in platforms():
        assert shared <= set(loaded(role, p["distribution"], p["major"])), (role, p, shared)
    # control: a platform no file serves gets none of them
    assert loaded(role, "Rocky", "9") == {}


# The templates both task paths render (tasks/linux.yml and tasks/darwin.yml).
SHARED_TEMPLATES = {
    "cell_runtime": ["cell-policy.json.j2", "chv-cell.sudoers.j2", "chv-fleet-tmpfiles.conf.j2"],
    "cell_nat": [],
    "broker": ["broker.json.j2", "chv-broker.j2"],
    "browser": ["browser.json.j2", "chv-browser.j2", "chv-browser.tmpfiles.j2"],
}


def shared_names(role, names):
    """The platform variables both task paths use: in the templates both
    render and, for the cell_runtime role, in the cell policy it renders
    (a key of one platform only is written "| default(none)" there)."""
    base = os.path.join(ROOT, "roles", role)
    text = ""
    for name in SHARED_TEMPLATES[role]:
        with open(os.path.join(base, "templates", name), encoding="utf-8") as fh:
            text += fh.read()
    if role == "cell_runtime":
        policy = load("roles", role, "vars", "main.yml")["__cell_runtime_policy"]
        text += " ".join(v for v in policy.values() if isinstance(v, str) and "default(none)" not in v)
    return {n for n in names if re.search(r"\b%s\b" % re.escape(n), text)}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_platform_file_holds_private_names_and_something_real(role):
    files = platform_files(role)
    assert files
    for name, content in files.items():
        assert isinstance(content, dict) and content, "vars/%s.yml of %s holds nothing" % (name, role)
        assert [k for k in content if not k.startswith(ROLES[role])] == [], (role, name)
        empty = sorted(k for k, v in content.items() if v in (None, "", [], {}))
        assert empty == (EMPTY_ON_DARWIN.get(role, []) if name == "Darwin" else []), (role, name, empty)


# What macOS has none of: packages the role installs (macOS ships pfctl,
# sandbox-exec, launchctl; python3 and git come with the command line
# tools) and a distribution chromium (chv_browser_executable_path names the
# operator's; nothing of a distribution browser to hide from cells).
EMPTY_ON_DARWIN = {
    "cell_runtime": ["__cell_runtime_inaccessible_platform", "__cell_runtime_packages"],
    "cell_nat": ["__cell_nat_packages"],
    "broker": ["__broker_packages"],
    "browser": ["__browser_chromium", "__browser_packages"],
}


def test_every_platform_has_a_molecule_scenario_that_converges_it():
    """Linux platforms: a Molecule scenario converges them. macOS has none (no
    macOS machine here): its darwin tasks are walked in check mode with a
    Mac's facts instead (tests/integration/playbooks/test_darwin_check_walk.py,
    whose facts name a supported macOS release), and docs/macos.md says that
    nothing has run on real macOS."""
    converged = set()
    for path in glob.glob(os.path.join(ROOT, "molecule", "*", "molecule.yml")):
        for guest in load(path).get("platforms", []):
            if "chv_fleet" in guest.get("groups", []):
                converged.add(guest.get("distro", "bookworm"))
    linux = [p for p in platforms() if family(p["distribution"]) != "Darwin"]
    assert linux and {p["release"] for p in linux} <= converged, converged
    mac = [p for p in platforms() if family(p["distribution"]) == "Darwin"]
    with open(os.path.join(ROOT, "tests", "integration", "playbooks", "test_darwin_check_walk.py"),
              encoding="utf-8") as fh:
        walk = fh.read()
    walked = re.search(r'"distribution": "(\w+)", "distribution_major_version": "(\d+)"', walk).groups()
    assert walked in {(p["distribution"], p["major"]) for p in mac}, walked
    with open(os.path.join(ROOT, "docs", "macos.md"), encoding="utf-8") as fh:
        assert "Nothing of this has run on real macOS yet" in fh.read()


def galaxy_versions(name):
    """The versions Galaxy's platform schema (ansible-lint's meta.json) knows for platform ``name``."""
    import json  # noqa: PLC0415
    import ansiblelint  # noqa: PLC0415
    with open(os.path.join(os.path.dirname(ansiblelint.__file__), "schemas", "meta.json"), encoding="utf-8") as fh:
        schema = json.load(fh)
    model = next(m for m in schema["$defs"].values() if m.get("properties", {}).get("name", {}).get("const") == name)
    return set(model["properties"]["versions"]["items"]["enum"])


# Galaxy names macOS "macOS"; its schema lags behind Apple's releases, so the
# metadata lists the supported ones it knows.
GALAXY_NAMES = {"MacOSX": "macOS"}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_galaxy_metadata_names_the_supported_platforms(role):
    listed = load("roles", role, "meta", "main.yml")["galaxy_info"]["platforms"]
    expected = {}
    for p in platforms():
        name = GALAXY_NAMES.get(p["distribution"], p["distribution"])
        if name in GALAXY_NAMES.values() and p["release"] not in galaxy_versions(name):
            continue
        expected.setdefault(name, []).append(p["release"])
    assert dict((e["name"], e["versions"]) for e in listed) == expected
    assert expected["macOS"] == ["Sonoma"]


# A path under /bin, /sbin, /usr/bin or /usr/sbin (not a venv's "{{ venv }}/bin/..."),
# outside the platform files.
_BIN_PATH = re.compile(r"(?<![\w./}-])/(?:usr/)?s?bin/[\w.+-]+")
# The same everywhere chv.fleet runs: POSIX's shell, and coreutils' rm in
# the units' ExecStartPre; the agent user's login shell is a public knob.
ALLOWED = {"/bin/sh", "/bin/rm", "/bin/bash"}


def role_texts(role):
    """The role's files that render or run something on the host, apart from its platform files:
    defaults, vars/main.yml, tasks, handlers, templates (files/ holds the programs, whose own
    defaults the role overrides by what it renders)."""
    base = os.path.join(ROOT, "roles", role)
    paths = [os.path.join(base, "defaults", "main.yml"), os.path.join(base, "vars", "main.yml")]
    for sub in ("tasks", "handlers", "templates"):
        paths += sorted(glob.glob(os.path.join(base, sub, "*")))
    return paths


def bin_paths(text):
    return sorted(set(_BIN_PATH.findall(text)) - ALLOWED)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_no_distribution_path_outside_the_platform_files(role):
    found = {}
    for path in role_texts(role):
        with open(path, encoding="utf-8") as fh:
            hits = bin_paths(fh.read())
        if hits:
            found[os.path.relpath(path, ROOT)] = hits
    assert found == {}
    # control: the pattern sees the paths the platform files hold, and only paths
    assert bin_paths(str(platform_files(role)))
    assert bin_paths("/usr/local/bin/chv-cell /usr/lib/chromium /usr/bin/python3 -IS") == ["/usr/bin/python3"]


def test_the_chromium_the_browser_drives_is_hidden_from_cells_on_every_platform():
    for p in platforms():
        if family(p["distribution"]) == "Darwin":
            continue  # no distribution chromium there (the operator's, chv_browser_executable_path)
        chromium = loaded("browser", p["distribution"], p["major"])["__browser_chromium"]
        hidden = loaded("cell_runtime", p["distribution"], p["major"])["__cell_runtime_inaccessible_platform"]
        assert chromium in hidden, (p, chromium, hidden)


def test_the_entry_points_get_the_platforms_python_and_debian_the_same_bytes():
    """The entry points (vars/main.yml, installed by tasks/linux.yml and darwin.yml) get
    the platform's python on their "#!" line: on Debian the files stay byte for byte the role's."""
    tasks = load("roles", "cell_runtime", "tasks", "linux.yml")
    task = next(t for t in tasks if t.get("name", "").startswith("Install the chv-cell entry points"))
    assert task["chv.fleet.files"]["files"] == "{{ __cell_runtime_entry_files }}"
    python = loaded("cell_runtime", "Debian", "12")["__cell_runtime_commands"]["python"]
    for entry in load("roles", "cell_runtime", "vars", "main.yml")["__cell_runtime_entry_files"][:2]:
        pattern, replacement = re.search(r"regex_replace\('([^']+)', '([^']+)' ~ __cell_runtime_commands.python\)",
                                         entry["content"]).groups()
        name = os.path.basename(entry["dest"].split("}}")[-1])
        with open(os.path.join(ROOT, "src", name), encoding="utf-8") as fh:
            text = fh.read()
        assert re.sub(pattern, replacement + python, text) == text
        other = re.sub(pattern, replacement + "/opt/py/bin/python3", text)
        assert other.split("\n", 1) == ["#!/opt/py/bin/python3 -IS", text.split("\n", 1)[1]]


# A host lists only its platform's tasks (docs/operations.md, "Output"): each
# role's tasks/converge.yml (which main.yml includes) includes tasks/linux.yml or tasks/darwin.yml by the
# facts, dynamically, so the other platform's file is never loaded for it
# (an import with `when:` would list each of its tasks as skipped). An
# include's own tags do not reach what it includes: every task of a platform
# file carries its phase tag itself (--tags configure selects it), and the
# role's tag from the play (site.yml's `cell_nat`) reaches it through the role
# (tests/integration/playbooks/test_site_rollout.py lists both, with the
# include expanded as ansible-core's strategy loads it).
PHASES = {"install", "configure", "service"}
PLATFORM_INCLUDE = "{{ ansible_facts['system'] | lower }}.yml"


def task_files_naming(role, names):
    """The role's task files (but main.yml and converge.yml) whose text names one of names."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "roles", role, "tasks", "*.yml"))):
        with open(path, encoding="utf-8") as fh:
            if os.path.basename(path) not in ("main.yml", "converge.yml") and any(n in fh.read() for n in names):
                out.append(os.path.basename(path))
    return out


def platform_loads(main):
    """The tasks of a main.yml that load a platform task file."""
    return [t for t in main if {"linux.yml", "darwin.yml"} & {str(v) for v in t.values()} or PLATFORM_INCLUDE in str(t)]


@pytest.mark.parametrize("role", sorted(ROLES) + ["metrics"])
def test_a_role_loads_only_its_platforms_task_file(role):
    main = load("roles", role, "tasks", "converge.yml")
    files = [f for f in ("linux.yml", "darwin.yml") if os.path.exists(os.path.join(ROOT, "roles", role, "tasks", f))]
    naming = platform_loads(main)
    assert len(naming) == 1, naming
    task = naming[0]
    # no other task file of the role loads a platform file
    assert task_files_naming(role, ["import_tasks: linux.yml", "import_tasks: darwin.yml",
                                    "include_tasks: linux.yml", "include_tasks: darwin.yml"]) == []
    if files == ["linux.yml"]:
        # Linux only: every other system is refused first, the file imported whole
        refusal = next(t for t in main if "ansible.builtin.fail" in t)
        assert refusal["when"] == "ansible_facts['system'] != 'Linux'", refusal
        assert main.index(refusal) < main.index(task) and task["ansible.builtin.import_tasks"] == "linux.yml"
        assert "when" not in task
        return
    assert files == ["linux.yml", "darwin.yml"], files
    assert task["ansible.builtin.include_tasks"] == PLATFORM_INCLUDE and "when" not in task, task
    assert set(task["tags"]) == PHASES, task
    for name in files:
        for inner in load("roles", role, "tasks", name):
            tags = set(inner.get("tags", []))
            if not tags:
                # an untagged static import: its tasks carry their own phase tags
                imported = inner.get("ansible.builtin.import_tasks")
                assert imported, (name, inner["name"])
                assert all(set(t.get("tags", [])) & PHASES for t in load("roles", role, "tasks", imported)), imported
            else:
                assert tags & PHASES and tags <= PHASES, (name, inner["name"], tags)


def test_control_the_platform_check_catches_a_static_import():
    """The check above, on a main.yml that imports linux.yml with `when:` (the old way), finds two loads."""
    old = [{"name": "Set up on Linux", "ansible.builtin.import_tasks": "linux.yml",
            "when": "ansible_facts['system'] == 'Linux'"},
           {"name": "Set up on macOS", "tags": sorted(PHASES), "ansible.builtin.include_tasks": "darwin.yml",
            "when": "ansible_facts['system'] == 'Darwin'"}]
    assert len(platform_loads(old)) == 2
