"""chv-cell: run a command in a hardened systemd-nspawn cell (stdlib only)."""

__version__ = "0.1.0"
