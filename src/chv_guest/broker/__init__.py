"""chv-broker: the peer-authenticated door out of a chv.fleet cell (standard library only)."""
