"""Disaggregated prefill and decode (docs/disaggregation.md): a prefill node computes a prompt's KV
and writes it into blocks a decode node allocated, with the Mooncake Transfer Engine."""
