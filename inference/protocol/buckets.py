"""Histogram buckets (upper bounds) shared by the node's series and the control plane's, so that
a node's TTFT and the one the worker records at settlement read on the same scale
(docs/observability.md). Each tuple is sorted; Prometheus adds `+Inf`."""

from __future__ import annotations

# Time to the first token: a cached prompt on a GPU answers in milliseconds, a long prompt queued
# behind others in tens of seconds.
TTFT_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time per output token after the first: a step of decode.
TPOT_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A whole request, or the wait before it starts: up to the synchronous timeout (10 minutes).
REQUEST_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
# One engine step.
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Sequences in one step's batch (max_num_seqs is 64 by default).
BATCH_SEQUENCES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tokens one step computes (a chunked prefill's chunk, or one per decoding sequence).
BATCH_TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
