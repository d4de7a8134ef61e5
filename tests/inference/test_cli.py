"""`make run` (until the control plane exists): a one-shot chat with the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.smollm2
def test_cli_chat_answers_with_the_default_model():
    out = subprocess.run(
        [sys.executable, "-m", "inference.cli", "chat", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."
    assert "finish_reason=stop" in out.stderr


def test_cli_reports_an_unknown_model_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "inference.cli", "chat", "hi", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode != 0
    assert "not found" in out.stderr
