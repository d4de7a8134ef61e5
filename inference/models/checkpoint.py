"""A checkpoint's tensors by name, read on demand and handed out once each, so that a weight the
model never asked for is reported instead of silently ignored, and a rank of a group reads only
the rows or columns it keeps.

Only the files' headers are read up front: `take` reads one tensor, or only the `Slices` of it a
rank holds (`safe_open(...).get_slice`), converts it to the engine's dtype, and records what it
read in `reads` and `bytes_read`, so that a test can check that a group reads each slice once.

safetensors maps the files: a page a read touched stays in the process's resident set until its
file is unmapped, and a column share touches most pages of its tensor. So a file is reopened
(remapped) once reads through it spanned `REMAP_AFTER_BYTES`, and `close` unmaps them all: a
rank's resident memory holds its own weights plus a bounded window of the files, not the whole
checkpoint. (Reopening per read would bound it further but costs a parse of the file's header
each time: milliseconds for the many-tensor files of a large MoE checkpoint.)

Quantized weights (block-wise FP8, compressed-tensors pack-quantized) are read with their scales
and dequantized one at a time; a slice of one is read from the quantization blocks or groups that
cover it, dequantized, and trimmed (a share that does not start on a block boundary reads the
block it shares with its neighbour).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inference.distributed.sharding import Slices
from inference.errors import ModelLoadError
from inference.models.quantization import dequantize_checkpoint

# The tensors a pack-quantized `X.weight` is stored as (X.weight + suffix).
_PACKED_PARTS = ("_packed", "_scale", "_shape", "_zero_point")
# 64 MiB: a rank's window of mapped file pages stays small beside its weights (bench/parallel.py),
# and a header parse per 64 MiB read costs well under a second over a 10 GB file.
REMAP_AFTER_BYTES = 64 << 20


class Checkpoint:
    """The tensors of one model directory's *.safetensors files, named as `rename` maps the
    stored names (the `model.` prefix removed), in `dtype`; `take` reads and removes what it
    returns, `unused` lists the rest. A context manager: leaving it unmaps the files."""

    def __init__(
        self,
        directory: Path,
        dtype: torch.dtype,
        quantization: dict | None = None,
        rename: Callable[[str], str] = lambda name: name,
    ) -> None:
        self.directory = directory
        self.dtype = dtype
        self.quantization = quantization
        if quantization is not None:
            # Refuses an unsupported method or scheme before anything is read.
            dequantize_checkpoint({}, quantization, dtype)
        self.reads: list[tuple[str, tuple[tuple[int, int], ...]]] = []
        self.bytes_read = 0
        self._stored: dict[str, tuple[Path, str]] = {}  # name -> (file, name in the file)
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for stored in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    self._stored[rename(stored)] = (file, stored)
        self._pending = self._weight_names()
        self._open: dict[Path, Any] = {}  # file -> its safe_open handle, while mapped
        self._spanned: dict[Path, int] = {}  # file -> bytes its reads spanned since mapped

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the files (a tensor `take` returned keeps only its own pages)."""
        self._open.clear()

    def take(
        self, name: str, dtype: torch.dtype | None = None, part: Slices | None = None
    ) -> torch.Tensor:
        """The tensor `name` (or only its `part`), in `dtype` or the checkpoint's dtype for
        floating-point tensors; reading it removes it from what `unused` reports."""
        if name not in self._pending:
            raise ModelLoadError(f"weight {name!r} missing from {self.directory}")
        self._pending.remove(name)
        parts = self._quantized_parts(name)
        if parts is not None:
            tensor = self._dequantize(name, parts, part)
        else:
            tensor = self._read(name, part)
            if self.quantization is not None:
                # Passes a plain tensor through; refuses an fp8 one that has no scales.
                tensor = dequantize_checkpoint({name: tensor}, self.quantization, self.dtype)[name]
        if tensor.is_floating_point() or dtype is not None:
            tensor = tensor.to(dtype or self.dtype)
        return tensor

    def has(self, name: str) -> bool:
        return name in self._pending

    def discard(self, prefix: str) -> list[str]:
        """Drop every tensor under `prefix` unread (weights the engine knowingly does not run,
        or that another rank of the group holds)."""
        names = sorted(name for name in self._pending if name.startswith(prefix))
        self._pending.difference_update(names)
        return names

    def unused(self) -> list[str]:
        return sorted(name for name in self._pending if "rotary_emb" not in name)

    def _weight_names(self) -> set[str]:
        """Every stored tensor's name, a quantized weight's parts folded into its `X.weight`."""
        names = set()
        for name in self._stored:
            weight = self._quantized_weight_of(name)
            names.add(name if weight is None else weight)
        return names

    def _quantized_weight_of(self, name: str) -> str | None:
        """The quantized weight `X.weight` that stored tensor `name` is a part of, or None."""
        method = (self.quantization or {}).get("quant_method")
        if method == "fp8" and name.endswith("_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            return weight if weight in self._stored else None
        if method == "compressed-tensors":
            for suffix in _PACKED_PARTS:
                weight = name.removesuffix(suffix)
                if name.endswith(suffix) and weight + "_packed" in self._stored:
                    return weight
        return None

    def _quantized_parts(self, name: str) -> list[str] | None:
        """The stored tensors a quantized weight is made of; None for a plain tensor."""
        if self.quantization is None:
            return None
        if self.quantization["quant_method"] == "fp8":
            scale = name + "_scale_inv"
            return [name, scale] if scale in self._stored else None
        parts = [name + suffix for suffix in _PACKED_PARTS if name + suffix in self._stored]
        return parts if name + "_packed" in self._stored else None

    def _read(self, name: str, part: Slices | None) -> torch.Tensor:
        view = self._view(name)
        shape = view.get_shape()
        ranges = [(0, size) for size in shape]
        if part is None:
            return self._read_box(name, view, ranges)
        dim = part.dim % len(shape)
        pieces = []
        for start, stop in part.ranges:
            if not 0 <= start <= stop <= shape[dim]:
                raise ModelLoadError(f"{name}: [{start}, {stop}) is outside dimension {dim}")
            ranges[dim] = (start, stop)
            pieces.append(self._read_box(name, view, ranges))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _view(self, name: str):
        """The stored tensor `name` as safetensors' lazy slice of its mapped file."""
        file, stored = self._stored[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
            self._spanned[file] = 0
        return self._open[file].get_slice(stored)

    def _shape(self, name: str) -> list[int]:
        return self._view(name).get_shape()

    def _read_box(self, name: str, view, ranges: list[tuple[int, int]]) -> torch.Tensor:
        tensor = view[tuple(slice(start, stop) for start, stop in ranges)]
        self.reads.append((name, tuple(ranges)))
        self.bytes_read += tensor.numel() * tensor.element_size()
        file = self._stored[name][0]
        # The slice is a view of the tensor's mapped extent; its pages may all be touched.
        self._spanned[file] += tensor.untyped_storage().nbytes()
        if self._spanned[file] >= REMAP_AFTER_BYTES:
            del self._open[file]  # unmapped once the views of it are gone
        return tensor

    def _dequantize(self, name: str, parts: list[str], part: Slices | None) -> torch.Tensor:
        """Read a quantized weight's parts (covering `part`) and dequantize them."""
        if part is None:
            tensors = {stored: self._read(stored, None) for stored in parts}
            return dequantize_checkpoint(tensors, self.quantization, self.dtype)[name]
        dim = part.dim % 2
        pieces = []
        for start, stop in part.ranges:
            first, tensors = self._covering_parts(name, parts, dim, start, stop)
            whole = dequantize_checkpoint(tensors, self.quantization, self.dtype)[name]
            pieces.append(whole.narrow(dim, start - first, stop - start))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _covering_parts(self, name: str, parts: list[str], dim: int, start: int, stop: int):
        """The parts of quantized weight `name` that cover [start, stop) along `dim`: the
        start of the covered range (extended to whole quantization blocks) and the parts' slices
        that hold it (a pack-quantized weight's `_shape` rewritten to match)."""
        config = self.quantization
        if config["quant_method"] == "fp8":
            size = self._shape(name)[dim]
            block = config["weight_block_size"][dim]
            first, last = _aligned(start, stop, block, size)
            return first, {
                name: self._read(name, Slices.of(dim, (first, last))),
                name + "_scale_inv": self._read(
                    name + "_scale_inv", Slices.of(dim, (first // block, -(-last // block)))
                ),
            }
        scheme = next(iter(config["config_groups"].values()))["weights"]
        per_word, group = 32 // scheme["num_bits"], scheme["group_size"]
        shape = self._read(name + "_shape", None).tolist()
        zero_point = name + "_zero_point" in parts
        if dim == 0:
            # Zero points are packed along the output rows: keep whole words of them.
            first, last = _aligned(start, stop, per_word if zero_point else 1, shape[0])
            slices = {"_packed": (first, last), "_scale": (first, last)}
            slices["_zero_point"] = (first // per_word, -(-last // per_word))
        else:
            first, last = _aligned(start, stop, math.lcm(per_word, group), shape[1])
            slices = {
                "_packed": (first // per_word, -(-last // per_word)),
                "_scale": (first // group, -(-last // group)),
                "_zero_point": (first // group, -(-last // group)),
            }
        tensors = {
            name + suffix: self._read(name + suffix, Slices.of(dim, bounds))
            for suffix, bounds in slices.items()
            if name + suffix in parts
        }
        shape[dim] = last - first
        tensors[name + "_shape"] = torch.tensor(shape)
        return first, tensors


def _aligned(start: int, stop: int, block: int, size: int) -> tuple[int, int]:
    """[start, stop) widened to block boundaries, the last block ending at `size`."""
    return start // block * block, min(-(-stop // block) * block, size)
