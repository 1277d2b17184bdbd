"""A Flash-shaped model for benchmarks: the real V4.1-Flash dimensions and layer roles, every linear
in the format the real 2.9 bpw EXL3 pack stores it in, random weights built on the device.

Formats (docs: the EXL3 pack's per-tensor K, docs/checkpoint.md#exl3-bitrates): EXL3 MUL1 with
  routed experts K = 3 (2 in layers 18-22), shared experts K = 5 (4 in layers 11-29),
  attention (wq_a, wq_b, wkv, wo_a per group slice, wo_b, compressor wkv/wgate, indexer wq_b) K = 5,
  indexer wk K = 8, head K = 6;
native: the embedding, norms, router weight and bias, sinks, mHC tensors, indexer weights_proj
(bf16, or fp32 where the model holds fp32). Engram is off (its work is host-side row reads).

DSpark (`dspark=True`): Flash's draft head at Flash's config (docs/dspark.md#config: 3 stages
`mtp.0..2` = num_nextn_predict_layers, block size 5, noise id 128799, target layers 37, 38, 39,
markov rank 256, top-3 of the stages' experts), holding 16 of the stages' 128 routed experts as the
backbone holds 16 of its 384 (a token's routed work is the same: top-3 of 2304-wide experts).
Formats as the real pack stores `mtp.*`: the exllamav3 converter quantizes every DSpark linear
at `mtp_bits` (docs/exl3.md#bitrate-choice; the 2.9 bpw pack's MTP K is 4,
docs/checkpoint.md#exl3-bitrates), so attention (wq_a, wq_b, wkv, wo_a per group slice, wo_b),
stage 0's `main_proj`, the shared expert and the routed experts are EXL3 MUL1 K = 4 (not the
backbone's 5 / 5 / 3); native as in the backbone: norms, router, sinks, mHC tensors, and the
markov and confidence heads (left unquantized by the converter,
docs/checkpoint.md#exl3-quantized-tensors; held fp32 where the model holds them fp32). The loader
builds these modules from such a pack with the same quant seam as the backbone's (Model.sanitize),
so the modules here are the ones it would build.
With `layers` < 40 the target layers keep their distance from the top: Flash's 37, 38, 39 (the
last three of 40) become layers - 3, layers - 2, layers - 1 (t -> t - 40 + layers).

Random trellises are uniform int16 (every pattern decodes, docs/exl3.md#bit-ring); suh / svh are
random signs scaled by k^-1/2, so W has entries ~ N(0, 1/k) and activations stay O(1) through the
stack. Everything is seeded per tensor name: two builds (or two ranks) hold the same weights.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.exl3 import EXL3Linear
from mlx_dsv41.exl3.experts import EXL3ExpertProjection, EXL3Experts, EXL3GroupedLinear
from mlx_dsv41.model.deepseek_v41 import FP32_STORED, Model, held_dtype
from mlx_dsv41.quant import DenseLinear

HELD_EXPERTS = 16  # a token's routed work is top-6 of 2304-wide experts whatever the count
FLASH_LAYERS = 40
# Flash's config.json DSpark keys (docs/dspark.md#config; config.py's ModelArgs defaults are the
# reference's for a config without them). dspark_n_routed_experts: Flash has 128; held: see dspark_args.
FLASH_DSPARK = dict(
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3,
)
MTP_BITS = 4  # K of every quantized `mtp.*` linear in the 2.9 bpw pack (docs/checkpoint.md#exl3-bitrates)


def dspark_args(layers: int, experts: int = HELD_EXPERTS) -> dict:
    """Flash's DSpark keys for a `layers`-deep model holding `experts` of each stage's routed experts
    (top-k unchanged); target layers counted from the top (t -> t - 40 + layers)."""
    targets = tuple(t - FLASH_LAYERS + layers for t in FLASH_DSPARK["dspark_target_layer_ids"])
    return {
        **FLASH_DSPARK,
        "dspark_target_layer_ids": targets,
        "dspark_n_routed_experts": min(experts, FLASH_DSPARK["dspark_n_routed_experts"]),
    }


def flash_args(layers: int = 40, experts: int = HELD_EXPERTS, dspark: bool = False, **overrides) -> ModelArgs:
    """Flash's config with `experts` routed experts and no Engram; `layers` < 40 keeps Flash's
    roles in miniature (window, ratio-2 owner + reuse, ratio-1 owner/candidates, reindex, reuse).
    dspark: with Flash's DSpark head (module docstring), `experts` of its routed experts held."""
    base = dict(n_routed_experts=experts, engram_layer_ids=(), engram_num_embeddings=())
    stages = FLASH_DSPARK["num_nextn_predict_layers"] if dspark else 1
    if layers != 40:
        if layers < 3:
            raise SystemExit("--layers must be at least 3 (window, ratio-2 and ratio-1 layers)")
        n0 = max(1, layers // 4)
        n2 = max(1, (layers - n0) // 2)
        n1 = layers - n0 - n2
        r2, r1 = n0, n0 + n2
        base.update(
            num_hidden_layers=layers,
            num_nextn_predict_layers=stages,
            compress_ratios=(0,) * n0 + (2,) * n2 + (1,) * n1 + (0,) * stages,
            kv_source_layer_ids=(r2, r1),
            index_source_layer_ids=(r2, r1) + ((r1 + 2,) if n1 > 2 else ()),
            candidate_source_layer_id=r1,
        )
    if dspark:
        base.update(dspark_args(layers, experts))
    args = ModelArgs(**{**base, **overrides})
    args.validate()
    return args


def _key(name: str, seed: int):
    return mx.random.key(seed * 1_000_003 + zlib.crc32(name.encode()))


def random_exl3(name: str, in_features: int, out_features: int, bits: int, seed: int, stack: int = 0):
    """(trellis, suh, svh) of a random EXL3 linear [out, in] (`stack` > 0: that many stacked)."""
    k, n = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    lead = (stack,) if stack else ()
    k1, k2, k3 = mx.random.split(_key(name, seed), 3)
    trellis = mx.random.randint(-(1 << 15), 1 << 15, (*lead, k // 16, n // 16, 16 * bits), dtype=mx.int16, key=k1)
    sign = lambda shape, key: mx.where(mx.random.bernoulli(0.5, shape, key=key), 1.0, -1.0)  # noqa: E731
    suh = (sign((*lead, k), k2) * k**-0.5).astype(mx.float16)
    svh = sign((*lead, n), k3).astype(mx.float16)
    mx.eval(trellis, suh, svh)
    return trellis, suh, svh


def exl3_linear(name: str, in_features: int, out_features: int, bits: int, seed: int) -> EXL3Linear:
    trellis, suh, svh = random_exl3(name, in_features, out_features, bits, seed)
    return EXL3Linear(trellis, suh, svh, "mul1", in_features=in_features, out_features=out_features)


def exl3_experts(
    name: str, args: ModelArgs, bits: int, seed: int, held=None, codebook: str = "mul1", n_experts: int | None = None
) -> EXL3Experts:
    """Experts held[0]..held[1]-1 (default all) of `n_experts` (default the backbone's); expert e's
    tensors come from its own key, so a rank's share equals the same experts of a one-process build."""
    n_experts = args.n_routed_experts if n_experts is None else n_experts
    lo, hi = held or (0, n_experts)
    D, inter = args.hidden_size, args.moe_intermediate_size
    projections = []
    for proj, (d_in, d_out) in (("w1", (D, inter)), ("w3", (D, inter)), ("w2", (inter, D))):
        parts = [random_exl3(f"{name}.{e}.{proj}", d_in, d_out, bits, seed) for e in range(lo, hi)]
        projections.append(
            EXL3ExpertProjection.from_stacked(
                mx.stack([p[0] for p in parts]),
                mx.stack([p[1] for p in parts]),
                mx.stack([p[2] for p in parts]),
                codebook,
                d_in,
                d_out,
            )
        )
    return EXL3Experts(*projections, n_experts, (lo, hi), args.swiglu_limit)


def _bits(name: str, layer: int | None) -> int:
    """K of a tensor class in the 2.9 bpw recipe (docs/checkpoint.md#exl3-bitrates)."""
    if name.startswith("mtp."):
        return MTP_BITS
    if name == "head":
        return 6
    if ".shared_experts." in name:
        return 4 if 11 <= layer <= 29 else 5
    if name.endswith("indexer.wk"):
        return 8
    return 5  # attention, compressor, indexer wq_b


def build(args: ModelArgs, seed: int = 0, held=None) -> Model:
    """The model with every quantizable linear as EXL3 and the rest random native tensors (the
    DSpark stages too when `args` has them: flash_args(dspark=True))."""
    mx.random.seed(seed)
    model = Model(args, held)
    swaps = []
    for name, module in model.named_modules():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if name.endswith((".ffn.gate", "indexer.weights_proj")):
            continue  # native in the pack
        if name.endswith((".markov_head.head", ".confidence_head.proj")):  # native bf16, as sanitize builds them
            swaps.append((name, DenseLinear(module.weight.shape[1], module.weight.shape[0], bias=False)))
            continue
        if isinstance(module, nn.Linear):
            out_f, in_f = module.weight.shape
            swaps.append((name, exl3_linear(name, in_f, out_f, _bits(name, layer), seed)))
        elif name.endswith(".attn.wo_a"):  # one EXL3 linear per group, as exllamav3 stores wo_a
            trellis, suh, svh = random_exl3(
                name, module.in_features, module.out_features, _bits(name, layer), seed, stack=module.groups
            )
            swaps.append(
                (
                    name,
                    EXL3GroupedLinear(
                        EXL3ExpertProjection.from_stacked(
                            trellis, suh, svh, "mul1", module.in_features, module.out_features
                        )
                    ),
                )
            )
        elif name.endswith(".ffn.experts") and layer is None:  # a DSpark stage's: K = mtp_bits
            swaps.append(
                (name, exl3_experts(name, args, MTP_BITS, seed, module.expert_range, n_experts=module.n_experts))
            )
        elif name.endswith(".ffn.experts"):
            bits = 2 if 18 <= layer <= 22 else 3
            swaps.append((name, exl3_experts(name, args, bits, seed, held)))
    model.update_modules(tree_unflatten(swaps))
    native = []
    for k, v in tree_flatten(model.parameters()):
        if v.dtype in (mx.int16,) or ".trellis" in k or k.endswith((".suh", ".svh")):
            continue
        key = _key(k, seed)
        if k.endswith("norm.weight"):
            w = 1.0 + 0.1 * mx.random.normal(v.shape, key=key)
        elif k == "embed.weight":
            w = mx.random.normal(v.shape, key=key)
        elif k.endswith(("_base", "attn_sink", ".gate.bias")):
            w = 0.5 * mx.random.normal(v.shape, key=key)
        elif k.endswith("_scale"):
            w = mx.random.uniform(0.5, 1.5, v.shape, key=key)
        else:  # [out, in] projections: router, indexer weights_proj, mHC fn
            w = mx.random.normal(v.shape, key=key) * v.shape[-1] ** -0.5
        # as stored (docs/numerics.md#dtypes: fp32 what the release stores in fp32), then as held
        native.append((k, held_dtype(k, w.astype(mx.float32 if FP32_STORED.search(k) else mx.bfloat16))))
        if len(native) % 64 == 0:
            mx.eval([a for _, a in native[-64:]])
    model.load_weights(native, strict=False)
    mx.eval(model.parameters())
    return model
