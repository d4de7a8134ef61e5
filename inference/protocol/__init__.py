"""The node's wire protocol: what a node and the control plane exchange, and nothing else.

`messages` (generation requests, results, queue names), `keyed_messages` (broker messages held
under a key until answered), `heartbeat` (a node's load and cache digest in Redis),
`delta_publisher` (token deltas and events to a Channels layer). Torch-free and Django-free: the
control plane imports only this package of the node's, so its processes never load the engine.
"""
