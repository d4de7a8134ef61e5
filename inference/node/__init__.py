"""The node process: pulls generation requests from the broker while its engine has room,
streams token deltas to the gateway over the channel layer, reports each result with a
`record_completion` message, and heartbeats its load and cache. No Django, no database."""
