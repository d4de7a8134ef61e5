"""The node's wire protocol: what a node and the control plane exchange, and how both log and
measure it alike.

`messages` (generation requests, results, queue names), `keyed_messages` (broker messages held
under a key until answered), `heartbeat` (a node's load and cache digest in Redis),
`delta_publisher` (token deltas and events to a Channels layer), `logs` (JSON log lines with the
request's ids) and `buckets` (the metrics' histogram buckets; docs/observability.md). Torch-free
and Django-free: the control plane imports only this package of the node's, so its processes
never load the engine.
"""
