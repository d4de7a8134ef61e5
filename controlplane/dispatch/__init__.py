"""Dispatch: from a request body to a generation message in the broker, with no HTTP in it.

Preparing a request (validation, tokenization with the model's template, the context check),
admission (rate limits, the budget reservation, the Job row written by group commit), routing
(affinity and prefix-aware), the enqueue, the submission of a batch's lines, and the sweeps that
dispatch again what the broker lost. The completion views, batches and the sweeper call it; it
imports the jobs, billing, events, accounts and catalog layers below it, never a view.
"""
