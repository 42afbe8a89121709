"""The programs chv.fleet installs on its guests and hosts: the chv-cell
launcher (cell), chv-broker (broker), chv-browser (browser) and the framing
and operation table the two doors share (wire). Standard library only;
docs/architecture.md "Source tree"."""
