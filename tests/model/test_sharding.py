"""The same model code on 1 device and on an 8-device mesh gives the same logits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ds4jax.model.sharding import logical_axes
from tests.conftest import forced_devices_env

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    r"""
    import jax, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from jax.sharding import PartitionSpec
    from ds4jax.model.forward import prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.sharding import make_mesh, replicated, shard_params
    from ds4jax.model.state import init_state
    from tests.model.conftest import small_config

    # every layer kind once (sliding only, CSA ratio 4, HCA ratio 8; hash and learned MoE):
    # the layers shard alike, so small_config's five compile no more than these three prove
    cfg = small_config(num_layers=3, compress_ratios=(0, 4, 8), hash_layers=(True, False, False),
                       num_experts=8, quant_sim=False)
    params = init_params(cfg, seed=7)
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, 40)
    one = lambda x: jax.device_put(x, jax.devices()[0])
    one_dev = one(params)
    # (a committed state, as every later one-device prefill here: an uncommitted one compiles
    # a program of its own)
    _, ref = prefill(one_dev, one(init_state(cfg, 64)), toks, cfg, chunk_sizes=(16,),
                     all_logits=True)

    mesh = make_mesh(expert=2, tensor=4)
    sharded = shard_params(params, cfg, mesh)
    w1 = sharded["layers"][0]["ffn"]["w1"]
    assert w1.sharding.spec == PartitionSpec("expert", "tensor", None), w1.sharding.spec
    assert len(w1.addressable_shards) == 8
    assert w1.addressable_shards[0].data.shape == (4, 8, 64)
    state = jax.device_put(init_state(cfg, 64), replicated(mesh))
    _, out = prefill(sharded, state, toks, cfg, chunk_sizes=(16,), all_logits=True)
    err = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
    print("max_err", err)
    assert err <= 1e-5, err
    # with the mesh set (as the engine and the CLI run their programs) the routed experts
    # run expert-parallel (`sharding.expert_parallel`): the same logits, and no collective
    # of the compiled chunk carries an expert's weights — only tokens and partial sums
    import re
    from ds4jax.model.forward import forward_chunk

    with jax.set_mesh(mesh):
        _, out = prefill(sharded, state, toks, cfg, chunk_sizes=(16,), all_logits=True)
        hlo = forward_chunk.lower(sharded, state, toks[:16], np.int32(16), cfg=cfg,
                                  all_logits=True).compile().as_text()
    err = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
    print("ep_max_err", err)
    assert err <= 1e-5, err
    # an expert's [F, D] or [D, F] weights, whole or a tensor shard's, in any stack of them
    F, D = cfg.moe_intermediate_size, cfg.hidden_size
    expert_dims = {(F, D), (D, F), (F // 4, D), (D, F // 4)}
    moved = [line.strip()[:160] for line in hlo.splitlines()
             if (m := re.search(r"= \w+\[([\d,]*)\][^=]* (all-gather|all-reduce|all-to-all|"
                                r"collective-permute)", line))
             and tuple(int(d) for d in m.group(1).split(",") if d)[-2:] in expert_dims
             and m.group(1).count(",") == 2]
    assert not moved, moved
    assert "all-reduce" in hlo  # the partial sums

    # the batched decode step: two rows, sharded params, the same tokens and logits
    import jax.numpy as jnp
    from ds4jax.model import batch as mb

    def batch_of(p, place):
        b = place(mb.empty_batch(cfg, 64, 2))
        for row, n in enumerate((20, 33)):
            s, _ = prefill(p, place(init_state(cfg, 64)), toks[:n], cfg, chunk_sizes=(16,))
            b = mb.insert(b, jnp.int32(row), s)
        return place(b)

    def step(p, b):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 2)))
        out = mb.step(p, b, np.array([-1, 7], np.int32), keys, np.zeros(2, np.float32),
                      np.zeros(2, np.int32), np.ones(2, np.float32), np.zeros(2, np.float32),
                      np.int32(1), cfg=cfg, size=2)
        return out[0].logits, out[1]

    ref_logits, ref_tokens = step(one_dev, batch_of(one_dev, one))
    logits, tokens = step(sharded, batch_of(sharded, lambda x: jax.device_put(x, replicated(mesh))))
    assert tokens.tolist() == ref_tokens.tolist()
    # the batch's rows split over a data axis (params replicated along it), as the engine
    # places its batch on such a mesh
    from ds4jax.model.sharding import batch_sharding, parse_mesh

    md = parse_mesh("data=2,tensor=4")
    assert dict(md.shape) == {"data": 2, "expert": 1, "tensor": 4}
    split = jax.device_put(jax.device_get(batch_of(one_dev, one)), batch_sharding(md))
    assert split.logits.sharding.spec == PartitionSpec("data")
    # the routed experts split over data × expert (issue 28), not copied per data shard
    pd = shard_params(params, cfg, md)
    w1d = pd["layers"][0]["ffn"]["w1"]
    assert w1d.sharding.spec == PartitionSpec(("data", "expert"), "tensor", None), w1d.sharding.spec
    assert w1d.addressable_shards[0].data.shape[0] == cfg.num_experts // 2
    dlogits, dtokens = step(pd, split)
    assert dtokens.tolist() == ref_tokens.tolist()
    derr = float(np.abs(np.asarray(dlogits) - np.asarray(ref_logits)).max())
    print("data_axis_err", derr)
    assert derr <= 1e-5, derr
    berr = float(np.abs(np.asarray(logits) - np.asarray(ref_logits)).max())
    print("batch_max_err", berr)
    assert berr <= 1e-5, berr
    # a mixed step (a prompt's chunk riding along) on the data-split rows, a replicated
    # prompt state: the rows and the prompt's state as on one device
    def mixed(p, b, prompt):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 2)))
        chunk = (prompt, np.arange(4, dtype=np.int32) + 9, np.int32(3))
        return mb.step(p, b, np.array([-1, 7], np.int32), keys, np.zeros(2, np.float32),
                       np.zeros(2, np.int32), np.ones(2, np.float32), np.zeros(2, np.float32),
                       np.int32(1), chunk, cfg=cfg, size=2)
    prompt = prefill(one_dev, one(init_state(cfg, 64)), toks[:27], cfg, chunk_sizes=(16,))[0]
    want = mixed(one_dev, batch_of(one_dev, one), prompt)
    split = jax.device_put(jax.device_get(batch_of(one_dev, one)), batch_sharding(md))
    got = mixed(shard_params(params, cfg, md), split,
                jax.device_put(jax.device_get(prompt), replicated(md)))
    assert got[1].tolist() == want[1].tolist()
    merr = max(float(np.abs(np.asarray(got[i].logits) - np.asarray(want[i].logits)).max())
               for i in (0, 3))
    print("mixed_data_err", merr)
    assert merr <= 1e-5, merr

    # the CLI takes the same flag: dump-logits on the mesh equals one device (a config file
    # of tiny's three layer kinds: the real vocabulary, for the prompt's text)
    import json, os, tempfile
    from ds4jax import cli
    from tests.model.conftest import short_tiny

    d = tempfile.mkdtemp()
    config = os.path.join(d, "tiny3.json")
    open(config, "w").write(json.dumps(short_tiny().to_dict()))
    for name, spec in (("one", "none"), ("mesh", "expert=2,tensor=4")):
        argv = ["dump-logits", "--config", config, "--prompt", "hello there", "--quant-sim",
                "off", "--mesh", spec, "--out", os.path.join(d, name + ".npy")]
        assert cli.main(argv) == 0
    a, b = (np.load(os.path.join(d, n + ".npy")) for n in ("one", "mesh"))
    cerr = float(np.abs(a - b).max())
    print("cli_max_err", cerr)
    assert cerr <= 1e-5, cerr

    # --weights fp8 on the mesh: the release's FP8/FP4 tensors sharded as they are, the same
    # logits as dequantized at load on one device
    from ds4jax.weights.official import write_official_checkpoint

    rel, ids = os.path.join(d, "release"), os.path.join(d, "ids.txt")
    small = small_config(num_layers=2, compress_ratios=(4, 8), hash_layers=(True, False),
                         num_experts=8, quant_sim=False)
    write_official_checkpoint(init_params(small, 3), small, rel, fp8_head=True)
    open(ids, "w").write(" ".join(str(t) for t in range(3, 40)))
    # (and --weights fp4-experts: the packed experts split along expert and tensor, the
    # f32 logits)
    runs = (("bf16", "bf16", "none"), ("fp8", "fp8", "expert=2,tensor=4"),
            ("f32", "f32", "none"), ("fp4", "fp4-experts", "expert=2,tensor=4"))
    for name, weights, spec in runs:
        argv = ["dump-logits", "--model", rel, "--weights", weights, "--tokens", ids,
                "--quant-sim", "off", "--mesh", spec, "--out", os.path.join(d, name + ".npy")]
        assert cli.main(argv) == 0
    for want, got in (("bf16", "fp8"), ("f32", "fp4")):
        a, b = (np.load(os.path.join(d, n + ".npy")) for n in (want, got))
        ferr = float(np.abs(a - b).max())
        print(got + "_mesh_err", ferr)
        assert ferr <= 1e-5, ferr
    """
)

#: the engine and disk half, run beside the first (each mostly waits on XLA compiles); the
#: engines of both its parts are the same, so none compiles twice, as it did when the
#: two halves each built them at once
ENGINE_DISK_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine, SamplingParams
    from ds4jax.model.params import init_params
    from ds4jax.model.sharding import parse_mesh, shard_params
    from tests.model.conftest import short_tiny, small_config

    tiny = short_tiny(quant_sim=False)
    tp = init_params(tiny, 0)
    tok = V4Tokenizer()
    kw = dict(max_len=256, chunk_sizes=(16, 64), sessions=2, max_batch=2)
    one = lambda x: jax.device_put(x, jax.devices()[0])
    m = parse_mesh("expert=2,tensor=4")

    # the engine on the mesh: two requests batched, the same greedy text and final logits
    # (the same engines as the disk round trip below, so each compiles once in this run)
    from ds4jax.model.sharding import default_mesh

    def serve_two(engine):
        out = []
        for text in ("Name a river.", "Count to three."):
            body = {"messages": [{"role": "user", "content": text}],
                    "thinking": {"type": "disabled"}}
            req = engine.prepare_request(parse_messages_request(body), max_tokens=6,
                                         sampling=SamplingParams(temperature=0.0))
            out.append(engine.submit(req))
        while engine.busy:
            engine.tick()
        lives = [engine.pool.sessions[t.result.session].live for t in out]
        return [t.result.raw_text for t in out], [np.asarray(l.state.logits) for l in lives]

    texts1, logits1 = serve_two(Engine(tiny, one(tp), tok, **kw))
    assert dict(m.shape) == {"expert": 2, "tensor": 4}
    texts8, logits8 = serve_two(Engine(tiny, shard_params(tp, tiny, m), tok, mesh=m, **kw))
    assert texts8 == texts1, (texts8, texts1)
    eerr = max(float(np.abs(a - b).max()) for a, b in zip(logits1, logits8))
    print("engine_max_err", eerr)
    assert eerr <= 1e-5, eerr
    dm = default_mesh(small_config(num_heads=8, index_heads=16))
    assert dm is not None and dict(dm.shape) == {"expert": 1, "tensor": 8}
    assert default_mesh(small_config(num_heads=4)) is None  # 4 heads do not divide by 8

    # a disk checkpoint written by the engine on the mesh restores on one device (and the
    # other way round): the same prompt continues from it with the same logits
    from ds4jax.continuation.types import CacheSource
    from ds4jax.kvstore.disk import DiskStore

    def through_disk(save_params, save_mesh, load_params, load_mesh):
        # request 1 on the save side leaves its cold checkpoint (the system prompt); a new
        # engine on each side serves request 2 from it
        kv = tempfile.mkdtemp()
        def engine_on(p, mesh):
            store = DiskStore.for_model(kv, tiny, tp, tok, max_len=256, min_tokens=16,
                                        continued_every=0, evict=False)
            return Engine(tiny, p, tok, store=store, mesh=mesh, **kw)
        def request(engine, body):
            req = engine.prepare_request(parse_messages_request(body), max_tokens=1,
                                         sampling=SamplingParams(temperature=0.0))
            r = engine.run(req)
            return r, np.asarray(engine.pool.sessions[r.session].live.state.logits)
        system = "You are a careful assistant who answers in one short sentence. " * 3
        first = {"system": system, "messages": [{"role": "user", "content": "Hi."}],
                 "thinking": {"type": "disabled"}}
        saver = engine_on(save_params, save_mesh)
        request(saver, first)
        saver.shutdown()  # its saves are written in the background: a clean exit flushes
        second = dict(first, messages=[{"role": "user", "content": "Again."}])
        out = []
        for p, mesh in ((save_params, save_mesh), (load_params, load_mesh)):
            r, logits = request(engine_on(p, mesh), second)
            assert r.source == CacheSource.DISK and r.cached > 16, (r.source, r.cached)
            out.append(logits)
        return float(np.abs(out[0] - out[1]).max())

    import tempfile
    tp8 = shard_params(tp, tiny, m)
    xerr = max(through_disk(tp8, m, one(tp), None), through_disk(one(tp), None, tp8, m))
    print("cross_mesh_restore_err", xerr)
    assert xerr <= 1e-5, xerr

    """
)


def test_eight_device_mesh_matches_one_device() -> None:
    env = forced_devices_env()
    # the two halves run at once: each mostly waits on single-threaded XLA compiles
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for script in (SCRIPT, ENGINE_DISK_SCRIPT)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    first, second = outs
    assert "batch_max_err" in first and "data_axis_err" in first and "cli_max_err" in first
    assert "mixed_data_err" in first
    assert "fp8_mesh_err" in first and "fp4_mesh_err" in first
    assert "engine_max_err" in second and "cross_mesh_restore_err" in second


def test_logical_axes_put_experts_and_heads_on_their_axes() -> None:
    assert logical_axes("layers.3.ffn.w1", 3) == ("experts", "ffn", None)
    assert logical_axes("layers.3.ffn.w2", 3) == ("experts", None, "ffn")
    assert logical_axes("layers.0.attn.wq_b", 2) == ("heads", None)
    assert logical_axes("layers.0.attn_norm", 1) == (None,)


def test_mesh_specs() -> None:
    import jax
    import pytest

    from ds4jax.model.sharding import default_mesh, parse_mesh
    from tests.model.conftest import small_config

    one = jax.devices()[:1]
    assert dict(parse_mesh("expert=1,tensor=1", one).shape) == {"expert": 1, "tensor": 1}
    assert dict(parse_mesh("tensor=1", one).shape) == {"expert": 1, "tensor": 1}
    for bad in ("tensor=2", "bogus=1", "tensor=x", "expert=0"):
        with pytest.raises(ValueError):
            parse_mesh(bad, one)
    assert default_mesh(small_config(), one) is None  # one device: nothing to place
