"""chv_guest/broker/client.py, the in-cell client: what it says about itself (no broker needed)."""
import os
import subprocess
import sys


from testpaths import ROOT

CLIENT = os.path.join(ROOT, "src", "chv_guest", "broker", "client.py")


def test_client_usage_names_the_installed_file(tmp_path):
    """client.py is installed as a file, not as a command: its usage text and errors say so."""
    usage = subprocess.run([sys.executable, "-I", CLIENT], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 2 and usage.stdout == ""
    assert "python3 /usr/lib/chv-fleet/chv_guest/broker/client.py '{\"op\": \"ping\"}'" in usage.stderr
    assert "chv-broker-client" not in usage.stderr
    gone = subprocess.run([sys.executable, "-I", CLIENT, '{"op": "ping"}'], capture_output=True, text=True,
                          timeout=30, check=False, env={"CHV_BROKER_SOCKET": str(tmp_path / "absent.sock")})
    assert gone.returncode == 2 and gone.stderr.startswith("chv_guest/broker/client.py: ")
    with open(CLIENT) as fh:
        assert fh.readline().startswith("#!")  # the role installs a "#!" file executable (mode 0755)
