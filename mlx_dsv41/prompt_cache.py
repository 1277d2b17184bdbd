"""Prompt-cache files: a prompt's caches on disk, continued by a later run
(`python -m mlx_dsv41.generate --prompt-cache-file F`).

The file is mlx-lm's format (`save_prompt_cache`: the cache states as safetensors, the class names
and metadata), so `python -m mlx_lm generate --prompt-cache-file F` reads ours and we read
`python -m mlx_lm cache_prompt`'s. Metadata:

    model              the checkpoint directory (mlx-lm's key: it refuses a file made for another)
    tokenizer_config   "{}" (mlx-lm's key)
    mlx_dsv41_tokens   the token ids the file stands for (JSON); the caches hold all of them but
                       the last few, which the next run feeds first (a run needs >= 1 input token)
    mlx_dsv41_chat     {"thinking", "effort"} of a chat prompt (an open user turn), or null

A file without our keys (mlx-lm's) stands for exactly the tokens its caches hold.

The DSpark draft head's state (its DraftCache: the captured rows of the latest positions, at the
caches' position) has no place in a file mlx-lm reads as one cache per layer, so a drafting run
saves it beside F, in F's `.dspark.safetensors` sibling (`draft_file`; mlx-lm's format too, one
DraftCache). A run continuing F drafts only if that sibling is there and at F's position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be read or does not fit the model; one line."""


@dataclass
class PromptCacheFile:
    cache: list
    tokens: list[int] | None  # None: not recorded (mlx-lm's files)
    chat: dict | None  # {"thinking", "effort"} of a chat prompt, None for plain text
    model: str | None
    draft_cache: object | None = None  # the DraftCache saved beside the file, None if there is none

    @property
    def cached(self) -> int:
        """Tokens the caches hold."""
        return self.cache[0].offset

    def pending(self) -> list[int]:
        """Tokens the file stands for that the caches do not hold yet (fed first by the next run)."""
        return self.tokens[self.cached :] if self.tokens else []


def draft_file(path: Path) -> Path:
    """Where the DSpark state of the prompt saved in `path` goes: doc.safetensors -> doc.dspark.safetensors."""
    return path.with_name(path.name.removesuffix(".safetensors") + ".dspark.safetensors")


def save(path: Path, cache: list, tokens: list[int], model_path: Path, chat: dict | None, draft_cache=None) -> None:
    """Write `cache` (which holds a prefix of `tokens`) to `path`, and `draft_cache` (at the same
    position) to `draft_file(path)`; a sibling left from an earlier file is removed."""
    from mlx_lm.models.cache import save_prompt_cache

    metadata = {
        "model": str(model_path),
        "tokenizer_config": "{}",
        "mlx_dsv41_tokens": json.dumps(tokens),
        "mlx_dsv41_chat": json.dumps(chat),
    }
    sibling = draft_file(path)
    try:
        save_prompt_cache(str(path), cache, metadata)
        if draft_cache is not None:
            save_prompt_cache(str(sibling), [draft_cache], {"model": str(model_path)})
        elif sibling.exists():
            sibling.unlink()
    except OSError as e:
        raise PromptCacheError(f"cannot write {e.filename or path}: {e.strerror or e}") from None


def read(path: Path, model_path: Path) -> PromptCacheFile:
    """The file at `path`, made for the checkpoint at `model_path` (the caches stay lazy)."""
    from mlx_lm.models.cache import load_prompt_cache

    from mlx_dsv41.cache import register_with_mlx_lm

    register_with_mlx_lm()
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        tokens = json.loads(metadata["mlx_dsv41_tokens"]) if "mlx_dsv41_tokens" in metadata else None
        chat = json.loads(metadata.get("mlx_dsv41_chat", "null"))
    except Exception as e:  # noqa: BLE001 (mx.load, a missing class, a bad state or metadata: one line each)
        raise PromptCacheError(
            f"{path}: not a prompt-cache file of this model ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    made_for = metadata.get("model")
    if made_for and Path(made_for).expanduser().resolve() != Path(model_path).resolve():
        raise PromptCacheError(f"{path} was made for the model {made_for}, not {model_path}")
    saved = PromptCacheFile(cache, tokens, chat, made_for, read_draft_state(path, model_path))
    if tokens is not None and len(tokens) < saved.cached:
        raise PromptCacheError(f"{path}: its caches hold {saved.cached} tokens but it records {len(tokens)}")
    if saved.draft_cache is not None and saved.draft_cache.offset != saved.cached:
        raise PromptCacheError(
            f"{draft_file(path)}: the DSpark state is at position {saved.draft_cache.offset}, "
            f"{path}'s caches at {saved.cached}; delete it (or both files)"
        )
    return saved


def read_draft_state(path: Path, model_path: Path):
    """The DraftCache saved beside `path` (lazy), or None when there is none."""
    from mlx_lm.models.cache import load_prompt_cache

    from mlx_dsv41.cache import DraftCache

    sibling = draft_file(path)
    if not sibling.is_file():
        return None
    try:
        caches, metadata = load_prompt_cache(str(sibling), return_metadata=True)
    except Exception as e:  # noqa: BLE001 (as in read: one line)
        raise PromptCacheError(
            f"{sibling}: not a DSpark state file ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    if len(caches) != 1 or not isinstance(caches[0], DraftCache):
        raise PromptCacheError(f"{sibling}: not a DSpark state file (it holds {len(caches)} caches)")
    made_for = metadata.get("model")
    if made_for and Path(made_for).expanduser().resolve() != Path(model_path).resolve():
        raise PromptCacheError(f"{sibling} was made for the model {made_for}, not {model_path}")
    return caches[0]


def check_fits(saved: PromptCacheFile, path: Path, model) -> None:
    """The file's caches are this model's: same classes, one per layer (and Engram history)."""
    want = [type(c).__name__ for c in model.make_cache()]
    if [type(c).__name__ for c in saved.cache] != want:
        raise PromptCacheError(
            f"{path}: its caches ({len(saved.cache)}) do not fit this model's "
            f"({len(want)} {', '.join(sorted(set(want)))})"
        )
