"""`manage.py runnode --tensor-parallel N --expert-parallel M [--data-parallel-attention]` runs
the node as a group of N ranks (docs/parallelism.md)."""

from __future__ import annotations

from inference.node.__main__ import parse_args
from tests.controlplane.test_disaggregation import runnode_argv


def test_runnode_passes_the_group_size_on(db, tiny):
    args = parse_args(
        runnode_argv(tiny, tiny.id, "--tensor-parallel", "2", "--expert-parallel", "2")
    )
    assert (args.tensor_parallel, args.expert_parallel) == (2, 2)
    assert not args.data_parallel_attention


def test_runnode_passes_data_parallel_attention_on(db, tiny):
    argv = ("--tensor-parallel", "2", "--expert-parallel", "2", "--data-parallel-attention")
    args = parse_args(runnode_argv(tiny, tiny.id, *argv))
    assert args.data_parallel_attention


def test_runnode_runs_one_rank_unless_told(db, tiny):
    args = parse_args(runnode_argv(tiny, tiny.id))
    assert (args.tensor_parallel, args.expert_parallel) == (1, 1)
