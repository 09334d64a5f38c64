"""The multi-token-prediction block (spec §2.9, issue 29) against an independent reading:
transformers has no MTP, but the block is a V4 layer between the spec's input combination
and a hyper-connection head. So a one-layer sliding-window transformers model whose layer,
`hc_head` and `norm` are the block's is fed, through a hook on its layer, the spec's input
computed in torch — `e_proj(enorm(embed(token)))` added to each stream of
`h_proj(hnorm(H))` — and its logits are the block's draft logits."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model.forward import mtp_chunk
from ds4jax.model.params import init_params, param_shapes
from ds4jax.model.state import init_state
from ds4jax.weights.loading import load_hf_checkpoint
from tests.model import hf_reference

#: the independent reference checks the programs as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized

BLOCK = dict(hf_reference.BASE, num_hidden_layers=1, layer_types=["sliding_attention"],
             mlp_layer_types=["moe"])  # fmt: skip


def test_the_mtp_block_is_a_v4_layer_fed_the_spec_input(tmp_path: Path) -> None:
    import torch

    model = hf_reference.build(BLOCK, tmp_path)
    cfg, params = load_hf_checkpoint(tmp_path)
    T, D, hc = 13, cfg.hidden_size, cfg.hc_mult  # past the window of 8: its ring wraps
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, cfg.vocab_size, T)
    H = rng.standard_normal((T, hc, D)).astype(np.float32)
    extra = {
        "e_proj": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
        "h_proj": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
        "enorm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
        "hnorm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
    }

    def rmsw(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps)
        return x * torch.from_numpy(w)

    t = {k: torch.from_numpy(v) for k, v in extra.items()}
    with torch.no_grad():
        emb = model.model.embed_tokens.weight[torch.from_numpy(tokens)].float()
        x_in = (rmsw(emb, extra["enorm"]) @ t["e_proj"].T)[:, None, :]
        x_in = x_in + rmsw(torch.from_numpy(H), extra["hnorm"]) @ t["h_proj"].T

        def feed(_module, args, kwargs):  # the layer takes the spec's input, not the embedding
            return (x_in[None].to(args[0].dtype), *args[1:]), kwargs

        hook = model.model.layers[0].register_forward_pre_hook(feed, with_kwargs=True)
        try:
            want = model(torch.tensor(tokens[None]), use_cache=False).logits[0].float().numpy()
        finally:
            hook.remove()

    head = ("norm", "hc_head_fn", "hc_head_base", "hc_head_scale")
    mtp = {**params["layers"][0], **{k: params[k] for k in head},
           **{k: jnp.asarray(v) for k, v in extra.items()}}  # fmt: skip
    full = {**params, "mtp": (mtp,)}
    assert jax.tree.structure(full) == jax.tree.structure(param_shapes(cfg, mtp_layers=1))
    empty = init_state(cfg.mtp_block(), 32).layers[0]
    got, X, _ = mtp_chunk(full, jnp.asarray(H), jnp.asarray(tokens), empty, 0, T, cfg=cfg)
    err = np.abs(np.asarray(got) - want).max()
    assert err <= 1e-4, f"max |Δlogit| {err:.2e}"
    assert X.shape == (T, hc, D)

    # in chunks, its own window state carried from one to the next: the same drafts
    state, parts = empty, []
    for start in range(0, T, 4):
        n = min(4, T - start)
        h = np.zeros((4, hc, D), np.float32)
        h[:n] = H[start : start + n]
        tk = np.zeros(4, np.int64)
        tk[:n] = tokens[start : start + n]
        out, _, state = mtp_chunk(full, jnp.asarray(h), jnp.asarray(tk), state, start, n,
                                  cfg=cfg)  # fmt: skip
        parts.append(np.asarray(out)[:n])
    assert np.abs(np.concatenate(parts) - np.asarray(got)).max() <= 1e-5


def test_random_params_carry_the_block_only_when_asked() -> None:
    from tests.model.conftest import small_config

    cfg = small_config(num_layers=2, compress_ratios=(4, 8), hash_layers=(True, False))
    assert "mtp" not in param_shapes(cfg)
    p = init_params(cfg, 1, mtp_layers=1)
    (mtp,) = p["mtp"]
    assert "compressor" not in mtp["attn"] and "indexer" not in mtp["attn"]
    assert "gate_bias" in mtp["ffn"] and "tid2eid" not in mtp["ffn"]
    # adding the block changes none of the model's own weights
    base = init_params(cfg, 1)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), base["layers"], p["layers"])
    assert all(jax.tree.leaves(same))


def test_the_block_loads_from_the_release_layout(tmp_path: Path) -> None:
    """`mtp.0.*` as the release names it (the block's layer named as a layer, its FP8
    input projections and FP4 experts quantized as the model's): loaded on request, each
    leaf the written one to its format's rounding; ignored otherwise, as before."""
    from ds4jax.model.params import path_name
    from ds4jax.weights.loading import CheckpointError
    from ds4jax.weights.official import load_official_checkpoint, write_official_checkpoint
    from tests.model.conftest import small_config

    cfg = small_config(num_layers=2, compress_ratios=(4, 8), hash_layers=(True, False),
                       num_experts=4, quant_sim=False)  # fmt: skip
    params = init_params(cfg, 2, mtp_layers=1)
    write_official_checkpoint(params, cfg, tmp_path / "rel")
    _, plain = load_official_checkpoint(tmp_path / "rel", dtype=jnp.float32)
    assert "mtp" not in plain
    _, got = load_official_checkpoint(tmp_path / "rel", dtype=jnp.float32, mtp=True)
    assert jax.tree.structure(got) == jax.tree.structure(params)

    def close(path: tuple, want: jax.Array, have: jax.Array) -> None:
        name = path_name(path)
        want, have = np.asarray(want, np.float32), np.asarray(have, np.float32)
        rel = np.linalg.norm(have - want) / max(np.linalg.norm(want), 1e-12)
        assert rel <= (0.2 if name.endswith(("w1", "w2", "w3")) else 0.07), (name, rel)

    jax.tree_util.tree_map_with_path(close, params["mtp"], got["mtp"])
    # the model's own leaves as without the block
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), plain["layers"], got["layers"])
    assert all(jax.tree.leaves(same))
    # a release without the block: asked for, a clear error
    write_official_checkpoint(init_params(cfg, 2), cfg, tmp_path / "none")
    cfg_json = tmp_path / "none" / "config.json"
    cfg_json.write_text(cfg_json.read_text().replace('"num_nextn_predict_layers": 1',
                                                     '"num_nextn_predict_layers": 0'))  # fmt: skip
    try:
        load_official_checkpoint(tmp_path / "none", mtp=True)
    except CheckpointError as err:
        assert "no MTP block" in str(err)
    else:
        raise AssertionError("a release without an MTP block loaded one")
