"""One model across the ranks of a group: on real gloo processes, tensor parallelism (world sizes 2
and 4) and expert parallelism give the logits of one device, each rank reads only its slices of
the checkpoint (each exactly once across the group), and each rank's KV cache holds its heads.

Every sharded run goes through one spawned group per world size, which runs every case in turn
(spawning a group costs seconds; a forward of a tiny model, milliseconds). The one-device
reference runs in this process with `Parallel.single()`.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.engine.kv_cache import allocate_kv_buffer, layer_caches
from inference.models.decoder import DecoderModel, ForwardBatch
from inference.models.loader import load_weights
from inference.models.model_config import ModelConfig, read_hf_config
from inference.models.moe import SparseMoE
from tests.inference.distributed_ranks import run_ranks
from tests.inference.quantized_checkpoints import (
    write_fp8_checkpoint,
    write_int4_experts_checkpoint,
)
from tests.inference.tiny_models import build_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# Logits tolerance by case quantization. In float32 an all-reduce sums the ranks' partial
# products in another order than one device's matmul does: the logits (up to ~3.4 here) differ
# by rounding only (measured: 6e-6 at most). In bfloat16 with int4 weights (the very same int4
# weights as on one device: every rank's share of a row-parallel projection is whole groups of
# 32), each all-reduce adds the ranks' bf16-rounded partial sums: measured 0.044 at most.
LOGITS_ATOL = {None: 1e-5, "int4": 0.1}

# (family, world size, expert parallel, quantization: None runs float32, "int4" bfloat16)
CASES = [
    ("llama", 2, 1, None),
    ("qwen3", 2, 1, None),
    ("mixtral", 2, 1, None),
    ("mixtral", 2, 2, None),
    ("qwen2-moe", 2, 1, None),
    ("deepseek-v3", 2, 1, None),
    ("deepseek-v3", 2, 2, None),
    ("qwen2-tied-odd-vocab", 2, 1, None),
    ("qwen2-tied-odd-vocab", 2, 1, "int4"),
    ("qwen2-tied-odd-vocab", 4, 1, None),
    ("deepseek-v3", 4, 4, None),
]


def case_id(case) -> str:
    family, world_size, expert_parallel, quantization = case
    suffix = f"-{quantization}-bf16" if quantization else ""
    return f"{family}-world{world_size}-ep{expert_parallel}{suffix}"


# Weights every rank reads whole: norms, routers and their bias, MLA's latent projections.
REPLICATED = re.compile(
    r".*(norm\.weight|(mlp|block_sparse_moe)\.gate\.weight|e_score_correction_bias"
    r"|shared_expert_gate\.weight|kv_a_proj_with_mqa\.weight|q_a_proj\.weight)$"
)


def build_tied_odd_vocab_qwen2(directory: Path) -> Path:
    """Qwen2 with tied embeddings, q/k/v biases and a vocabulary of 403: a multiple of neither 2
    nor 4, so the last rank's vocabulary share is padded. Its intermediate size (128) and heads
    split into whole int4 groups of 32 across 2 ranks."""
    config = Qwen2Config(
        vocab_size=403,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    families = {case[0] for case in CASES} - {"qwen2-tied-odd-vocab"}
    found = {family: build_tiny_model(root / family, family, seed=0) for family in families}
    found["qwen2-tied-odd-vocab"] = build_tied_odd_vocab_qwen2(root / "qwen2-tied-odd-vocab")
    return found


def steps(vocab_size: int) -> list[list[tuple[list[int], int, list[int]]]]:
    """Two engine steps over three sequences, as (new tokens, tokens cached before, block
    table) per sequence, decodes first: A and B prefill whole and C its first 5 tokens; then A
    and B decode one token each and C prefills its last 3 over its cached 5."""
    rng = random.Random(3)
    a, b, c = ([rng.randrange(vocab_size) for _ in range(n)] for n in (7, 10, 8))
    tables = [[0, 1], [2, 3, 4], [5, 6]]
    first = [(a[:6], 0, tables[0]), (b[:9], 0, tables[1]), (c[:5], 0, tables[2])]
    second = [(a[6:], 6, tables[0]), (b[9:], 9, tables[1]), (c[5:], 5, tables[2])]
    return [first, second]


def run_model(
    directory: Path, parallel: Parallel, quantization: str | None = None
) -> dict[str, object]:
    """Load `directory` as `parallel`'s rank (in float32, or in bfloat16 with int4 weights),
    run the two `steps`, and report the logits of every token, the KV cache, what was read and
    the expert counts."""
    config = ModelConfig.from_hf(read_hf_config(directory))
    dtype = torch.bfloat16 if quantization == "int4" else torch.float32
    model = DecoderModel(config, dtype, 64, parallel)
    checkpoint = load_weights(model, directory)
    model.pack_weights(quantization)
    kv_buffer = allocate_kv_buffer(model.kv_config, dtype, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    caches = layer_caches(kv_buffer)
    logits = []
    for step in steps(config.vocab_size):
        input_ids = [token for tokens, _, _ in step for token in tokens]
        positions = [p for tokens, cached, _ in step for p in range(cached, cached + len(tokens))]
        slots = [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for tokens, cached, table in step
            for p in range(cached, cached + len(tokens))
        ]
        position_ids = torch.tensor(positions)
        cos, sin = model.rotary_tables(position_ids)
        batch = ForwardBatch(
            positions=position_ids,
            rotary_cos=cos,
            rotary_sin=sin,
            slot_mapping=torch.tensor(slots),
            attention=ops.build_paged_attention_batch(
                [table for _, _, table in step],
                [len(tokens) for tokens, _, _ in step],
                [cached + len(tokens) for tokens, cached, _ in step],
                BLOCK_SIZE,
            ),
        )
        hidden = model.forward(torch.tensor(input_ids), batch, caches)
        logits.append(model.compute_logits(hidden))
    return {
        "logits": torch.cat(logits),
        "kv_buffer": kv_buffer,
        "reads": checkpoint.reads,
        "bytes_read": checkpoint.bytes_read,
        "expert_tokens": model.expert_tokens(),
    }


def run_cases(rank: int, world_size: int, cases: list[tuple[Path, int, str | None]]) -> list:
    """On one rank of a group: `run_model` for each (directory, expert parallel, quantization)
    case."""
    return [
        run_model(directory, Parallel(rank, world_size, expert_parallel), quantization)
        for directory, expert_parallel, quantization in cases
    ]


@pytest.fixture(scope="module")
def runs(directories) -> dict[tuple[str, int, int], list[dict]]:
    """Each case's per-rank results, and each family's one-device result (world size 1)."""
    results: dict[tuple, list[dict]] = {}
    for world_size in sorted({case[1] for case in CASES}):
        cases = [case for case in CASES if case[1] == world_size]
        args = [(directories[family], ep, quantization) for family, _, ep, quantization in cases]
        per_rank = run_ranks(run_cases, world_size, args, timeout=300)
        for index, case in enumerate(cases):
            results[case] = [rank_results[index] for rank_results in per_rank]
    for family, _, _, quantization in CASES:
        if (family, 1, 1, quantization) not in results:
            single = run_model(directories[family], Parallel.single(), quantization)
            results[(family, 1, 1, quantization)] = [single]
    return results


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sharded_logits_equal_one_devices(runs, case):
    family, _, _, quantization = case
    [single] = runs[(family, 1, 1, quantization)]
    for rank in runs[case]:
        assert rank["logits"].shape == single["logits"].shape
        atol = LOGITS_ATOL[quantization]
        torch.testing.assert_close(rank["logits"], single["logits"], rtol=0, atol=atol)
        # Top-1 agrees on every row: in bf16 some rows' top two are closer than the tolerance,
        # so this holds for these seeded weights, as the greedy identity does.
        assert torch.equal(rank["logits"].argmax(-1), single["logits"].argmax(-1))
        if single["expert_tokens"] is not None:
            # Routing is replicated: every rank counts every expert's tokens, as one device does.
            assert torch.equal(rank["expert_tokens"], single["expert_tokens"])


def run_cases_on_triton(rank: int, world_size: int, cases: list) -> list:
    """`run_cases` with every op on its Triton kernel (the interpreter, on the CPU)."""
    from kernels.fused_moe import fused_moe_triton

    assert ops.dispatch.select(ops.FUSED_MOE, torch.zeros(1)) is fused_moe_triton
    return run_cases(rank, world_size, cases)


def test_the_triton_kernels_run_the_shards(runs, directories, monkeypatch):
    """Expert parallelism's (token, choice) rows through the fused-MoE kernel, MLA's kernels on
    a rank's heads, a rank's single KV head through paged attention: the logits of one device
    (whose ops ran their PyTorch references)."""
    cases = [("mixtral", 2, 2, None), ("deepseek-v3", 2, 2, None)]
    # Spawned ranks import `kernels` afresh, under this environment.
    monkeypatch.setenv("HEARTH_KERNELS", "triton")
    args = [(directories[family], ep, quantization) for family, _, ep, quantization in cases]
    per_rank = run_ranks(run_cases_on_triton, 2, args, timeout=300)
    for index, (family, *_) in enumerate(cases):
        [single] = runs[(family, 1, 1, None)]
        for rank_results in per_rank:
            logits = rank_results[index]["logits"]
            torch.testing.assert_close(logits, single["logits"], rtol=0, atol=LOGITS_ATOL[None])


@pytest.mark.parametrize("case", [c for c in CASES if c[3] is None], ids=case_id)
def test_each_slice_is_read_once_across_the_ranks(runs, directories, case):
    family, world_size, _, _ = case
    shapes, element_bytes = stored_tensors(directories[family])
    hf_config = read_hf_config(directories[family])
    kv_copies = max(1, world_size // getattr(hf_config, "num_key_value_heads", world_size))
    counts = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    for rank in runs[case]:
        for name, box in rank["reads"]:
            counts[stored_name(name, shapes)][tuple(slice(a, b) for a, b in box)] += 1
    replicated_bytes = 0
    for name, count in counts.items():
        if name == "lm_head.weight" and hf_config.tie_word_embeddings:
            expected = 0
        elif REPLICATED.match(name):
            expected = world_size
            replicated_bytes += count.numel() * element_bytes[name]
        elif re.match(r".*self_attn\.[kv]_proj\.", name):
            expected = kv_copies
        else:
            expected = 1
        assert bool((count == expected).all()), f"{name}: read {count.unique().tolist()} times"
    total = sum(count.numel() * element_bytes[name] for name, count in counts.items())
    if kv_copies == 1:
        # Each rank reads an even share of what is split, plus the replicated weights; the
        # padded vocabulary share is the only unevenness.
        ideal = (total - replicated_bytes) / world_size + replicated_bytes
        for rank in runs[case]:
            assert rank["bytes_read"] == pytest.approx(ideal, rel=0.01)


def stored_tensors(directory: Path) -> tuple[dict[str, list[int]], dict[str, int]]:
    shapes, element_bytes = {}, {}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            view = f.get_slice(name)
            shapes[name] = view.get_shape()
            element_bytes[name] = {"F32": 4, "BF16": 2}[view.get_dtype()]
    return shapes, element_bytes


def stored_name(name: str, shapes: dict) -> str:
    return name if name in shapes else "model." + name


@pytest.mark.parametrize(
    "case",
    [("llama", 2, 1, None), ("qwen2-tied-odd-vocab", 4, 1, None), ("deepseek-v3", 2, 2, None)],
    ids=case_id,
)
def test_each_rank_caches_its_own_kv_heads(runs, case):
    """Rank r's cache holds KV heads [r * Hk / world, ...) of one device's cache (with fewer KV
    heads than ranks, head r * Hk // world); MLA's latent cache is every rank's whole."""
    family, world_size, _, _ = case
    [single] = runs[(family, 1, 1, None)]
    full = single["kv_buffer"]
    for rank, result in enumerate(runs[case]):
        local = result["kv_buffer"]
        if full.shape[1] == 1:  # MLA: [layers, 1, blocks, block, 1, kv_lora_rank + rope]
            assert local.shape == full.shape
            torch.testing.assert_close(local, full, rtol=0, atol=LOGITS_ATOL[None])
            continue
        kv_heads = full.shape[4]
        per_rank = max(1, kv_heads // world_size)
        first = rank * kv_heads // world_size
        assert local.shape == (*full.shape[:4], per_rank, full.shape[5])
        expected = full[:, :, :, :, first : first + per_rank]
        torch.testing.assert_close(local, expected, rtol=0, atol=LOGITS_ATOL[None])


def test_the_rank_config_shapes_the_rank_cache(directories):
    config = ModelConfig.from_hf(read_hf_config(directories["qwen3"]))
    local = config.for_rank(Parallel(1, 2))
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, 24)
    assert local.intermediate_size == config.intermediate_size // 2
    assert local.kv_bytes_per_token(torch.float32) * 2 == config.kv_bytes_per_token(torch.float32)
    assert config.for_rank(Parallel.single()) is config
    deepseek = ModelConfig.from_hf(read_hf_config(directories["deepseek-v3"]))
    for parallel in (Parallel(0, 2), Parallel(1, 2, expert_parallel=2)):
        assert deepseek.for_rank(parallel).kv_cache_shape == deepseek.kv_cache_shape
    assert deepseek.for_rank(Parallel(0, 2)).moe.intermediate_size == 24
    assert deepseek.for_rank(Parallel(0, 2, expert_parallel=2)).moe.intermediate_size == 48
    with pytest.raises(ValueError, match="attention heads 4 does not split across 3 ranks"):
        config.for_rank(Parallel(0, 3))


@pytest.mark.parametrize(
    "source, quantize",
    [("deepseek-v3-qlora", write_fp8_checkpoint), ("deepseek-v3", write_int4_experts_checkpoint)],
    ids=["fp8-blockwise", "int4-experts"],
)
@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_a_quantized_checkpoint_loads_each_ranks_slices(
    tmp_path, source, quantize, expert_parallel
):
    """A rank dequantizes the blocks or groups covering its share, and keeps exactly the slices
    of what one device loads (loading needs no process group)."""
    quantized = quantize(build_tiny_model(tmp_path / "source", source), tmp_path / "quantized")
    config = ModelConfig.from_hf(read_hf_config(quantized))
    whole = DecoderModel(config, torch.float32, 64)
    load_weights(whole, quantized)
    for rank in range(2):
        model = DecoderModel(config, torch.float32, 64, Parallel(rank, 2, expert_parallel))
        load_weights(model, quantized)
        for mine, full, dim in rank_slices(model, whole):
            size = mine.shape[dim]
            assert torch.equal(mine, full.narrow(dim, rank * size, size))


def rank_slices(model: DecoderModel, whole: DecoderModel):
    """(this rank's tensor, one device's, the dimension it is a contiguous share of) for every
    weight a DeepSeek-V3 splits: by heads (the query, kv_b_proj, W_UK, W_UV, o_proj's columns),
    by intermediate size (the dense MLP, the shared expert, the routed experts when experts are
    not spread; gate and up each) or by experts."""
    for mine, full in zip(model.layers, whole.layers, strict=True):
        attention, attention_full = mine.attention, full.attention
        query = "q_proj" if model.config.mla.q_lora_rank is None else "q_b_proj"
        yield getattr(attention, query), getattr(attention_full, query), 0
        yield attention.kv_b_proj, attention_full.kv_b_proj, 0
        yield attention.o_proj, attention_full.o_proj, 1
        yield attention.w_uk, attention_full.w_uk, 0
        yield attention.w_uv_t, attention_full.w_uv_t, 0
        mlp, mlp_full = mine.mlp, full.mlp
        dense = getattr(mlp, "shared", None) or mlp
        dense_full = getattr(mlp_full, "shared", None) or mlp_full
        yield dense.down_proj, dense_full.down_proj, 1
        for mine_half, full_half in zip(
            dense.gate_up_proj.chunk(2), dense_full.gate_up_proj.chunk(2), strict=True
        ):
            yield mine_half, full_half, 0
        if hasattr(mlp, "w13"):
            yield from expert_slices(mlp, mlp_full)


def expert_slices(mlp: SparseMoE, whole: SparseMoE):
    """`rank_slices` of the routed experts: whole experts, or each one's gate, up and down."""
    if mlp.w13.shape[0] < whole.w13.shape[0]:
        yield mlp.w13, whole.w13, 0
        yield mlp.w2, whole.w2, 0
        return
    yield mlp.w2, whole.w2, 2
    for mine_half, full_half in zip(
        mlp.w13.chunk(2, dim=1), whole.w13.chunk(2, dim=1), strict=True
    ):
        yield mine_half, full_half, 1


@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_stacked_experts_load_each_ranks_share(directories, tmp_path, expert_parallel):
    """Experts stored stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I], as transformers
    writes a converted GGUF) are read by expert or by intermediate share like per-expert ones."""
    stacked = write_stacked_mixtral(directories["mixtral"], tmp_path / "stacked")
    config = ModelConfig.from_hf(read_hf_config(stacked))
    whole = DecoderModel(config, torch.float32, 64)
    load_weights(whole, stacked)
    for rank in range(2):
        model = DecoderModel(config, torch.float32, 64, Parallel(rank, 2, expert_parallel))
        checkpoint = load_weights(model, stacked)
        assert any(name.endswith("experts.gate_up_proj") for name, _ in checkpoint.reads)
        for layer, layer_full in zip(model.layers, whole.layers, strict=True):
            for mine, full, dim in expert_slices(layer.mlp, layer_full.mlp):
                size = mine.shape[dim]
                assert torch.equal(mine, full.narrow(dim, rank * size, size))


def write_stacked_mixtral(source: Path, target: Path) -> Path:
    """A copy of a Mixtral directory with each layer's experts stacked into two tensors."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    experts = re.compile(r"(.*block_sparse_moe\.)experts\.(\d+)\.(w[123])\.weight")
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [name for name in tensors if experts.match(name)]:
        prefix, expert, kind = experts.match(name).groups()
        per_layer.setdefault(prefix, {})[(int(expert), kind)] = tensors.pop(name)
    for prefix, weights in per_layer.items():
        count = len(weights) // 3
        gate_up = [torch.cat([weights[(e, "w1")], weights[(e, "w3")]]) for e in range(count)]
        tensors[prefix + "experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[prefix + "experts.down_proj"] = torch.stack(
            [weights[(e, "w2")] for e in range(count)]
        )
    save_file(tensors, str(target / "model.safetensors"))
    return target
