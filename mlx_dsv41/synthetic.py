"""Synthetic DeepSeek-V4.1 models, for tests, benchmarks and the `--demo` checkpoint: the tiny
config (every layer role; the one tiny config, others are derived from TINY), random well-scaled
weights in the official checkpoint names and dtypes, Engram tables, and a checkpoint writer.

    args = tiny_args()                                # every layer role, two Engram layers
    args = tiny_args(**TINY_DSPARK)                   # ... and a DSpark head of three stages
    weights = random_weights(args, seed=0)            # official names, bf16 / fp32 as released
    tables = random_engram_tables(args, seed=0)       # {layer: uint8 [rows, row_bytes]}
    write_checkpoint(dir, args, weights, tables)      # config.json + safetensors (+ index)
    model = tiny_model(args)                          # loaded, Engram attached, ready to run

Layer roles of `tiny_args()` (docs/model.md#layer-roles):
    0 window-only   1 window-only + Engram   2 ratio-2 Full (KV/index source) + Engram
    3 ratio-2 Reuse 4 ratio-1 Full + candidate source   5 ratio-1 Reuse
    6 ratio-1 Reindex (uses candidates)      7 ratio-1 Reuse (of 6's top-k)
With window 8, index_topk 4, candidate blocks of 2 keeping 2 blocks, sequences of ~24 tokens have
more compressed entries than index_topk and more candidate blocks than are kept.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.convert.safetensors_writer import write_safetensors
from mlx_dsv41.model.engram_hash import CompressedTokenMap, bucket_primes

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    o_groups=2,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    num_nextn_predict_layers=1,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0),
    kv_source_layer_ids=(2, 4),
    index_source_layer_ids=(2, 4, 6),
    candidate_source_layer_id=4,
    candidate_topk_blocks=2,
    candidate_block_size=2,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=4,
    hc_mult=4,
    engram_layer_ids=(1, 2),
    engram_max_ngram_size=4,
    engram_vocab_size=64,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_pad_token_id=2,
    engram_compressed_vocab_size=120,
    image_token_id=159,
)

# The tiny config with a DSpark head (docs/dspark.md#tensors): three stages of 4 experts top-2, a
# block of 5 drafting from the inputs of the last three layers.
TINY_DSPARK = dict(
    num_nextn_predict_layers=3,
    compress_ratios=TINY["compress_ratios"][:8] + (0, 0, 0),
    dspark_block_size=5,
    dspark_noise_token_id=157,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
)


def tiny_args(**overrides) -> ModelArgs:
    """The tiny config (see the module docstring); `engram_num_embeddings` follows the primes."""
    params = {**TINY, **overrides}
    if "engram_num_embeddings" not in overrides:
        probe = ModelArgs(**{**params, "engram_num_embeddings": (0,) * len(params["engram_layer_ids"])})
        params["engram_num_embeddings"] = tuple(
            int(s) for s in bucket_primes(probe).reshape(len(probe.engram_layer_ids), -1).sum(axis=1)
        )
    args = ModelArgs(**params)
    args.validate()
    return args


def hf_config(args: ModelArgs) -> dict:
    """The HF nested config.json for `args` (text_config + root keys, as released)."""
    text = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name not in ("model_type", "quantization_config", "mlx_dsv41")
    }
    text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
    text["model_type"] = "deepseek_v41_text"
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "text_config": text,
    }
    if args.quantization_config is not None:
        config["quantization_config"] = args.quantization_config
    return config


# ------------------------------------------------------------------------------ weights


def official_shapes(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Name -> (shape, dtype) of every dense tensor the text model reads
    (docs/checkpoint.md#tensor-names, in bf16/fp32 where the release has FP8/FP4; `wo_a` is the
    dequantized bf16 the official converter makes)."""
    D, bf = args.hidden_size, mx.bfloat16
    out = {
        "embed.weight": ((args.vocab_size, D), bf),
        "head.weight": ((args.vocab_size, D), bf),
        "norm.weight": ((D,), bf),
    }
    for role in args.roles:
        out.update({f"layers.{role.layer}.{k}": v for k, v in _block_shapes(args, role).items()})
    stages, rank = args.dspark_stages, args.dspark_markov_rank
    for s in range(stages):  # docs/dspark.md#tensors
        t = _block_shapes(args.dspark_stage_args(), args.role(args.num_hidden_layers + s))
        if s == 0:
            t["main_proj.weight"] = ((D, len(args.dspark_target_layer_ids) * D), bf)
            t["main_norm.weight"] = ((D,), bf)
        if s == stages - 1:
            t["norm.weight"] = ((D,), bf)
            t["markov_head.embed.weight"] = ((args.vocab_size, rank), bf)
            t["markov_head.head.weight"] = ((args.vocab_size, rank), bf)
            t["confidence_head.proj.weight"] = ((1, D + rank), bf)
        out.update({f"mtp.{s}.{k}": v for k, v in t.items()})
    return out


def _block_shapes(args: ModelArgs, role) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """The tensors of one block (a backbone layer or a DSpark stage), named within it."""
    D, H, Dh, hc = args.hidden_size, args.num_attention_heads, args.head_dim, args.hc_mult
    bf, f32 = mx.bfloat16, mx.float32
    mix = (2 + hc) * hc
    t = {
        "attn.attn_sink": ((H,), f32),
        "attn.q_norm.weight": ((args.q_lora_rank,), bf),
        "attn.kv_norm.weight": ((Dh,), bf),
        "attn.wq_a.weight": ((args.q_lora_rank, D), bf),
        "attn.wq_b.weight": ((H * Dh, args.q_lora_rank), bf),
        "attn.wkv.weight": ((Dh, D), bf),
        "attn.wo_a.weight": ((args.o_groups * args.o_lora_rank, H * Dh // args.o_groups), bf),
        "attn.wo_b.weight": ((D, args.o_groups * args.o_lora_rank), bf),
        "attn_norm.weight": ((D,), bf),
        "ffn_norm.weight": ((D,), bf),
        "ffn.gate.weight": ((args.n_routed_experts, D), bf),
        "ffn.gate.bias": ((args.n_routed_experts,), f32),
        "ffn.shared_experts.w1.weight": ((args.moe_intermediate_size, D), bf),
        "ffn.shared_experts.w3.weight": ((args.moe_intermediate_size, D), bf),
        "ffn.shared_experts.w2.weight": ((D, args.moe_intermediate_size), bf),
    }
    for site in ("attn", "ffn"):
        t[f"hc_{site}_fn"] = ((mix, hc * D), f32)
        t[f"hc_{site}_base"] = ((mix,), f32)
        t[f"hc_{site}_scale"] = ((3,), f32)
    for e in range(args.n_routed_experts):
        t[f"ffn.experts.{e}.w1.weight"] = ((args.moe_intermediate_size, D), bf)
        t[f"ffn.experts.{e}.w3.weight"] = ((args.moe_intermediate_size, D), bf)
        t[f"ffn.experts.{e}.w2.weight"] = ((D, args.moe_intermediate_size), bf)
    if role.owns_kv:
        t["attn.compressor.norm.weight"] = ((Dh,), bf)
        t["attn.compressor.wkv.weight"] = ((Dh, D), bf)
        if role.ratio > 1:
            t["attn.compressor.wgate.weight"] = ((Dh, D), bf)
        t["attn.indexer.wk.weight"] = ((args.index_head_dim, Dh), bf)
        t["attn.indexer.k_norm.weight"] = ((args.index_head_dim,), bf)
    if role.runs_indexer:
        t["attn.indexer.wq_b.weight"] = ((args.index_n_heads * args.index_head_dim, args.q_lora_rank), bf)
        t["attn.indexer.weights_proj.weight"] = ((args.index_n_heads, D), bf)
    if role.engram:
        t["engram.wkv.weight"] = (((hc + 1) * D, args.engram_columns * args.engram_head_dim), bf)
        t["engram.q_weight"] = ((hc, D), bf)
        t["engram.k_weight"] = ((hc, D), bf)
    return t


def random_weights(args: ModelArgs, seed: int = 0) -> dict[str, mx.array]:
    """Random non-zero weights with scales that keep activations O(1): linears ~ N(0, 1/in), norm
    weights ~ 1 ± 0.1, mHC projections ~ N(0, 1/(HC·D)), sinks and biases O(1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in official_shapes(args).items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf in ("q_weight", "k_weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "embed.weight":
            w = rng.standard_normal(shape)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            w = rng.uniform(0.5, 1.5, shape)
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            w = 0.5 * rng.standard_normal(shape)
        elif leaf in ("attn_sink", "bias"):
            w = 0.5 * rng.standard_normal(shape)
        else:  # every [out, in] projection, hc_*_fn included
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = mx.array(w.astype(np.float32)).astype(dtype)
    return out


def random_engram_tables(args: ModelArgs, seed: int = 0) -> dict[int, np.ndarray]:
    """{layer: uint8 [rows, row_bytes]}: e4m3 value bytes (no NaN codes), then e8m0 scales chosen
    so values stay O(1) (the layout of docs/model.md#engram-rows and of the row-source protocol)."""
    rng = np.random.default_rng(seed + 1)
    hd = args.engram_head_dim
    tables = {}
    for layer, rows in zip(args.engram_layer_ids, args.engram_num_embeddings):
        values = rng.integers(0, 256, (rows, hd)).astype(np.uint8)
        values[(values & 0x7F) == 0x7F] = 0x38  # 0x7F / 0xFF are NaN in e4m3
        scales = rng.integers(117, 122, (rows, hd // 32)).astype(np.uint8)  # 2^-10 .. 2^-6
        tables[layer] = np.concatenate([values, scales], axis=1)
    return tables


def synthetic_token_map(args: ModelArgs) -> CompressedTokenMap:
    """A compressed-token map of the configured size without a tokenizer: token t -> t mod C
    (first-seen order, as a real map; pad id 2 maps to 2)."""
    C = args.engram_compressed_vocab_size
    return CompressedTokenMap(ids=np.arange(args.vocab_size, dtype=np.int64) % C, size=C)


# ------------------------------------------------------------------------------ checkpoint


def engram_table_tensors(args: ModelArgs, tables: dict[int, np.ndarray]) -> list[dict[str, tuple[str, np.ndarray]]]:
    """The release's Engram tensors, one dict per layer: `layers.L.engram.embed.weight` F8_E4M3
    [rows, hd] and `.scale` F8_E8M0 [rows, hd/32], as {name: (safetensors dtype, raw bytes)}
    (mx.save_safetensors cannot label F8_E4M3 / F8_E8M0)."""
    hd = args.engram_head_dim
    return [
        {
            f"layers.{layer}.engram.embed.weight": ("F8_E4M3", rows[:, :hd]),
            f"layers.{layer}.engram.embed.scale": ("F8_E8M0", rows[:, hd:]),
        }
        for layer, rows in tables.items()
    ]


def write_checkpoint(
    path: str | Path, args: ModelArgs, weights: dict[str, mx.array], engram_tables: dict[int, np.ndarray] | None = None
) -> Path:
    """config.json + model weights in official names; Engram tables, if given, go to their own
    shard (`engram_table_tensors`), with a model.safetensors.index.json mapping every tensor to its
    shard (as released)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    if not engram_tables:
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        return path
    main, tables = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    mx.save_safetensors(str(path / main), weights)
    raw = {k: v for layer in engram_table_tensors(args, engram_tables) for k, v in layer.items()}
    write_safetensors(path / tables, raw)
    index = {"metadata": {}, "weight_map": {**{k: main for k in weights}, **{k: tables for k in raw}}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return path


def tiny_model(args: ModelArgs | None = None, seed: int = 0, weights: dict[str, mx.array] | None = None):
    """A loaded tiny Model with its Engram token map and in-memory row sources attached."""
    from mlx_dsv41.model.deepseek_v41 import Model
    from mlx_dsv41.model.engram import MemoryRowSource

    args = tiny_args() if args is None else args
    model = Model(args)
    weights = random_weights(args, seed) if weights is None else weights
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    if args.engram_layer_ids:
        tables = random_engram_tables(args, seed)
        model.set_engram(synthetic_token_map(args), {k: MemoryRowSource(v) for k, v in tables.items()})
    mx.eval(model.parameters())
    return model
