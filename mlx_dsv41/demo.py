"""The built-in demo checkpoint: a small DeepSeek-V4.1 in the real formats, built on first use.

`ensure_demo()` returns a converted directory, made once under `$MLX_DSV41_CACHE/demo-v2` (default
`~/.cache/mlx_dsv41/demo-v2`) by the same path a real checkpoint takes:

    exl3/             an exllamav3-layout checkpoint (mlx_dsv41.synthetic_checkpoints.exl3_tensors):
                      EXL3 trellises (`.trellis/.suh/.svh` + codebook marker) for every linear
                      exllamav3 quantizes (attention, `wo_a.slice.G`, compressor, indexer,
                      per-expert `ffn.experts.E.w1/w3/w2` with ragged K in w2, shared experts, one
                      Engram `wkv`, head) at the 2.9 bpw recipe's K per tensor class
                      (docs/checkpoint.md#exl3-bitrates), the DSpark draft head `mtp.0..2` at its K
                      of 4 (linears, `main_proj`, experts), native tensors for the rest (embedding,
                      norms, router, sinks, mHC, indexer `weights_proj`, Engram
                      `q_weight`/`k_weight`, the other Engram `wkv` in fp16, the DSpark markov and
                      confidence heads); config.json with an exl3 quantization_config,
                      quantization_config.json; a byte-level BPE tokenizer with the DeepSeek control
                      tokens
    official-engram/  the two Engram tables as the official release stores them (F8_E4M3 values +
                      F8_E8M0 scales, `layers.L.engram.embed.{weight,scale}`, in shards named like
                      the release's last two)
    model/            `python -m mlx_dsv41.convert exl3 model --engram-from official-engram`

then loaded like any converted checkpoint (lazy weights, Engram rows from SSD, GPU kernels when
there is a GPU). The config covers every layer role (window-only, Engram, ratio-2 and ratio-1
KV sources, candidate source, Reindex, Reuse) with head_dim 512, so the attention kernels run at
their real head size. Everything is seeded: two builds are byte-identical.

THE WEIGHTS ARE SYNTHETIC (random trellises and tensors): the demo shows that the whole path
runs, not what the model knows. Its text is meaningless, and so is its DSpark acceptance rate (a
random draft head rarely guesses a random model's tokens).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from mlx_dsv41 import chat
from mlx_dsv41.synthetic import TINY_DSPARK
from mlx_dsv41.user_cache import CACHE_ENV, cache_root  # noqa: F401 (CACHE_ENV: where tests point the demo)

DEMO_VERSION = 2  # 2: the DSpark draft head

# The demo's model: the tiny config's layer schedule (every role, docs/model.md#layer-roles) and its
# DSpark head of three stages (mlx_dsv41.synthetic: TINY, TINY_DSPARK; the noise id is set by
# demo_args), at the widths below: head_dim 512 as in the release, wider layers and Engram.
DEMO_CONFIG = {
    **{k: v for k, v in TINY_DSPARK.items() if k != "dspark_noise_token_id"},
    "hidden_size": 256,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "moe_intermediate_size": 128,
    "sliding_window": 16,
    "candidate_block_size": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "engram_vocab_size": 512,
    "engram_head_dim": 64,
    "dspark_markov_rank": 32,
}

_BPE_VOCAB = 1016  # BPE part of the vocabulary; the control tokens come after it

PAD = "<｜▁pad▁｜>"
IMAGE = "<｜deepseek_image｜>"
_ADDED = (chat.USER, chat.ASSISTANT, chat.SYSTEM, chat.THINK, chat.END_THINK, chat.DSML, "<｜latest_reminder｜>", IMAGE)

# docs/chat.md#chat-encoding: three isolating splits in sequence, then bytes.
_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    # One pattern, split in two string pieces at a `|` only to fit the line length.
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_CORPUS = """\
The demo model of mlx_dsv41 has synthetic weights. It shows that the whole path runs: an EXL3
checkpoint is converted, its weights are loaded lazily, the two Engram tables are read from the
disk one row at a time, and the sparse attention looks at a sliding window and at a few selected
compressed entries. None of the words it writes were learned; they are drawn from random numbers.
A real checkpoint is converted with the same command and loaded with the same function, and then
the same loop writes text that means something. The tokenizer of the demo is a small byte-level
tokenizer trained on this paragraph and the next ones, with the control tokens of DeepSeek-V4.1
at the end of its vocabulary: begin of sentence, end of sentence, user, assistant, system, think
and end of think, the DSML marker, the reminder and the image token.
Attention in this model has two parts. Every layer keeps the last tokens in a ring, and some
layers compress groups of two tokens, or every token, into one entry; an indexer scores those
entries and picks the best ones for each query. Layers that come later reuse what an earlier
layer picked, so only a few layers pay for the scores. The residual stream is four streams wide
and is mixed by small matrices that are normalised by a Sinkhorn iteration of twenty steps.
Each token is sent to two of eight experts by a router that takes the square root of a softplus.
Engram hashes the last two, three and four tokens into a table with millions of rows in the full
model, reads the rows it needs, and adds a gated value to every stream. Numbers like 1, 22, 333,
4444 and 55555 are split into groups of at most three digits before the merges are learned.
Questions and answers, code and prose: def main(): return 0 # comment; x = [1, 2, 3]; y = {"k": 4}.
Hello! How are you today? I am fine, thank you. What is two plus two? Two plus two is four.
"""


class DemoError(RuntimeError):
    """The demo checkpoint could not be built; the message says where."""


def demo_root() -> Path:
    return cache_root() / f"demo-v{DEMO_VERSION}"


# ------------------------------------------------------------------------------ tokenizer


def build_tokenizer():
    """The demo's byte-level BPE (`tokenizers.Tokenizer`): BOS 0, EOS 1, pad 2, as released."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        special_tokens=[chat.BOS, chat.EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _ADDED])
    tok.post_processor = processors.TemplateProcessing(single=f"{chat.BOS} $A", special_tokens=[(chat.BOS, 0)])
    for tid, name in enumerate((chat.BOS, chat.EOS, PAD)):
        if tok.token_to_id(name) != tid:
            raise DemoError(f"demo tokenizer: {name} is id {tok.token_to_id(name)}, expected {tid}")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat.BOS,
        "eos_token": chat.EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "chat_template_type": chat.TEMPLATE_TYPE,
    }


def demo_args(tokenizer):
    """The demo's ModelArgs: DEMO_CONFIG, the tokenizer's vocabulary, Engram sizes from both, and
    `</think>` as the DSpark noise token (its id, 128799, in the release; docs/dspark.md#config)."""
    from mlx_dsv41.model.engram_hash import compressed_keys
    from mlx_dsv41.synthetic import tiny_args

    return tiny_args(
        **DEMO_CONFIG,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        image_token_id=tokenizer.token_to_id(IMAGE),
        dspark_noise_token_id=tokenizer.token_to_id(chat.END_THINK),
        engram_compressed_vocab_size=len(set(compressed_keys(tokenizer))),
    )


# ------------------------------------------------------------------------------ EXL3 details


def tensor_storage(stored: dict[str, tuple[str, np.ndarray]]) -> dict:
    """quantization_config.json's `tensor_storage` for the EXL3 linears among `stored`, as
    exllamav3 describes them (docs/exl3.md#quantization-config): stored tensors, bits per weight,
    codebook."""
    from mlx_dsv41.exl3.codebook import MARKER_VALUES

    storage: dict = {}
    for name, (_, arr) in stored.items():
        prefix, leaf = name.rsplit(".", 1)
        if f"{prefix}.trellis" not in stored:
            continue
        entry = storage.setdefault(prefix, {"stored_tensors": {}, "quant_format": "exl3"})
        entry["stored_tensors"][leaf] = {
            "shape": list(arr.shape),
            "n_bytes": int(arr.nbytes),
            "dtype": f"torch.{arr.dtype}",
        }
        if leaf == "trellis":
            entry["bits_per_weight"] = arr.shape[-1] / 16
        elif leaf in MARKER_VALUES:
            entry[f"{leaf}_multiplier"] = MARKER_VALUES[leaf]
    return storage


def _average_bits(storage: dict) -> float:
    weights = {p: np.prod(t["stored_tensors"]["trellis"]["shape"][:2]) * 256 for p, t in storage.items()}
    bits = sum(weights[p] * t["bits_per_weight"] for p, t in storage.items())
    return round(float(bits / sum(weights.values())), 2)


# ------------------------------------------------------------------------------ writing


def _write_weights(directory: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Two shards (layers split in the middle, the head with the second half) and their index."""
    from mlx_dsv41.convert.safetensors_writer import write_safetensors

    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    half = layers[len(layers) // 2]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    shard_of = {
        k: names[k.startswith("head") or (k.startswith("layers.") and int(k.split(".")[1]) >= half)] for k in tensors
    }
    for name in names:
        write_safetensors(directory / name, {k: v for k, v in tensors.items() if shard_of[k] == name})
    index = {"metadata": {"total_size": int(sum(v[1].nbytes for v in tensors.values()))}, "weight_map": shard_of}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_sources(root: Path, seed: int = 0):
    """Write `root/exl3` and `root/official-engram` from scratch; returns (exl3 dir, engram dir)."""
    from mlx_dsv41.synthetic import random_engram_tables
    from mlx_dsv41.synthetic_checkpoints import EXL3_QUANTIZATION, exl3_tensors, write_config, write_engram_shards

    src, engram = root / "exl3", root / "official-engram"
    for d in (src, engram):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    tok = build_tokenizer()
    args = demo_args(tok)
    tensors, _ = exl3_tensors(args, seed)
    storage = tensor_storage(tensors)
    quant = {**EXL3_QUANTIZATION, "bits": _average_bits(storage)}
    write_config(src, args, quant)
    (src / "quantization_config.json").write_text(json.dumps({**quant, "tensor_storage": storage}, indent=1))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1, ensure_ascii=False))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (src / "README.md").write_text(
        "mlx_dsv41 demo checkpoint: SYNTHETIC random weights in the EXL3 format; not a trained model.\n"
    )
    _write_weights(src, tensors)
    write_engram_shards(engram, args, random_engram_tables(args, seed))
    return src, engram


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (other processes building the demo wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_demo(root: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The converted demo directory, built (sources, then conversion) if it is not there yet."""
    from mlx_dsv41.loading import is_converted

    root = demo_root() if root is None else Path(root)
    out = root / "model"
    if is_converted(out):
        return out
    with _locked(root / ".lock"):
        if is_converted(out):
            return out
        from mlx_dsv41.convert import ConvertError, convert_checkpoint

        if progress:
            print(f"Building the demo checkpoint (synthetic weights) in {root} ...", flush=True, file=sys.stderr)
        try:
            src, engram = write_sources(root)
            convert_checkpoint(src, out, engram_from=engram, progress=progress)
        except (ConvertError, OSError) as e:
            raise DemoError(f"cannot build the demo checkpoint in {root}: {e}") from None
    return out
