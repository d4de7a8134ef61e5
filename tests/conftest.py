"""Fixtures shared by the control-plane and multi-process tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama with a ChatML tokenizer, for the nodes the tests run."""
    from tests.inference.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-cp"), "llama")


@pytest.fixture
def receiver():
    """A local webhook receiver (tests/webhook_receiver.py), closed after the test."""
    from tests.webhook_receiver import Receiver

    receiver = Receiver()
    yield receiver
    receiver.close()
