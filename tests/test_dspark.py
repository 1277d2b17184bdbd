"""The DSpark draft head (mlx_dsv41/model/dspark.py, docs/dspark.md): its config, the main model's
capture, one draft block against docs/dspark.md written out independently, loading (any format per
tensor; a checkpoint without `mtp.*` runs without speculation) and conversion (from the source,
from `--dspark-from` reading only the shards that hold it, or without; every bad input one line)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from convert_fixtures import edit_tensors, run_cli
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlx_dsv41 import layout
from mlx_dsv41.cache import DraftCache, make_draft_cache
from mlx_dsv41.config import ConfigError, ModelArgs
from mlx_dsv41.convert import ConvertError, convert_checkpoint
from mlx_dsv41.loading import LoadError, is_converted, load_converted, load_model
from mlx_dsv41.model.deepseek_v41 import Block
from mlx_dsv41.model.dspark import draft_block
from mlx_dsv41.model.engram import MemoryRowSource
from mlx_dsv41.model.hyper_connections import collapse, expand_reference, hc_mixes, initial_pre
from mlx_dsv41.synthetic import (
    TINY,
    TINY_DSPARK,
    hf_config,
    random_engram_tables,
    random_weights,
    synthetic_token_map,
    tiny_args,
    tiny_model,
    write_checkpoint,
)
from mlx_dsv41.synthetic_checkpoints import write_engram_shards, write_exl3_checkpoint, write_official_checkpoint

ARGS = tiny_args(**TINY_DSPARK)
PROMPT = np.random.default_rng(4).integers(3, 150, 13).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model(ARGS, seed=1)


# ------------------------------------------------------------------------------ config


def test_config_keys_and_when_drafting_is_refused():
    flash = ModelArgs.from_dict(
        {
            "text_config": {
                "dspark_block_size": 5,
                "dspark_noise_token_id": 128799,
                "dspark_target_layer_ids": [37, 38, 39],
                "dspark_n_routed_experts": 128,
                "dspark_num_experts_per_tok": 3,
            }
        }
    )
    assert flash.dspark_stages == 3 and flash.dspark_target_layer_ids == (37, 38, 39)
    stage = flash.dspark_stage_args()
    assert (stage.n_routed_experts, stage.num_experts_per_tok, stage.hidden_size) == (128, 3, 5120)
    assert ModelArgs().dspark_stages == 0 and "no DSpark head" in ModelArgs().dspark_unavailable
    no_noise = dataclasses.replace(flash, dspark_noise_token_id=None)
    assert no_noise.dspark_stages == 0 and "dspark_noise_token_id" in no_noise.dspark_unavailable
    assert "dspark_target_layer_ids" in dataclasses.replace(flash, dspark_target_layer_ids=()).dspark_unavailable
    assert ModelArgs.from_dict(json.loads(json.dumps(hf_config(ARGS)))) == ARGS


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(dspark_target_layer_ids=(5, 8)), "dspark_target_layer_ids: 8 is not a backbone layer"),
        (dict(dspark_target_layer_ids=(1, 7)), "dspark_target_layer_ids: 1 is an Engram layer"),
        (dict(dspark_target_layer_ids=(6, 6)), "dspark_target_layer_ids has duplicates"),
        (dict(dspark_noise_token_id=160), "dspark_noise_token_id 160 is not a token id"),
        (dict(dspark_num_experts_per_tok=5), "dspark_num_experts_per_tok must be in 1..dspark_n_routed_experts"),
        (
            dict(compress_ratios=TINY["compress_ratios"][:8] + (0, 1, 0)),
            "compress_ratios of the DSpark stages must be 0",
        ),
    ],
)
def test_bad_dspark_config_is_one_clear_error(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tiny_args(**{**TINY_DSPARK, **change})


# ------------------------------------------------------------------------------ capture


def test_capture_is_the_stream_mean_of_the_target_inputs_and_changes_nothing(model):
    """main_hidden = concat over the target layers (loop order) of bf16(mean of the 4 streams of
    the block input), for every row of the chunk (docs/dspark.md#capture); the logits are
    unchanged."""
    inputs = {}

    class Recording(Block):
        def __call__(self, streams, pre, *rest):
            inputs[self.layer_id] = streams
            return super().__call__(streams, pre, *rest)

    ids = mx.array([PROMPT])
    plain = model(ids, model.make_cache())
    layers = model.layers
    try:
        for layer in layers:
            layer.__class__ = Recording
        logits, hidden = model(ids, model.make_cache(), capture=True)
    finally:
        for layer in layers:
            layer.__class__ = Block
    assert np.array_equal(np.array(logits), np.array(plain))
    want = [np.array(inputs[i].astype(mx.float32), np.float64).mean(axis=2) for i in (5, 6, 7)]
    want = mx.array(np.concatenate(want, axis=-1).astype(np.float32)).astype(mx.bfloat16)
    assert hidden.dtype == mx.bfloat16 and hidden.shape == (1, len(PROMPT), 3 * ARGS.hidden_size)
    assert np.array_equal(np.array(hidden.astype(mx.float32)), np.array(want.astype(mx.float32)))


# ------------------------------------------------------------------------------ the block


def spec_block(model, hidden: mx.array, token: int):
    """One greedy draft block written out from docs/dspark.md#main-x to #output,
    with the keys of the ring recomputed from the main rows (not read from a cache) and dense sink
    attention."""
    args, stages = model.args, model.mtp
    S, W, p = args.dspark_block_size, args.sliding_window, hidden.shape[1] - 1
    first, last = stages[0], stages[-1]
    main_x = first.main_norm(first.main_proj(hidden))
    ids = mx.array([[token] + [args.dspark_noise_token_id] * (S - 1)])
    streams = mx.broadcast_to(model.embed(ids)[:, :, None, :], (1, S, args.hc_mult, args.hidden_size))
    pre = initial_pre(1, S, args.hc_mult)
    for stage in stages:
        attn = stage.attn
        a_pre, a_post, a_comb = mixes(stage, streams, "attn")
        y = stage.attn_norm(collapse(streams, pre))
        ring = [attn.window_keys(main_x[:, t : t + 1], t) for t in range(max(0, p - W + 1), p + 1)]
        keys = mx.concatenate([*ring, attn.window_keys(y, p + 1)], axis=1)[0].astype(mx.float32)
        q = attn.queries(y, p + 1)[0][0].astype(mx.float32)  # [S, H, Dh]: slots at p+1 .. p+S
        scores = (q @ keys.T) * args.head_dim**-0.5  # every slot sees every key: not causal
        sink = attn.attn_sink.astype(mx.float32)[None, :, None]
        top = mx.maximum(mx.max(scores, axis=-1, keepdims=True), sink)
        weights = mx.exp(scores - top)
        o = (weights @ keys) / (mx.sum(weights, axis=-1, keepdims=True) + mx.exp(sink - top))
        streams = expand_reference(attn.output(attn.unrotated(o[None], p + 1, y.dtype)), streams, a_post, a_comb)
        f_pre, f_post, f_comb = mixes(stage, streams, "ffn")
        streams = expand_reference(stage.ffn(stage.ffn_norm(collapse(streams, a_pre))), streams, f_post, f_comb)
        pre = f_pre
    z = collapse(streams, pre)[0]
    base = model.head(last.norm(z).astype(mx.float32))
    embed, head = last.markov_head.embed.weight, last.markov_head.head.weight.astype(mx.float32)
    proj = last.confidence_head.proj.weight.astype(mx.float32)
    tokens, logits, confidence = [token], [], []
    for i in range(S):
        e = embed[tokens[-1]]
        logits.append(base[i] + e.astype(mx.float32) @ head.T)
        confidence.append((mx.concatenate([z[i], e]).astype(mx.float32) @ proj.T)[0])
        tokens.append(int(mx.argmax(logits[-1])))
    return tokens, mx.stack(logits), mx.stack(confidence)


def mixes(block, streams, site: str):
    """A site's mixes as the spec states them (model/hyper_connections.hc_mixes)."""
    p = lambda name: getattr(block, f"hc_{site}_{name}")  # noqa: E731
    return hc_mixes(
        streams, p("fn"), p("base"), p("scale"), iters=block.hc_iters, hc_eps=block.hc_eps, norm_eps=block.norm_eps
    )


@pytest.mark.parametrize("length", [3, 13])
def test_a_draft_block_is_the_spec_written_out(model, length):
    """p < window (the ring holds positions 0..p only) and p >= window (a wrapped ring)."""
    ids = PROMPT[:length]
    logits, hidden = model(mx.array([ids]), model.make_cache(), capture=True)
    token = int(mx.argmax(logits[0, -1]))
    cache = model.make_draft_cache()
    cache.append(hidden)
    draft = draft_block(model, cache, mx.array([token]))
    tokens, want_logits, want_conf = spec_block(model, hidden, token)
    assert np.array(draft.tokens[0]).tolist() == tokens
    assert np.allclose(np.array(draft.logits[0]), np.array(want_logits), atol=1e-3, rtol=1e-3)
    assert np.allclose(np.array(draft.confidence[0]), np.array(want_conf), atol=1e-3, rtol=1e-3)
    assert [ring.offset for ring in cache.rings] == [length] * 3


def test_draft_cache_trims_with_the_main_caches_and_rewrites_its_rings(tmp_path):
    """The held rows trim exactly (window + slack kept); a ring past the trim point is trimmed
    too, one too far behind starts afresh from the held rows; state round-trips without rings."""
    args = ARGS
    cache = make_draft_cache(args, trim_slack=4)
    rows = mx.arange(40 * 2, dtype=mx.float32).reshape(1, 40, 2)
    cache.append(rows[:, :30])
    cache.append(rows[:, 30:33])
    assert cache.offset == 33 and cache.kept_from == 33 - (args.sliding_window + 4)
    assert cache.max_trim() == 4
    with pytest.raises(ValueError, match="only the last 4 tokens"):
        cache.trim(5)
    write = cache.rows_to_write()  # fresh rings: the last window of positions
    assert np.array_equal(np.array(write), np.array(rows[:, 33 - args.sliding_window : 33]))
    for ring in cache.rings:
        ring.advance(write.shape[1])  # as the stage attention does after writing
    assert np.array_equal(np.array(cache.rows_to_write()), np.array(rows[:, 32:33]))  # p again
    for ring in cache.rings:
        ring.advance(1)
    cache.trim(3)
    assert cache.offset == 30 and all(r.offset == 30 for r in cache.rings)
    assert np.array_equal(np.array(cache.rows_to_write()), np.array(rows[:, 29:30]))
    again = DraftCache.from_state(cache.state)
    assert again.offset == 30 and len(again.rings) == 3 and all(r.offset == 0 for r in again.rings)
    save_prompt_cache(str(tmp_path / "cache.safetensors"), [cache])  # registered with mlx-lm
    (loaded,) = load_prompt_cache(str(tmp_path / "cache.safetensors"))
    assert isinstance(loaded, DraftCache) and loaded.offset == 30
    assert np.array_equal(np.array(loaded.hidden), np.array(cache.hidden))


# ------------------------------------------------------------------------------ loading


@pytest.fixture(scope="module")
def weights():
    return random_weights(ARGS, seed=5)


def _load(path):
    model = load_model(path)
    tables = random_engram_tables(model.args, seed=5)
    model.set_engram(synthetic_token_map(model.args), {k: MemoryRowSource(v) for k, v in tables.items()})
    return model


def test_a_checkpoint_without_mtp_loads_and_says_why_it_cannot_draft(tmp_path, weights):
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    model = _load(write_checkpoint(tmp_path / "none", ARGS, kept))
    assert model.mtp == [] and model.dspark_unavailable == "the checkpoint has no DSpark weights (mtp.*)"
    with pytest.raises(ValueError, match="cannot draft: the checkpoint has no DSpark"):
        model.make_draft_cache()
    full = _load(write_checkpoint(tmp_path / "full", ARGS, weights))
    assert len(full.mtp) == 3 and full.dspark_unavailable is None
    # held as stored (bf16) and used in fp32 (docs/numerics.md#fp32-linears)
    assert full.mtp[2].markov_head.head.weight.dtype == mx.bfloat16
    assert full.mtp[2].confidence_head.proj.weight.dtype == mx.bfloat16
    ids = mx.array([PROMPT])
    assert np.array_equal(np.array(model(ids)), np.array(full(ids)))  # the main model is the same
    no_noise = tiny_args(**{**TINY_DSPARK, "dspark_noise_token_id": None})
    refused = load_model(write_checkpoint(tmp_path / "nonoise", no_noise, weights))
    assert refused.mtp == [] and "dspark_noise_token_id" in refused.dspark_unavailable


@pytest.mark.parametrize(
    "edit,message",
    [
        ("drop", "missing tensor mtp.1.attn.wkv.weight"),
        ("shape", "mtp.0.main_proj.weight: expected shape [64, 192], got [64, 128]"),
    ],
)
def test_broken_mtp_tensors_are_one_line_load_errors(tmp_path, weights, edit, message):
    broken = dict(weights)
    if edit == "drop":
        del broken["mtp.1.attn.wkv.weight"]
    else:
        broken["mtp.0.main_proj.weight"] = broken["mtp.0.main_proj.weight"][:, :128]
    with pytest.raises(LoadError) as e:
        load_model(write_checkpoint(tmp_path, ARGS, broken))
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ conversion


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The official release with its draft head, an EXL3 pack without one (+ the Engram shards),
    and a --dspark-from directory holding the official index and only the mtp.* shard."""
    root = tmp_path_factory.mktemp("dspark_sources")
    official = write_official_checkpoint(root / "official", ARGS, seed=6)
    exl3 = write_exl3_checkpoint(root / "exl3", ARGS, seed=6, with_dspark=False)
    write_engram_shards(root / "engram", ARGS, exl3.tables)
    index = json.loads((official.path / layout.INDEX).read_text())
    (root / "dspark").mkdir()
    shutil.copy(official.path / layout.INDEX, root / "dspark")
    for shard in {s for name, s in index["weight_map"].items() if name.startswith("mtp.")}:
        shutil.copy(official.path / shard, root / "dspark")
    assert len(list((root / "dspark").glob("*.safetensors"))) == 1 < len(set(index["weight_map"].values()))
    return root


def _mtp_params(model) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    return {
        k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in tree_flatten(model.parameters())
        if k.startswith("mtp.")
    }


def test_dspark_from_adds_the_official_draft_head_to_an_exl3_pack(sources, tmp_path):
    official = convert_checkpoint(sources / "official", tmp_path / "official", progress=False)
    block = json.loads((official / layout.CONFIG).read_text())[layout.BLOCK]
    assert block["formats"]["mtp.main_proj"] == ["mxfp8"] and block["formats"]["mtp.ffn.experts.w1"] == ["mxfp4"]
    assert block["formats"]["mtp.markov_head.head"] == ["bf16"]
    out = convert_checkpoint(
        sources / "exl3",
        tmp_path / "exl3",
        engram_from=sources / "engram",
        dspark_from=sources / "dspark",
        progress=False,
    )
    block = json.loads((out / layout.CONFIG).read_text())[layout.BLOCK]
    assert block["dspark_source"]["path"] == str((sources / "dspark").resolve())
    assert block["formats"]["attn.wq_a"] == ["exl3"] and block["formats"]["mtp.attn.wq_a"] == ["mxfp8"]
    exl3_model, official_model = load_converted(out), load_converted(official)
    assert len(exl3_model.mtp) == 3
    theirs, ours = _mtp_params(official_model), _mtp_params(exl3_model)
    assert theirs.keys() == ours.keys() and all(np.array_equal(theirs[k], ours[k]) for k in theirs)
    cache = exl3_model.make_draft_cache()
    _, hidden = exl3_model(mx.array([PROMPT[:5]]), exl3_model.make_cache(), capture=True)
    cache.append(hidden)
    assert draft_block(exl3_model, cache, mx.array([7])).tokens.shape == (1, ARGS.dspark_block_size + 1)


def test_a_source_without_mtp_converts_without_speculation(sources, tmp_path, capsys):
    out = convert_checkpoint(sources / "exl3", tmp_path / "out", engram_from=sources / "engram")
    assert "no DSpark draft head (mtp.*)" in capsys.readouterr().err
    model = load_converted(out)
    assert model.mtp == [] and "no DSpark weights" in model.dspark_unavailable


def _bad_dspark_dir(sources, tmp_path, how):
    bad = shutil.copytree(sources / "dspark", tmp_path / "bad")
    if how == "missing_shard":
        next(bad.glob("*.safetensors")).unlink()
    elif how == "no_mtp":
        shutil.rmtree(bad)
        bad = shutil.copytree(sources / "engram", tmp_path / "bad")
    elif how == "shape":
        from convert_fixtures import read_tensor

        dtype, value = read_tensor(bad, "mtp.0.attn_norm.weight")
        edit_tensors(bad, {"mtp.0.attn_norm.weight": (dtype, value[:32])})
    return bad


@pytest.mark.parametrize(
    "how,source,message",
    [
        ("missing_shard", "exl3", "holding mtp."),
        ("no_mtp", "exl3", "no DSpark tensors (mtp.*)"),
        ("absent", "exl3", "no such file or directory"),
        ("shape", "exl3", "mtp.0.attn_norm.weight: shape [32], expected [64]"),
        ("ok", "official", "holds the DSpark tensors (mtp.*) itself; drop --dspark-from"),
    ],
)
def test_bad_dspark_from_is_one_line_and_writes_nothing(sources, tmp_path, how, source, message):
    dspark = (
        tmp_path / "absent"
        if how == "absent"
        else sources / "dspark"
        if how == "ok"
        else _bad_dspark_dir(sources, tmp_path, how)
    )
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as e:
        convert_checkpoint(
            sources / source,
            out,
            engram_from=sources / "engram" if source == "exl3" else None,
            dspark_from=dspark,
            progress=False,
        )
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not is_converted(layout.partial_dir(out))


def test_convert_cli_refuses_dspark_from_for_a_config_without_a_head(sources, tmp_path):
    plain = write_official_checkpoint(tmp_path / "plain")  # the tiny config: no DSpark head
    result = run_cli(plain.path, tmp_path / "out", "--dspark-from", sources / "dspark")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: --dspark-from")
    assert "cannot draft (the config has no DSpark head" in result.stderr
