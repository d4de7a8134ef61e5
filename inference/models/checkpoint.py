"""A checkpoint's tensors by name, handed out once each, so that a weight the model never asked
for is reported instead of silently ignored."""

from __future__ import annotations

from pathlib import Path

import torch

from inference.errors import ModelLoadError


class Checkpoint:
    """The tensors of one model directory (names without the `model.` prefix), in the engine's
    dtype; `take` removes what it returns, `unused` lists the rest."""

    def __init__(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        self.tensors = tensors
        self.directory = directory

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        try:
            tensor = self.tensors.pop(name)
        except KeyError:
            raise ModelLoadError(f"weight {name!r} missing from {self.directory}") from None
        return tensor if dtype is None else tensor.to(dtype)

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.pop(name) if name in self.tensors else None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def discard(self, prefix: str) -> list[str]:
        """Drop every tensor under `prefix` (weights the engine knowingly does not run)."""
        names = [name for name in self.tensors if name.startswith(prefix)]
        for name in names:
            del self.tensors[name]
        return names

    def unused(self) -> list[str]:
        return [name for name in self.tensors if "rotary_emb" not in name]
