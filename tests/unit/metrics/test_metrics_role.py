"""The metrics role's units and entry point, rendered from its templates
with its defaults and platform variables as Ansible renders them
(trim_blocks, strict undefined): the service runs the collector with
options its parser knows and the role's paths, the timer runs it every
chv_metrics_interval seconds, both pass systemd-analyze verify, and the
entry point imports the collector from the install directory."""

import json
import os
import shlex
import shutil
import subprocess

import jinja2
import pytest
import yaml

from chv_guest.metrics import collector

from testpaths import ROOT

ROLE = os.path.join(ROOT, "roles", "metrics")


def _yaml(*parts):
    with open(os.path.join(ROLE, *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def render(name, **overrides):
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    vars_ = {"ansible_managed": "Managed by chv.fleet.metrics", "__metrics_collection_version": "0.2.0"}
    for key, value in dict(_yaml("defaults", "main.yml"), **overrides).items():
        # the defaults that name another role's variable fall back to their own default
        vars_[key] = env.from_string(value).render() if isinstance(value, str) and "{{" in value else value
    vars_.update(_yaml("vars", "Debian.yml"))
    main = _yaml("vars", "main.yml")
    for key in ("__metrics_unit", "__metrics_timer", "__metrics_unit_dir", "__metrics_file_name", "__metrics_state_dir"):
        vars_[key] = main[key]
    vars_["__metrics_entry_point"] = env.from_string(main["__metrics_entry_point"]).render(**vars_)
    with open(os.path.join(ROLE, "templates", name), encoding="utf-8") as fh:
        return env.from_string(fh.read()).render(**vars_)


def exec_start(unit_text):
    lines = [line for line in unit_text.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1
    return shlex.split(lines[0][len("ExecStart="):])


def test_the_service_runs_the_collector_with_options_its_parser_knows():
    argv = exec_start(render("chv-fleet-metrics.service.j2"))
    assert argv[:3] == ["/usr/bin/python3", "-I", "/usr/lib/chv-fleet/chv-fleet-metrics"]
    opts = collector.parser().parse_args(argv[3:])
    assert opts.textfile_dir == "/var/lib/prometheus/node-exporter"
    assert opts.collection_version == "0.2.0"
    assert opts.policy == "/etc/chv-fleet/cell-policy.json"
    assert opts.ruleset_file == "/etc/chv-fleet/nft/cell-nat.nft" and opts.door_dir == "/etc/chv-fleet/nft/door.d"
    assert opts.audit_report == "/var/lib/chv-fleet/audit/audit.json"
    assert opts.unit == list(collector.DEFAULT_UNITS)  # the role's default list is the collector's
    assert opts.nft == "/usr/sbin/nft"


def test_the_operators_settings_reach_the_service_and_the_timer():
    unit = render("chv-fleet-metrics.service.j2", chv_metrics_textfile_dir="/srv/textfiles",
                  chv_metrics_units=["chv-broker.socket"], chv_metrics_install_dir="/opt/chv")
    opts = collector.parser().parse_args(exec_start(unit)[3:])
    assert opts.textfile_dir == "/srv/textfiles" and opts.unit == ["chv-broker.socket"]
    assert "ReadWritePaths=/srv/textfiles\n" in unit
    assert exec_start(unit)[2] == "/opt/chv/chv-fleet-metrics"
    assert "OnUnitActiveSec=120s\n" in render("chv-fleet-metrics.timer.j2", chv_metrics_interval=120)


def test_the_entry_point_imports_the_collector_from_the_install_directory(tmp_path):
    text = render("chv-fleet-metrics.j2", chv_metrics_install_dir=os.path.join(ROOT, "src"))
    assert text.startswith("#!/usr/bin/python3 -I\n")
    script = tmp_path / "chv-fleet-metrics"
    script.write_text(text)
    proc = subprocess.run(["/usr/bin/python3", "-I", str(script), "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "--textfile-dir" in proc.stdout, proc.stderr


def test_the_units_pass_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # the entry point the service names must exist for verify: render it to a temporary install directory
    (tmp_path / "chv-fleet-metrics").write_text(render("chv-fleet-metrics.j2"))
    (tmp_path / "chv-fleet-metrics").chmod(0o755)
    for name in ("chv-fleet-metrics.service", "chv-fleet-metrics.timer"):
        (tmp_path / name).write_text(render(name + ".j2", chv_metrics_install_dir=str(tmp_path),
                                            chv_metrics_textfile_dir=str(tmp_path)))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "chv-fleet-metrics.service"),
                           str(tmp_path / "chv-fleet-metrics.timer")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chv-fleet-metrics" not in proc.stderr, proc.stderr  # no warning about our units either
    # the check's control: verify names a unit it finds fault with (and still exits 0 for some faults)
    service = tmp_path / "chv-fleet-metrics.service"
    service.write_text(service.read_text().replace("Type=oneshot", "Type=oneshotx"))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(service)], capture_output=True, text=True,
                          check=False)
    assert "chv-fleet-metrics.service" in proc.stderr, proc.stderr


def owned(what, **overrides):
    """__metrics_owned's `what` list (vars/main.yml) as Ansible renders it, with the defaults and `overrides`."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
    main = _yaml("vars", "main.yml")
    vars_ = dict(_yaml("defaults", "main.yml"), chv_metrics_install_dir="/usr/lib/chv-fleet", **overrides)
    for key in ("__metrics_unit", "__metrics_timer", "__metrics_unit_dir", "__metrics_file_name", "__metrics_state_dir"):
        vars_[key] = main[key]
    vars_["__metrics_entry_point"] = env.from_string(main["__metrics_entry_point"]).render(**vars_)
    value = main["__metrics_owned"][what]
    if isinstance(value, list):
        return [env.from_string(item).render(**vars_) for item in value]
    return yaml.safe_load(env.from_string(value).render(**vars_))


def test_the_textfile_directory_is_removed_only_when_the_role_created_it():
    shared = owned("runtime", chv_metrics_textfile_dir="/srv/textfiles")
    assert "/srv/textfiles/chv_fleet.prom" in shared and "/srv/textfiles" not in shared  # node_exporter's stays
    created = owned("runtime", chv_metrics_textfile_dir="/srv/textfiles", chv_metrics_create_textfile_dir=True)
    assert sorted(created) == sorted(shared + ["/srv/textfiles"])
    assert "/var/lib/chv-fleet-metrics" in shared
    assert "/etc/systemd/system/chv-fleet-metrics.timer" in owned("paths")


def test_what_the_collector_rewrites_is_runtime_never_under_a_walked_path():
    """site.yml's fast path walks `paths` with inode and change time: the collector's file and counters,
    rewritten every run, under one of them would send every run the full way (docs/operations.md)."""
    for created in (False, True):
        paths = owned("paths", chv_metrics_textfile_dir="/srv/textfiles", chv_metrics_create_textfile_dir=created)
        for path in owned("runtime", chv_metrics_textfile_dir="/srv/textfiles",
                          chv_metrics_create_textfile_dir=created):
            assert not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths), (path, paths)
