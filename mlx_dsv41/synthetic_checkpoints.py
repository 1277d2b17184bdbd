"""Tiny checkpoints in the two real source formats, for tests, benchmarks and the demo.

    ck = write_official_checkpoint(dir)            # FP8 + 32x32 E8M0 tiles, FP4 experts, Engram shards
    ck = write_exl3_checkpoint(dir)                # exllamav3 tensors, no Engram tables ...
    write_engram_shards(dir2, ck.args, ck.tables)  # ... which come from official-format shards
    ck.reference_model()                           # the float model the stored tensors decode to
    ck.source_model()                              # built directly from the stored tensors (quant seam)

Official format (docs/checkpoint.md#official): the HF nested config.json with the release's
`quantization_config`; FP8 linears (docs/numerics.md#dtypes's list) as F8_E4M3 [out, in] + F8_E8M0
[ceil(out/32), ceil(in/32)] block scales (power-of-two amax scales, round to nearest); routed
experts as I8 E2M1 pairs (low nibble = lower index) + F8_E8M0 [out, in/32]; bf16 / fp32 elsewhere;
`gate.bias_vl`, MTP, vision and image tensors the text model drops; the Engram tables as F8_E4M3
[rows, hd] + F8_E8M0 [rows, hd/32] in the last two shards (as `model-00047/00048-of-00048`); an
index; one scale in another shard than its weight. The reference weights decode the stored codes
with numpy (the tables of `quant.official`), independently of the MLX code that converts and runs
them.

EXL3 format (docs/exl3.md#storage, docs/checkpoint.md#exl3-pack): `quant_method: exl3`; random valid
trellises (`exl3.synthetic`) at mixed K (routed experts ragged within w2) and all three codebooks,
`wo_a` as `slice.G`, the head quantized, one Engram `wkv` quantized and the other an unquantized
fp16 `.weight`; native norms, router, sinks, mHC, indexer `weights_proj` and Engram `q/k_weight`; no
`gate.bias_vl`, no Engram tables. Every `suh` is rescaled so W has std ~ 1/sqrt(in) (activations
stay O(1)); the reference weights are the dequantized W (float32 -> bf16).

A word-level `tokenizer.json` whose Engram normalization yields exactly
`engram_compressed_vocab_size` keys (uppercase variants collide with their lowercase words).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.convert.safetensors_writer import write_safetensors
from mlx_dsv41.exl3.synthetic import random_experts_tensors, random_linear_tensors
from mlx_dsv41.model.engram_hash import CompressedTokenMap
from mlx_dsv41.quant.official import E2M1_VALUES, GROUP, e4m3_values
from mlx_dsv41.synthetic import engram_table_tensors, hf_config, random_engram_tables, random_weights, tiny_args

OFFICIAL_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
EXL3_QUANTIZATION = {
    "quant_method": "exl3",
    "version": "1.4.2",
    "bits": 3.9,
    "head_bits": 6,
    "calibration": {"rows": 250, "cols": 2048},
    "out_scales": "always",
    "codebook": "mul1",
}

# docs/numerics.md#dtypes: the FP8 linears of the release (wo_a too: the converter dequantizes it)
_FP8_SITES = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "attn.indexer.wq_b",
    "ffn.shared_experts.w1",
    "ffn.shared_experts.w2",
    "ffn.shared_experts.w3",
    "engram.wkv",
    "main_proj",
)  # main_proj: DSpark stage 0 (docs/dspark.md#tensors)
_FP8_MAX, _FP4_MAX = 448.0, 6.0


@dataclass
class TinyCheckpoint:
    path: Path
    args: ModelArgs
    reference: dict[str, mx.array]  # the float weights (official names) the stored tensors decode to
    tables: dict[int, np.ndarray]  # Engram layer -> rows (uint8 [rows, hd + hd/32])

    @property
    def token_map(self) -> CompressedTokenMap:
        from tokenizers import Tokenizer

        return CompressedTokenMap.from_tokenizer(
            Tokenizer.from_file(str(self.path / "tokenizer.json")), self.args.engram_compressed_vocab_size
        )

    def _with_engram(self, model):
        from mlx_dsv41.model.engram import MemoryRowSource

        if self.args.engram_layer_ids:
            model.set_engram(self.token_map, {layer: MemoryRowSource(t) for layer, t in self.tables.items()})
        mx.eval(model.parameters())
        return model

    def reference_model(self):
        """The dense float model (bf16 / fp32 weights) with in-memory Engram tables."""
        from mlx_dsv41.model.deepseek_v41 import Model

        model = Model(self.args)
        model.load_weights(list(model.sanitize(dict(self.reference)).items()), strict=True)
        return self._with_engram(model)

    def source_model(self):
        """The model built directly from the stored (unconverted) tensors, through the quant seam."""
        from mlx_dsv41.loading import load_model

        return self._with_engram(load_model(self.path))


# ------------------------------------------------------------------------------ tokenizer


def write_tokenizer(path: str | Path, args: ModelArgs) -> Path:
    """tokenizer.json + tokenizer_config.json of `args.vocab_size` word tokens: ids 0/1/2 are
    <bos>/<eos>/<pad>, then lowercase words, then uppercase variants that normalize onto earlier
    words, so the Engram map has exactly `engram_compressed_vocab_size` ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    distinct, vocab = args.engram_compressed_vocab_size, args.vocab_size
    if not 3 < distinct <= vocab or vocab - distinct > distinct - 3:
        raise ValueError(f"cannot build a tokenizer of {vocab} tokens with {distinct} Engram keys")
    words = {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    words.update({f"w{i}": i for i in range(3, distinct)})
    words.update({f"W{i - distinct + 3}": i for i in range(distinct, vocab)})  # -> "w3", "w4", ...
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<bos>", "<eos>", "<pad>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "model_max_length": 1 << 20,
            },
            indent=1,
        )
    )
    return path / "tokenizer.json"


# ------------------------------------------------------------------------------ official format


def _nearest_code(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index into the ascending non-negative `grid` nearest to |values| (ties to the lower)."""
    mag = np.abs(values)
    hi = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    return np.where(mag - grid[hi - 1] <= grid[hi] - mag, hi - 1, hi)


def _pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """E8M0 bytes of the power-of-two scales 2^ceil(log2(amax / qmax)) (the release's ue8m0)."""
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / qmax))
    return (exponent + 127).astype(np.uint8)


def _tile_exponents(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float64 exponent of the 32x32 tile scale of every weight [out, in]."""
    return np.repeat(np.repeat(scale.astype(np.float64) - 127, GROUP, 0), GROUP, 1)[: shape[0], : shape[1]]


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (F8_E4M3 codes [out, in], F8_E8M0 scales [ceil(out/32), ceil(in/32)])."""
    out, inp = w.shape
    rows, cols = -(-out // GROUP), -(-inp // GROUP)
    padded = np.zeros((rows * GROUP, cols * GROUP))
    padded[:out, :inp] = np.abs(w)
    scale = _pow2_scale(padded.reshape(rows, GROUP, cols, GROUP).max(axis=(1, 3)), _FP8_MAX)
    grid = e4m3_values()[:0x7F]  # codes 0x00..0x7E: the non-negative finite values, ascending
    scaled = w * np.exp2(-_tile_exponents(scale, w.shape))
    codes = _nearest_code(scaled, grid).astype(np.uint8) | np.where(w < 0, 0x80, 0).astype(np.uint8)
    return codes, scale


def decode_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return e4m3_values()[codes] * np.exp2(_tile_exponents(scale, codes.shape))


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (I8 packed E2M1 [out, in/2], F8_E8M0 scales [out, in/32])."""
    out, inp = w.shape
    scale = _pow2_scale(np.abs(w).reshape(out, inp // GROUP, GROUP).max(axis=2), _FP4_MAX)
    per = np.repeat(scale.astype(np.float64) - 127, GROUP, 1)
    nib = _nearest_code(w * np.exp2(-per), E2M1_VALUES[:8]).astype(np.uint8) | np.where(w < 0, 8, 0).astype(np.uint8)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8).view(np.int8), scale


def decode_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    b = packed.view(np.uint8)
    nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
    return E2M1_VALUES[nib] * np.exp2(np.repeat(scale.astype(np.float64) - 127, GROUP, 1))


def _raw(a: mx.array) -> tuple[str, np.ndarray]:
    """(safetensors dtype, raw numpy) of an MLX array."""
    if a.dtype == mx.bfloat16:
        return "BF16", np.array(a.view(mx.uint16))
    return {mx.float32: "F32", mx.float16: "F16"}[a.dtype], np.array(a)


def _bf16(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32)).astype(mx.bfloat16)


def official_format(name: str) -> str | None:
    """How the release stores a text-model tensor (given in official names): "fp8", "fp4" or None
    (bf16 / fp32 as is)."""
    prefix = name.removesuffix(".weight")
    site = prefix.split(".", 2)[-1] if prefix.startswith(("layers.", "mtp.")) else prefix
    if name.endswith(".weight") and ".ffn.experts." in name:
        return "fp4"
    return "fp8" if name.endswith(".weight") and site in _FP8_SITES else None


def official_tensors(args: ModelArgs, seed: int = 0) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, mx.array]]:
    """(stored tensors {name: (dtype, raw)}, reference float weights) of the text model."""
    stored, reference = {}, {}
    for name, w in random_weights(args, seed).items():
        prefix = name.removesuffix(".weight")
        fmt = official_format(name)
        if fmt == "fp8":
            codes, scale = quantize_fp8(np.array(w.astype(mx.float32)).astype(np.float64))
            stored[name], stored[f"{prefix}.scale"] = ("F8_E4M3", codes), ("F8_E8M0", scale)
            reference[name] = _bf16(decode_fp8(codes, scale))
        elif fmt == "fp4":
            packed, scale = quantize_fp4(np.array(w.astype(mx.float32)).astype(np.float64))
            stored[name], stored[f"{prefix}.scale"] = ("I8", packed), ("F8_E8M0", scale)
            reference[name] = _bf16(decode_fp4(packed, scale))
        else:
            stored[name], reference[name] = _raw(w), w
    return stored, reference


def _dropped_extras(args: ModelArgs, seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """Release tensors the text model drops: bias_vl, vision, aligner, image, and an MTP block's
    pieces when the config cannot draft (with a DSpark head, its stages' bias_vl)."""
    rng = np.random.default_rng(seed + 7)
    d, n = args.hidden_size, args.n_routed_experts
    out = {
        f"layers.{i}.ffn.gate.bias_vl": ("F32", rng.standard_normal(n).astype(np.float32))
        for i in range(args.num_hidden_layers)
    }
    stage_experts = args.dspark_stage_args().n_routed_experts
    out.update(
        {
            f"mtp.{s}.ffn.gate.bias_vl": ("F32", rng.standard_normal(stage_experts).astype(np.float32))
            for s in range(args.dspark_stages)
        }
    )
    if not args.dspark_stages:
        packed, scale = quantize_fp4(rng.standard_normal((args.moe_intermediate_size, d)) / np.sqrt(d))
        out.update(
            {
                "mtp.0.attn_norm.weight": _raw(mx.ones((d,), mx.bfloat16)),
                "mtp.0.ffn.experts.0.w1.weight": ("I8", packed),
                "mtp.0.ffn.experts.0.w1.scale": ("F8_E8M0", scale),
            }
        )
    out.update(
        {
            "vision.blocks.0.norm1.weight": _raw(mx.ones((16,), mx.bfloat16)),
            "aligner.w1.weight": _raw(mx.ones((8, 16), mx.bfloat16)),
            "image_newline": _raw(mx.ones((d,), mx.bfloat16)),
        }
    )
    return out


def _write_shards(path: Path, shards: list[dict[str, tuple[str, np.ndarray]]], total: int | None = None) -> None:
    """Shards named as the release names them (the last ones may stand for 47/48 of 48), + index."""
    total = total or len(shards)
    first = total - len(shards) + 1
    weight_map = {}
    for i, tensors in enumerate(shards, first):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        write_safetensors(path / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def write_config(path: Path, args: ModelArgs, quantization: dict) -> None:
    config = hf_config(args)
    config.update(
        {
            "bos_token_id": args.bos_token_id,
            "eos_token_id": args.eos_token_id,
            "pad_token_id": args.pad_token_id,
            "quantization_config": quantization,
        }
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))


def write_engram_shards(path: str | Path, args: ModelArgs, tables: dict[int, np.ndarray]) -> Path:
    """Only the official release's Engram shards (`model-00047/00048-of-00048` style), no index:
    what a user with an EXL3 pack downloads for `--engram-from`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = engram_table_tensors(args, tables)
    for i, tensors in enumerate(raw):
        write_safetensors(path / f"model-{48 - len(raw) + 1 + i:05d}-of-00048.safetensors", tensors)
    return path


def write_official_checkpoint(path: str | Path, args: ModelArgs | None = None, seed: int = 0) -> TinyCheckpoint:
    """The official FP8/FP4 release layout in `path` (see the module docstring)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = tiny_args() if args is None else args
    stored, reference = official_tensors(args, seed)
    stored.update(_dropped_extras(args, seed))
    tables = random_engram_tables(args, seed)
    half = args.num_hidden_layers // 2
    first = {
        k: v
        for k, v in stored.items()
        if k == "embed.weight" or (k.startswith("layers.") and int(k.split(".")[1]) < half)
    }
    draft = {k: v for k, v in stored.items() if k.startswith("mtp.") and args.dspark_stages}
    second = {k: v for k, v in stored.items() if k not in first and k not in draft}
    # A companion in another shard than its weight (the index allows it; the converter must cope).
    moved = f"layers.{half - 1}.attn.wq_b.scale"
    second[moved] = first.pop(moved)
    # The DSpark stages in a shard of their own (what --dspark-from reads, alone).
    _write_shards(path, [first, second, *([draft] if draft else []), *engram_table_tensors(args, tables)])
    write_config(path, args, OFFICIAL_QUANTIZATION)
    write_tokenizer(path, args)
    return TinyCheckpoint(path, args, reference, tables)


# ------------------------------------------------------------------------------ EXL3 format


def _exl3_linear(
    prefix: str, in_features: int, out_features: int, bits, codebook: str, seed: int, tensors: dict
) -> mx.array:
    """Add one EXL3 linear's tensors (suh rescaled to W std ~ 1/sqrt(in)); return W [out, in] bf16."""
    t = random_linear_tensors(in_features, out_features, bits, codebook, seed=seed, prefix=prefix)
    return _rescaled(prefix, in_features, out_features, codebook, t, tensors)


def _rescaled(prefix: str, in_features: int, out_features: int, codebook: str, t: dict, tensors: dict) -> mx.array:
    """Scale `t`'s suh so W has std 1/sqrt(in), add `t` to `tensors`, return W [out, in] bf16."""
    from mlx_dsv41.exl3 import dequantize

    def w_of(suh):
        return np.array(
            dequantize(mx.array(t[f"{prefix}.trellis"]), mx.array(suh), mx.array(t[f"{prefix}.svh"]), codebook)
        )[:in_features, :out_features]

    std = w_of(t[f"{prefix}.suh"]).std()
    t[f"{prefix}.suh"] = (t[f"{prefix}.suh"].astype(np.float64) / (std * np.sqrt(in_features))).astype(np.float16)
    tensors.update(t)
    return _bf16(w_of(t[f"{prefix}.suh"]).T)


def _exl3_dtype(a: np.ndarray) -> str:
    return {np.dtype(np.int16): "I16", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}[a.dtype]


def exl3_tensors(
    args: ModelArgs, seed: int = 0, with_dspark: bool = True
) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, mx.array]]:
    """(stored tensors, reference float weights) of an exllamav3-quantized text model; with_dspark
    False leaves the DSpark head (`mtp.*`) out, as a pack quantized without it."""
    native = {k: v for k, v in random_weights(args, seed).items() if with_dspark or not k.startswith("mtp.")}
    q: dict[str, np.ndarray] = {}
    reference: dict[str, mx.array] = {}
    stored: dict[str, tuple[str, np.ndarray]] = {}
    # K per tensor class, most specific prefix first (the Mia-AiLab 2.9 bpw recipe,
    # docs/checkpoint.md#exl3-bitrates)
    bits = {"attn.indexer.wk": 8, "attn": 5, "ffn.shared_experts": 4, "engram.wkv": 4, "head": 6}
    # docs/checkpoint.md#exl3-pack: never quantized; the DSpark markov and confidence heads neither
    # (docs/checkpoint.md#exl3-quantized-tensors)
    native_linears = (
        "ffn.gate",
        "attn.indexer.weights_proj",
        "markov_head.embed",
        "markov_head.head",
        "confidence_head.proj",
    )
    for k, (name, w) in enumerate(native.items()):
        prefix = name.removesuffix(".weight")
        parts = prefix.split(".")
        layer, site = (int(parts[1]), ".".join(parts[2:])) if parts[0] in ("layers", "mtp") else (-1, prefix)
        if parts[0] == "mtp":
            layer += args.num_hidden_layers
        if ".ffn.experts." in name:
            continue  # below: per expert, ragged K
        if site == "engram.wkv" and layer != args.engram_layer_ids[0]:
            # exllamav3 upstream leaves Engram wkv unquantized: an fp16 [out, in] weight
            stored[name], reference[name] = ("F16", np.array(w.astype(mx.float16))), w.astype(mx.float16)
            continue
        if not name.endswith(".weight") or w.ndim != 2 or name == "embed.weight" or site in native_linears:
            stored[name], reference[name] = _raw(w), w  # norms, embed, router, sinks, mHC, q/k_weight
            continue
        out_f, in_f = w.shape
        kbits = 4 if parts[0] == "mtp" else next((b for key, b in bits.items() if site.startswith(key)), 5)
        codebook = "mcg" if layer == 3 else "3inst" if layer == 5 and site.startswith("ffn.") else "mul1"
        # exllamav3 slices wo_a's rows into o_groups linears
        # (docs/checkpoint.md#exl3-quantized-tensors)
        if site == "attn.wo_a":
            rows = out_f // args.o_groups
            reference[name] = mx.concatenate(
                [
                    _exl3_linear(f"{prefix}.slice.{g}", in_f, rows, kbits, codebook, seed * 10000 + k * 10 + g, q)
                    for g in range(args.o_groups)
                ]
            )
        else:
            reference[name] = _exl3_linear(prefix, in_f, out_f, kbits, codebook, seed * 10000 + k * 10, q)
    _exl3_routed_experts(args, seed, with_dspark, q, reference)
    stored.update({name: (_exl3_dtype(a), a) for name, a in q.items()})
    return stored, reference


def _exl3_routed_experts(
    args: ModelArgs, seed: int, with_dspark: bool, q: dict[str, np.ndarray], reference: dict[str, mx.array]
) -> None:
    """The routed experts' EXL3 tensors into q, their dequantized weights into reference: w2 ragged
    (2 and 3 bits) in the backbone, the stages' at mtp_bits 4 (docs/checkpoint.md#exl3-bitrates)."""
    d, inter = args.hidden_size, args.moe_intermediate_size
    stage_experts = args.dspark_stage_args().n_routed_experts
    blocks = [
        (f"layers.{i}", args.n_routed_experts, {"w1": 3, "w3": 3, "w2": (2, 3)}) for i in range(args.num_hidden_layers)
    ]
    blocks += [
        (f"mtp.{s}", stage_experts, {"w1": 4, "w3": 4, "w2": 4})
        for s in range(args.dspark_stages if with_dspark else 0)
    ]
    for layer, (block, n_experts, expert_bits) in enumerate(blocks):
        prefix = f"{block}.ffn.experts"
        codebook = "3inst" if layer == 5 else "mul1"
        t = random_experts_tensors(
            n_experts, d, inter, bits=expert_bits, codebook=codebook, seed=seed * 100 + layer, prefix=prefix
        )
        for e in range(n_experts):
            for proj, (d_in, d_out) in {"w1": (d, inter), "w3": (d, inter), "w2": (inter, d)}.items():
                p = f"{prefix}.{e}.{proj}"
                part = {key: v for key, v in t.items() if key.startswith(p + ".")}
                reference[f"{p}.weight"] = _rescaled(p, d_in, d_out, codebook, part, q)


def write_exl3_checkpoint(
    path: str | Path, args: ModelArgs | None = None, seed: int = 0, with_dspark: bool = True
) -> TinyCheckpoint:
    """An exllamav3-style checkpoint in `path` (no Engram tables: write them with
    `write_engram_shards(dir, ck.args, ck.tables)` for --engram-from; with_dspark False: no `mtp.*`
    either, for --dspark-from)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = tiny_args() if args is None else args
    stored, reference = exl3_tensors(args, seed, with_dspark)
    names = sorted(stored)
    half = len(names) // 2
    _write_shards(path, [{n: stored[n] for n in names[:half]}, {n: stored[n] for n in names[half:]}])
    write_config(path, args, EXL3_QUANTIZATION)
    write_tokenizer(path, args)
    return TinyCheckpoint(path, args, reference, random_engram_tables(args, seed))
