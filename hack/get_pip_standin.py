"""Stand-in for the get-pip bootstrap script ansible-test downloads.

ansible-test fetches get-pip from a host these machines cannot reach; this
script bootstraps pip with the standard library's ensurepip instead, then
runs ``python -m pip install`` with the remaining arguments (get-pip's own
--no-setuptools/--no-wheel dropped). ensurepip sets PIP_CONFIG_FILE=/dev/null,
which would hide the machine's pip configuration (CA bundle), so it is
removed before the install.
"""
import ensurepip
import os
import subprocess
import sys

ensurepip.bootstrap(upgrade=True)
os.environ.pop("PIP_CONFIG_FILE", None)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
if args:
    sys.exit(subprocess.call([sys.executable, "-m", "pip", "install"] + args))
