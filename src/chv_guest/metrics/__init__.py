"""chv-fleet-metrics: the guest's state as Prometheus metrics, written into
node_exporter's textfile collector directory (docs/observability.md).

``exposition``: the metric families (the one list of every metric the
collector emits) and the text format; ``state``: pure functions from what
was read on the guest to samples; ``collector``: the reading and the atomic
write (the thin I/O), run by chv-fleet-metrics.timer. Standard library only."""
