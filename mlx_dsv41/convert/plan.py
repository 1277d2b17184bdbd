"""What the converter writes: the model's tensor sites, each stored tensor checked against them,
and one step per output tensor group, all decided from headers before anything is written.

The expected tensors come from the model itself (`Model(args)`, lazily: no weights are made):
every linear, grouped linear and routed-experts module is a *site* with known input and output
dims, every other parameter a tensor with a known shape. Each site's stored format is decided by
the quant seam's own detection (`quant.stored_format`, run on header stand-ins), then checked:

    dense        `P.weight` float [out, in]                              -> as stored
    exl3         `P.trellis/.suh/.svh` (+ `.mul1`/`.mcg`, `.bias`)        -> as stored (exl3.check_linear)
    fp8          `P.weight` F8_E4M3 [out, in] + `P.scale` F8_E8M0 tiles   -> mxfp8, or bf16 (--dtype bf16)
    fp4          `P.weight` I8 [out, in/2] + `P.scale` F8_E8M0 [out, in/32] -> mxfp4, or bf16
    mx           `P.weight` U32 + `P.scales` U8 (already MLX)            -> as stored
    grouped fp8  `wo_a` F8_E4M3 [G·out, in] + scale                       -> bf16
    (docs/numerics.md#dtypes), always

Tensors the text model never reads (`Model.sanitize`'s drop list: vision, `gate.bias_vl`, the
Engram tables) are skipped, and so is the DSpark head (`mtp.*`) when the source has none to convert
(`Source.dspark_ckpt`; it may be another checkpoint, `--dspark-from`); any other tensor the model has
no place for is an error, as is a missing one, so a checkpoint that converts also loads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_dsv41 import exl3, quant
from mlx_dsv41.convert.safetensors_io import DTYPES, SafetensorsCheckpoint, TensorInfo
from mlx_dsv41.convert.source import ConvertError, Source
from mlx_dsv41.loading import FP32_STORED
from mlx_dsv41.model.deepseek_v41 import _DROP as DROPPED  # what Model.sanitize drops: one list
from mlx_dsv41.model.deepseek_v41 import MTP, Model
from mlx_dsv41.quant import official

PASS_CHUNK_BYTES = 16 << 20  # large tensors are copied / converted in row chunks of about this size

# how mx.load presents each safetensors dtype (the quant seam's detection looks at these)
_MX_DTYPE = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "F8_E4M3": mx.uint8,
    "F8_E5M2": mx.uint8,
    "F8_E8M0": mx.uint8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F64": mx.float64,
}
_FLOATS = ("F16", "BF16", "F32")
_EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mul1", "mcg", "bias")


@dataclass(frozen=True)
class Stored:
    """A stored tensor as the seam's checks see it: shape and mx dtype, from the header."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Site:
    """A linear-like module of the model: `kind` is "linear", "grouped" or "experts"."""

    prefix: str
    kind: str
    in_features: int
    out_features: int
    groups: int = 1  # grouped; for experts: the number of experts


@dataclass
class Step:
    """One group of output tensors made from source tensors; `run` yields (output name, bytes)."""

    primary: str  # the source tensor whose shard decides the output shard
    outputs: list[tuple[str, str, tuple[int, ...]]]  # (name, safetensors dtype, shape), in order
    sources: list[str]
    site_class: str | None  # e.g. "attn.wq_a" (None for non-linear parameters)
    fmt: str  # output format: "exl3", "mxfp8", "mxfp4", "bf16", "f16", "f32"
    run: Callable[[SafetensorsCheckpoint], Iterator[tuple[str, np.ndarray]]]
    origin: SafetensorsCheckpoint | None = None  # the checkpoint `run` reads from; None: the source

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(shape) * DTYPES[dtype].itemsize for _, dtype, shape in self.outputs)


def model_sites(args) -> tuple[list[Site], dict[str, tuple[int, ...]]]:
    """The model's linear sites and its other parameters (name -> shape), from `Model(args)`."""
    model = Model(args)
    sites, covered = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out, inp = module.weight.shape
            sites.append(Site(name, "linear", inp, out))
        elif isinstance(module, quant.GroupedLinear):
            sites.append(Site(name, "grouped", module.in_features, module.out_features, module.groups))
        elif name.endswith(".ffn.experts"):
            sites.append(Site(name, "experts", args.hidden_size, args.moe_intermediate_size, module.n_experts))
        else:
            continue
        covered.append(name + ".")
    params = {
        k: tuple(v.shape) for k, v in tree_flatten(model.parameters()) if not any(k.startswith(c) for c in covered)
    }
    return sorted(sites, key=lambda s: s.prefix), params


def site_class(prefix: str) -> str:
    """The per-layer-independent name of a site: "layers.3.ffn.experts.7.w1" -> "ffn.experts.w1",
    "mtp.1.attn.wq_a" -> "mtp.attn.wq_a" (the DSpark stages)."""
    prefix = re.sub(r"^mtp\.\d+\.", "mtp.", re.sub(r"^layers\.\d+\.", "", prefix))
    return re.sub(r"\.(experts|slice)\.\d+", r".\1", prefix)


# ------------------------------------------------------------------------------ step builders


def _read_chunks(ckpt: SafetensorsCheckpoint, name: str) -> Iterator[np.ndarray]:
    info = ckpt.info(name)
    if len(info.shape) < 1 or info.nbytes <= PASS_CHUNK_BYTES or info.row_nbytes == 0:
        yield ckpt.read(name)
        return
    rows = max(1, PASS_CHUNK_BYTES // info.row_nbytes)
    for lo in range(0, info.shape[0], rows):
        yield ckpt.read_rows(name, lo, min(info.shape[0], lo + rows))


def _pass_through(names: list[str], infos: dict[str, TensorInfo], site: str | None, fmt: str) -> Step:
    def run(ckpt):
        for name in names:
            for chunk in _read_chunks(ckpt, name):
                yield name, chunk

    return Step(names[0], [(n, infos[n].dtype, infos[n].shape) for n in names], list(names), site, fmt, run)


def _bf16_bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.bfloat16).view(mx.uint16))


def _official_step(prefix: str, fmt: str, out_features: int, in_features: int, to_bf16: bool, site: str) -> Step:
    """An official FP8 / FP4 linear -> MLX mxfp8 / mxfp4 (exact re-layout) or bf16 (exact decode).

    Both are row-local (an FP8 tile scale covers 32 whole rows), so the weight is converted in
    chunks of whole 32-row tiles of about PASS_CHUNK_BYTES; only the small scales are gathered."""
    w_name, s_name = f"{prefix}.weight", f"{prefix}.scale"
    row_bytes = in_features if fmt == "fp8" else in_features // 2
    chunk = max(official.GROUP, PASS_CHUNK_BYTES // row_bytes // official.GROUP * official.GROUP)

    def pieces(ckpt):
        for lo in range(0, out_features, chunk):
            hi = min(out_features, lo + chunk)
            s_rows = (lo // official.GROUP, -(-hi // official.GROUP)) if fmt == "fp8" else (lo, hi)
            yield mx.array(ckpt.read_rows(w_name, lo, hi)), mx.array(ckpt.read_rows(s_name, *s_rows))

    if to_bf16:
        dequantize = official.dequantize_fp8_block if fmt == "fp8" else official.dequantize_fp4

        def run(ckpt):
            for w, s in pieces(ckpt):
                yield w_name, _bf16_bits(dequantize(w, s, mx.bfloat16, w_name))

        return Step(w_name, [(w_name, "BF16", (out_features, in_features))], [w_name, s_name], site, "bf16", run)
    mode, relayout = ("mxfp8", official.fp8_block_to_mxfp8) if fmt == "fp8" else ("mxfp4", official.fp4_to_mxfp4)
    w_shape, s_shape = official.mx_shapes(out_features, in_features, quant.MX_MODES[mode])

    def run(ckpt):
        scales = []
        for w, s in pieces(ckpt):
            wq, row_scales = relayout(w, s, w_name)
            yield w_name, np.array(wq)
            scales.append(np.array(row_scales))
        yield f"{prefix}.scales", np.concatenate(scales)

    return Step(
        w_name, [(w_name, "U32", w_shape), (f"{prefix}.scales", "U8", s_shape)], [w_name, s_name], site, mode, run
    )


# ------------------------------------------------------------------------------ planning


class _Planner:
    def __init__(self, source: Source, dtype: str | None):
        self.source, self.dtype = source, dtype
        ckpt, dspark = source.ckpt, source.dspark_ckpt
        self.infos = {n: ckpt.info(n) for n in ckpt.weight_map if not DROPPED.search(n) and not MTP.match(n)}
        self.origins: dict[str, SafetensorsCheckpoint] = {}  # tensors read from another checkpoint
        for n in dspark.weight_map if dspark is not None else ():
            if MTP.match(n) and not DROPPED.search(n):
                self.infos[n] = dspark.info(n)
                if dspark is not ckpt:
                    self.origins[n] = dspark
        self.stored = {n: Stored(i.shape, _MX_DTYPE[i.dtype]) for n, i in self.infos.items()}
        self.used: set[str] = set()

    def fail(self, msg: str):
        raise ConvertError(f"{self.source.path}: {msg}")

    def need(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None, what: str) -> TensorInfo:
        info = self.infos.get(name)
        if info is None:
            self.fail(f"missing tensor {name} ({what})")
        if info.dtype not in dtypes:
            self.fail(f"{name}: dtype {info.dtype}, expected {' or '.join(dtypes)} ({what})")
        if shape is not None and info.shape != tuple(shape):
            self.fail(f"{name}: shape {list(info.shape)}, expected {list(shape)} ({what})")
        return info

    def linear(
        self, prefix: str, in_features: int, out_features: int, kind: str = "linear", groups: int = 1
    ) -> tuple[str, Step]:
        """(stored format, step) of one linear; kind "grouped" (wo_a: dense or FP8 -> bf16) or "expert"."""
        try:
            fmt = quant.stored_format(self.stored, prefix)
        except quant.FormatError as e:
            self.fail(str(e))
        site, rows = site_class(prefix), groups * out_features
        if kind == "grouped" and fmt not in ("dense", "fp8"):
            self.fail(
                f"{prefix}: a grouped linear is stored dense, as official FP8 or as "
                f"{prefix}.slice.{{g}} linears, not as {fmt}"
            )
        if fmt == "dense":
            info = self.need(f"{prefix}.weight", _FLOATS, (rows, in_features), "a dense linear [out, in]")
            step = _pass_through([info.name], self.infos, site, info.dtype.lower())
        elif fmt == "exl3":
            step = self.exl3(prefix, in_features, out_features, kind)
        elif fmt in ("fp8", "fp4"):
            shapes = official.fp8_shapes if fmt == "fp8" else official.fp4_shapes
            w_shape, s_shape = shapes(rows, in_features)
            what = "official FP8, 32x32 E8M0 tiles" if fmt == "fp8" else "official FP4, E2M1 pairs + per-32 E8M0"
            self.need(f"{prefix}.weight", ("F8_E4M3",) if fmt == "fp8" else ("I8",), w_shape, what)
            self.need(f"{prefix}.scale", ("F8_E8M0",), s_shape, what)
            if in_features % official.GROUP:
                self.fail(f"{prefix}.weight: {in_features} inputs is not a multiple of {official.GROUP}")
            # docs/checkpoint.md#official-conversion: wo_a (grouped) is dequantized with its scales,
            # never run as FP8
            to_bf16 = kind == "grouped" or self.dtype == "bf16"
            step = _official_step(prefix, fmt, rows, in_features, to_bf16, site)
        else:  # mlx_quantized: already MLX mxfp4 / mxfp8
            weight = self.need(f"{prefix}.weight", ("U32",), None, "an MLX mxfp4 / mxfp8 weight")
            try:
                mode = quant.mx_mode(prefix, self.stored[weight.name], in_features)
            except quant.FormatError as e:
                self.fail(str(e))
            w_shape, s_shape = official.mx_shapes(out_features, in_features, quant.MX_MODES[mode])
            self.need(f"{prefix}.weight", ("U32",), w_shape, f"MLX {mode}")
            self.need(f"{prefix}.scales", ("U8",), s_shape, f"MLX {mode}")
            step = _pass_through([f"{prefix}.weight", f"{prefix}.scales"], self.infos, site, mode)
        self.used.update(step.sources)
        step.origin = self.origins.get(step.primary)
        return fmt, step

    def exl3(self, prefix: str, in_features: int, out_features: int, kind: str) -> Step:
        parts = [f"{prefix}.{p}" for p in _EXL3_PARTS if f"{prefix}.{p}" in self.infos]
        view = {name: self.stored[name] for name in parts}  # what exl3's checks look at
        for legacy, side in (("su", "suh"), ("sv", "svh")):  # packed sign bits: 16 channels per int16
            if f"{prefix}.{legacy}" in view and f"{prefix}.{side}" not in view:
                info = self.need(f"{prefix}.{legacy}", ("I16",), None, "EXL3 packed signs")
                view[f"{prefix}.{side}"] = Stored((16 * info.shape[0],) if info.shape else (), mx.float16)
        for side in ("suh", "svh"):
            if f"{prefix}.{side}" in self.infos:
                self.need(f"{prefix}.{side}", ("F16",), None, "EXL3 sign/scale vector")
        for marker in ("mul1", "mcg"):
            if f"{prefix}.{marker}" in self.infos:
                self.need(f"{prefix}.{marker}", ("I32",), (), "EXL3 codebook marker")
                name = f"{prefix}.{marker}"
                view[name] = self.origins.get(name, self.source.ckpt).read(name)
        if f"{prefix}.bias" in self.infos and kind == "expert":
            self.fail(f"{prefix}.bias: routed experts have no bias")
        self.need(f"{prefix}.trellis", ("I16",), None, "EXL3 trellis")
        try:
            codebook = exl3.codebook_from_markers(view, prefix)
            if f"{prefix}.suh" not in view or f"{prefix}.svh" not in view:
                raise ValueError(f"EXL3 tensor {prefix} needs .suh and .svh")
            exl3.check_linear(
                view[f"{prefix}.trellis"],
                view[f"{prefix}.suh"],
                view[f"{prefix}.svh"],
                codebook,
                view.get(f"{prefix}.bias"),
                in_features,
                out_features,
            )
        except ValueError as e:
            self.fail(f"{prefix}: {e}")
        return _pass_through(
            [f"{prefix}.trellis", *[p for p in parts if not p.endswith(".trellis")]],
            self.infos,
            site_class(prefix),
            "exl3",
        )

    def site(self, site: Site) -> list[Step]:
        if site.kind == "linear":
            return [self.linear(site.prefix, site.in_features, site.out_features)[1]]
        if site.kind == "grouped":
            sliced = any(f"{site.prefix}.slice.0.{p}" in self.infos for p in ("trellis", "weight"))
            if sliced and f"{site.prefix}.weight" not in self.infos:
                return [
                    self.linear(f"{site.prefix}.slice.{g}", site.in_features, site.out_features)[1]
                    for g in range(site.groups)
                ]
            return [self.linear(site.prefix, site.in_features, site.out_features, "grouped", site.groups)[1]]
        dims = {
            "w1": (site.in_features, site.out_features),
            "w3": (site.in_features, site.out_features),
            "w2": (site.out_features, site.in_features),
        }
        steps, families = [], {}
        for e in range(site.groups):
            for proj, (d_in, d_out) in dims.items():
                fmt, step = self.linear(f"{site.prefix}.{e}.{proj}", d_in, d_out, "expert")
                families.setdefault("mx" if fmt in ("fp8", "fp4", "mlx_quantized") else fmt, f"{e}.{proj}")
                steps.append(step)
        if len(families) > 1:
            self.fail(
                f"{site.prefix}: experts stored in different formats ("
                + ", ".join(f"{where} is {fam}" for fam, where in families.items())
                + "); one format per layer's experts"
            )
        return steps

    def parameter(self, name: str, shape: tuple[int, ...]) -> Step:
        fp32 = bool(FP32_STORED.search(name))
        what = "fp32 in the release, docs/numerics.md#dtypes" if fp32 else "a float tensor"
        info = self.need(name, ("F32",) if fp32 else _FLOATS, shape, what)
        self.used.add(name)
        step = _pass_through([name], self.infos, None, info.dtype.lower())
        step.origin = self.origins.get(name)
        return step

    def plan(self) -> list[Step]:
        sites, params = model_sites(self.source.args)
        if self.source.dspark_ckpt is None:  # no draft head to convert: the stages are left out
            sites = [site for site in sites if not MTP.match(site.prefix)]
            params = {name: shape for name, shape in params.items() if not MTP.match(name)}
        steps = [step for site in sites for step in self.site(site)]
        steps += [self.parameter(name, shape) for name, shape in sorted(params.items())]
        unexpected = sorted(set(self.infos) - self.used)
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            self.fail(
                f"unexpected tensor {unexpected[0]}{more}: not part of the DeepSeek-V4.1 text "
                f"model this config describes"
            )
        return steps


def plan_steps(source: Source, dtype: str | None) -> list[Step]:
    """Every output step, in source order (checkpoint, shard, then offset): reads are sequential."""
    steps = _Planner(source, dtype).plan()

    def order(s: Step):
        ckpt = s.origin or source.ckpt
        return s.origin is not None, ckpt.weight_map[s.primary].name, ckpt.info(s.primary).offset

    return sorted(steps, key=order)
