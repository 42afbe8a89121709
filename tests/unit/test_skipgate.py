"""tests/helpers/skipgate.py: under CI=true a skip is a failure unless its
reason is on the reviewed list; outside CI it stays a skip."""

import os
import subprocess
import sys
import textwrap

import pytest

import skipgate

HELPERS = os.path.dirname(os.path.abspath(skipgate.__file__))


@pytest.mark.parametrize("reason", [
    "distribution-independent: runs in the fleet scenario",
    "Skipped: distribution-independent: runs in the trixie scenario",
    "this guest delegates memory, pids and cpu: the limits are enforced, not refused",
    "this host has no AF_VSOCK transport: the guest control cannot bind one",
])
def test_the_reviewed_reasons_are_allowed(reason):
    assert skipgate.allowed(reason)


@pytest.mark.parametrize("reason", [
    "real cells need root",
    "systemd-nspawn, ip and nsenter are needed for real cells",
    "chromium not found",
    "a made-up reason: distribution-independent: runs in the fleet scenario",
])
def test_missing_prerequisites_are_not(reason):
    assert not skipgate.allowed(reason)


def _run(tmp_path, ci):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from skipgate import pytest_runtest_makereport  # noqa: F401
    """ % HELPERS))
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest

        def test_runs():
            pass

        @pytest.mark.skipif(True, reason="real cells need root")
        def test_needs_root():
            pass

        def test_skips_inside():
            pytest.skip("chromium not found")

        @pytest.mark.skipif(True, reason="distribution-independent: runs in the fleet scenario")
        def test_elsewhere():
            pass

        @pytest.mark.xfail(reason="known")
        def test_xfail():
            assert False
    """))
    env = dict(os.environ)
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_an_unlisted_skip_fails_and_names_its_reason(tmp_path):
    r = _run(tmp_path, ci=True)
    assert r.returncode == 1, r.stdout
    assert "real cells need root" in r.stdout and "chromium not found" in r.stdout
    assert "skipgate.py ALLOWED" in r.stdout
    # the listed skip stays a skip, the xfail an xfail, the passing test passes
    assert "1 passed" in r.stdout and "1 skipped" in r.stdout and "1 xfailed" in r.stdout, r.stdout


def test_outside_ci_skips_stay_skips(tmp_path):
    r = _run(tmp_path, ci=False)
    assert r.returncode == 0, r.stdout
    assert "1 passed, 3 skipped, 1 xfailed" in r.stdout, r.stdout
