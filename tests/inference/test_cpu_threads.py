"""The engine's thread count on a shared CPU (inference/engine/cpu_threads.py): it gives up the
core another process keeps busy and takes it back when that process stops; a fixed count comes
from the config or HEARTH_CPU_THREADS."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from inference.engine import EngineConfig, LLMEngine
from inference.engine.cpu_threads import CoreShare
from tests.waiting import wait_for

CORES = len(os.sched_getaffinity(0))


def spin() -> None:
    while True:
        pass


@pytest.fixture
def torch_threads():
    """Leave torch's thread count as the test found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="one core: no thread to give up")
def test_a_busy_core_takes_a_thread_and_gives_it_back(torch_threads):
    share = CoreShare(interval_s=0.3)
    assert share.threads == CORES == torch.get_num_threads()
    spinner = multiprocessing.get_context("spawn").Process(target=spin, daemon=True)
    spinner.start()
    try:
        wait_for(lambda: share.update() == CORES - 1, "a thread given up", timeout_s=20)
        assert share.others >= 0.5
        assert torch.get_num_threads() == CORES - 1
    finally:
        spinner.terminate()
        spinner.join()
    wait_for(lambda: share.update() == CORES, "the thread taken back", timeout_s=20)
    assert torch.get_num_threads() == CORES


def test_a_fixed_thread_count_is_kept(tiny_llama_dir, torch_threads):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", cpu_threads=1))
    assert engine.core_share is None and torch.get_num_threads() == 1


def test_the_thread_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HEARTH_CPU_THREADS", "3")
    assert EngineConfig().cpu_threads == 3
    monkeypatch.setenv("HEARTH_CPU_THREADS", "")
    assert EngineConfig().cpu_threads is None
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineConfig(cpu_threads=0)
