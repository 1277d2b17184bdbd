"""Model arguments for DeepSeek-V4.1 and the per-layer roles derived from them
(docs/model.md#config)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

FLASH_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)


class ConfigError(ValueError):
    """A config that cannot describe a DeepSeek-V4.1 model; the message says which key is wrong."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does (docs/model.md#layer-roles).

    mode: "window" (ratio 0), "full" (owns compressed KV and index keys, runs the indexer),
    "reindex" (own indexer query over another layer's keys) or "reuse" (another layer's top-k).
    """

    layer: int
    ratio: int
    mode: str
    kv_source: int | None  # layer that owns the compressed KV this layer reads
    index_source: int | None  # layer whose top-k this layer uses (itself for full/reindex)
    builds_candidates: bool  # the candidate source: produces the block mask
    uses_candidates: bool  # reindex layers after the candidate source
    engram: bool

    @property
    def owns_kv(self) -> bool:
        return self.mode == "full"

    @property
    def runs_indexer(self) -> bool:
        return self.mode in ("full", "reindex")


@dataclass
class ModelArgs:
    """Flash defaults; `from_dict` takes the HF nested config.json (text_config merged)."""

    model_type: str = "deepseek_v41"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(
        default_factory=lambda: {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        }
    )
    compress_rope_theta: float = 160000.0
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = FLASH_COMPRESS_RATIOS
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    # DSpark draft head (docs/dspark.md#config). The defaults are the reference's for a config
    # without these keys (no stages, no noise id); the Flash config.json sets 5, 128799, [37, 38,
    # 39], 256, 128 and 3. Expert counts of 0 fall back to the backbone's.
    dspark_block_size: int = 0
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    bos_token_id: int = 0
    eos_token_id: int | list[int] = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    quantization_config: dict | None = None
    # Written by our converter: source checkpoint and per-tensor formats (see mlx_dsv41/convert/).
    mlx_dsv41: dict | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Accept the HF nested layout (text_config + root quantization_config) or a flat one."""
        if not isinstance(params, dict):
            raise ConfigError("config must be a JSON object")
        merged = dict(params)
        text = merged.pop("text_config", None)
        if text is not None:
            if not isinstance(text, dict):
                raise ConfigError("text_config must be a JSON object")
            merged.update(text)
            merged["model_type"] = params.get("model_type", "deepseek_v41")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in merged.items() if k in names}
        for k in (
            "compress_ratios",
            "kv_source_layer_ids",
            "index_source_layer_ids",
            "engram_layer_ids",
            "engram_num_embeddings",
            "dspark_target_layer_ids",
        ):
            if k in kwargs and kwargs[k] is not None:
                if not isinstance(kwargs[k], (list, tuple)):
                    raise ConfigError(f"{k} must be a list, got {kwargs[k]!r}")
                kwargs[k] = tuple(int(v) for v in kwargs[k])
        try:
            args = cls(**kwargs)
        except TypeError as e:
            raise ConfigError(str(e)) from None
        args.validate()
        return args

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        try:
            params = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(params)

    # ---------------------------------------------------------------- derived

    @property
    def engram_ngram_sizes(self) -> tuple[int, ...]:
        return tuple(range(2, self.engram_max_ngram_size + 1))

    @property
    def engram_columns(self) -> int:
        """Row ids per position per Engram layer (24 for Flash)."""
        return len(self.engram_ngram_sizes) * self.engram_n_heads

    @property
    def engram_row_bytes(self) -> int:
        """Bytes of one stored Engram row: head_dim e4m3 values then head_dim/32 e8m0 scales."""
        return self.engram_head_dim + self.engram_head_dim // 32

    def engram_index(self, layer: int) -> int:
        """Position of an Engram layer in engram_layer_ids (its table, hash columns, multipliers)."""
        return self.engram_layer_ids.index(layer)

    @property
    def roles(self) -> tuple[LayerRole, ...]:
        return _derive_roles(self)

    def role(self, layer: int) -> LayerRole:
        """The role of a backbone layer, or of a DSpark stage (layers num_hidden_layers ..
        len(compress_ratios) - 1), which is window-only (docs/model.md#layer-roles)."""
        if 0 <= layer < self.num_hidden_layers:
            return self.roles[layer]
        if self.num_hidden_layers <= layer < len(self.compress_ratios):
            return LayerRole(layer, 0, "window", None, None, False, False, False)
        raise ValueError(f"layer {layer} is not in 0..{len(self.compress_ratios) - 1}")

    @property
    def dspark_unavailable(self) -> str | None:
        """Why this config cannot draft with DSpark, or None when it can (docs/dspark.md#config: the
        reference would draft with token 0 when the noise id is missing; we refuse instead)."""
        if self.dspark_block_size <= 0 or self.num_nextn_predict_layers <= 0:
            return "the config has no DSpark head (dspark_block_size / num_nextn_predict_layers)"
        if self.dspark_noise_token_id is None:
            return "the config has no dspark_noise_token_id"
        if not self.dspark_target_layer_ids:
            return "the config has no dspark_target_layer_ids"
        return None

    @property
    def dspark_stages(self) -> int:
        """Number of DSpark stages the model builds (0 when it cannot draft)."""
        return 0 if self.dspark_unavailable else self.num_nextn_predict_layers

    def dspark_stage_args(self) -> ModelArgs:
        """The args a stage's modules are built from: the backbone's, with the stage's own expert
        count and top-k (docs/dspark.md#stage-moe; 0 falls back to the backbone's)."""
        return dataclasses.replace(
            self,
            n_routed_experts=self.dspark_n_routed_experts or self.n_routed_experts,
            num_experts_per_tok=self.dspark_num_experts_per_tok or self.num_experts_per_tok,
        )

    # ---------------------------------------------------------------- checks

    def validate(self) -> None:
        """Every field checked in turn (a ConfigError, one line, for the first bad one), then the
        layer roles they make (_derive_roles) and the DSpark head's."""
        self._validate_sizes()
        self._validate_supported()
        self._validate_dims()
        self._validate_compress_ratios()
        self._validate_engram()
        _derive_roles(self)  # raises ConfigError on inconsistent source ids
        self._validate_dspark()

    def _validate_sizes(self) -> None:
        _need(self.num_hidden_layers > 0, "num_hidden_layers must be positive")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "q_lora_rank",
            "o_lora_rank",
            "moe_intermediate_size",
            "n_routed_experts",
            "hc_mult",
            "hc_sinkhorn_iters",
            "sliding_window",
            "index_n_heads",
            "index_topk",
            "candidate_block_size",
            "candidate_topk_blocks",
        ):
            _need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")

    def _validate_supported(self) -> None:
        """The release's choices, the only ones the model implements."""
        _need(self.topk_method == "noaux_tc", f"topk_method {self.topk_method!r} is not supported (only 'noaux_tc')")
        # The reference always renormalises sqrtsoftplus routing weights (docs/model.md#moe).
        _need(self.norm_topk_prob is True, "norm_topk_prob must be true for sqrtsoftplus routing")
        _need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        _need(self.gate_temp > 0, f"gate_temp must be positive, got {self.gate_temp}")
        _need(not self.tie_word_embeddings, "tie_word_embeddings must be false (embed and head are separate)")
        _need(
            self.num_key_value_heads == 1,
            f"num_key_value_heads must be 1 (one shared K=V latent), got {self.num_key_value_heads}",
        )
        _need(self.n_shared_experts == 1, f"n_shared_experts must be 1, got {self.n_shared_experts}")
        _need(
            self.scoring_func == "sqrtsoftplus",
            f"scoring_func {self.scoring_func!r} is not supported (only 'sqrtsoftplus')",
        )

    def _validate_dims(self) -> None:
        _need(
            0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and <= head_dim {self.head_dim}",
        )
        _need(
            self.num_attention_heads % self.o_groups == 0,
            f"num_attention_heads {self.num_attention_heads} is not a multiple of o_groups {self.o_groups}",
        )
        _need(
            0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok must be in 1..n_routed_experts"
        )
        _need(self.head_dim % 32 == 0, f"head_dim {self.head_dim} must be a multiple of 32 (fake-quant blocks)")
        _need(
            self.index_head_dim % 32 == 0 and self.index_head_dim >= self.qk_rope_head_dim,
            f"index_head_dim {self.index_head_dim} must be a multiple of 32 and >= qk_rope_head_dim",
        )

    def _validate_compress_ratios(self) -> None:
        expected = self.num_hidden_layers + self.num_nextn_predict_layers
        _need(
            len(self.compress_ratios) == expected,
            f"compress_ratios has {len(self.compress_ratios)} entries; expected num_hidden_layers + "
            f"num_nextn_predict_layers = {self.num_hidden_layers} + {self.num_nextn_predict_layers} = {expected}",
        )
        _need(
            all(r in (0, 1, 2) for r in self.compress_ratios),
            f"compress_ratios may only hold 0, 1 or 2, got {sorted(set(self.compress_ratios))}",
        )

    def _validate_engram(self) -> None:
        _need(
            len(self.engram_num_embeddings) == len(self.engram_layer_ids),
            f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
            f"{len(self.engram_layer_ids)} engram layers",
        )
        for i in self.engram_layer_ids:
            _need(0 <= i < self.num_hidden_layers, f"engram layer {i} is not a backbone layer")
        _need(
            len(set(self.engram_layer_ids)) == len(self.engram_layer_ids),
            f"engram_layer_ids has duplicates: {list(self.engram_layer_ids)}",
        )
        if self.engram_layer_ids:
            _need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size must be >= 2")
            _need(self.engram_n_heads > 0, f"engram_n_heads must be positive, got {self.engram_n_heads}")
            _need(
                0 < self.engram_compressed_vocab_size <= self.vocab_size,
                f"engram_compressed_vocab_size {self.engram_compressed_vocab_size} must be in "
                f"1..vocab_size ({self.vocab_size})",
            )
            _need(
                0 <= self.engram_pad_token_id < self.vocab_size,
                f"engram_pad_token_id {self.engram_pad_token_id} is not a token id (0..{self.vocab_size - 1})",
            )
            _need(
                self.engram_head_dim % 32 == 0,
                "engram_head_dim must be a multiple of 32 (one e8m0 scale per 32 values)",
            )

    def _validate_dspark(self) -> None:
        """Values that are present must make sense; missing ones only turn drafting off."""
        targets = self.dspark_target_layer_ids
        for i in targets:
            _need(0 <= i < self.num_hidden_layers, f"dspark_target_layer_ids: {i} is not a backbone layer")
            # The capture is the block input after Engram (docs/dspark.md#capture); ours is taken
            # before the block, which runs Engram first: exact only for targets without Engram.
            _need(i not in self.engram_layer_ids, f"dspark_target_layer_ids: {i} is an Engram layer")
        _need(len(set(targets)) == len(targets), f"dspark_target_layer_ids has duplicates: {list(targets)}")
        if self.dspark_noise_token_id is not None:
            _need(
                0 <= self.dspark_noise_token_id < self.vocab_size,
                f"dspark_noise_token_id {self.dspark_noise_token_id} is not a token id",
            )
        _need(self.dspark_markov_rank > 0, f"dspark_markov_rank must be positive, got {self.dspark_markov_rank}")
        _need(self.dspark_n_routed_experts >= 0, "dspark_n_routed_experts must be >= 0")
        stage = self.dspark_stage_args()
        _need(
            0 < stage.num_experts_per_tok <= stage.n_routed_experts,
            "dspark_num_experts_per_tok must be in 1..dspark_n_routed_experts",
        )
        if self.dspark_stages:
            stage_ratios = self.compress_ratios[self.num_hidden_layers :]
            _need(
                not any(stage_ratios),
                f"compress_ratios of the DSpark stages must be 0 (docs/dspark.md#config), got {list(stage_ratios)}",
            )


def _check_source_ids(args: ModelArgs) -> None:
    """The KV, index and candidate source ids name backbone layers that can play those parts."""
    n = args.num_hidden_layers
    ratios = args.compress_ratios[:n]
    kv_sources = set(args.kv_source_layer_ids)
    index_sources = set(args.index_source_layer_ids)
    cand = args.candidate_source_layer_id
    for s in sorted(kv_sources):
        if not 0 <= s < n:
            raise ConfigError(f"kv_source_layer_ids: {s} is not a backbone layer (0..{n - 1})")
        if ratios[s] == 0:
            raise ConfigError(f"kv_source_layer_ids: layer {s} has compress ratio 0 and cannot own compressed KV")
    for s in sorted(index_sources):
        if not 0 <= s < n:
            raise ConfigError(f"index_source_layer_ids: {s} is not a backbone layer (0..{n - 1})")
        if ratios[s] == 0:
            raise ConfigError(f"index_source_layer_ids: layer {s} has compress ratio 0 and cannot run an indexer")
    if cand >= 0 and not (cand in kv_sources and cand in index_sources):
        raise ConfigError(
            f"candidate_source_layer_id {cand} is not a KV source that runs an indexer "
            f"(kv sources {sorted(kv_sources)}, index sources {sorted(index_sources)})"
        )


def _derive_roles(args: ModelArgs) -> tuple[LayerRole, ...]:
    """Each backbone layer's role, in layer order: a compressed layer reads the compressed KV of
    the last KV source at or before it (of the same ratio) and selects its top-k entries as
    _selection_mode says."""
    _check_source_ids(args)
    n = args.num_hidden_layers
    ratios = args.compress_ratios[:n]
    kv_sources = set(args.kv_source_layer_ids)
    index_sources = set(args.index_source_layer_ids)
    cand = args.candidate_source_layer_id
    roles: list[LayerRole] = []
    last_kv: int | None = None
    last_index: int | None = None
    for i in range(n):
        r = ratios[i]
        engram = i in args.engram_layer_ids
        if r == 0:
            roles.append(LayerRole(i, 0, "window", None, None, False, False, engram))
            continue
        if i in kv_sources:
            last_kv = i
        if last_kv is None:
            raise ConfigError(f"layer {i} has compress ratio {r} but no KV source at or before it")
        if ratios[last_kv] != r:
            raise ConfigError(
                f"layer {i} has compress ratio {r} but its KV source {last_kv} has ratio {ratios[last_kv]}"
            )
        if i in index_sources:
            last_index = i
        mode = _selection_mode(i, last_kv, last_index, kv_sources, index_sources, roles)
        roles.append(
            LayerRole(
                layer=i,
                ratio=r,
                mode=mode,
                kv_source=last_kv,
                index_source=last_index,
                builds_candidates=(i == cand),
                uses_candidates=(mode == "reindex" and 0 <= cand < i),
                engram=engram,
            )
        )
    return tuple(roles)


def _selection_mode(
    i: int, last_kv: int, last_index: int | None, kv_sources: set[int], index_sources: set[int], roles: list[LayerRole]
) -> str:
    """How compressed layer i selects its top-k entries: "full" (an index source over its own KV),
    "reindex" (an index source over the keys of an earlier KV source, which must index too) or
    "reuse" (the last index source's selection, which must read the same KV)."""
    if i in index_sources:
        mode = "full" if i in kv_sources else "reindex"
        if mode == "reindex" and last_kv not in index_sources:
            raise ConfigError(
                f"layer {i} runs an indexer over the keys of KV source {last_kv}, which has none "
                f"(it is not in index_source_layer_ids)"
            )
        return mode
    if last_index is None or roles[last_index].kv_source != last_kv:
        raise ConfigError(
            f"layer {i} reuses a top-k selection, but no index source at or before it reads its KV source {last_kv}"
        )
    return "reuse"
