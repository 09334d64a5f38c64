"""`ds4jax plan`: per-device bytes on paper, checked against independent facts (the
published parameter count, the release's own formats, the engine's state size)."""

from __future__ import annotations

import json
import math

import jax

from ds4jax import cli
from ds4jax.config import load_config
from ds4jax.model.params import param_shapes, path_name
from ds4jax.model.state import capacity_bytes
from ds4jax.plan import STATES_PER_SESSION, plan, weight_bytes_per_device

FLASH = load_config("deepseek-v4-flash")


def test_flash_weights_match_the_published_size() -> None:
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(FLASH)))
    assert 283e9 < n < 286e9  # "284B parameters"
    bf16 = weight_bytes_per_device(FLASH, 1, 1, "bf16")
    tid2eid = sum(math.prod(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(
        param_shapes(FLASH)) if path_name(p).endswith("tid2eid"))  # fmt: skip
    assert bf16 == 2 * n + 2 * tid2eid  # int32 tid2eid, bf16 the rest
    fp8 = weight_bytes_per_device(FLASH, 1, 1, "fp8")
    assert 150e9 < fp8 < 165e9  # "~160 GB even as FP8 weights with FP4 experts"
    assert weight_bytes_per_device(FLASH, 1, 1, "f32") == 2 * bf16 - 2 * 2 * tid2eid


def test_shards_divide_and_the_plan_counts_states() -> None:
    whole = weight_bytes_per_device(FLASH, 1, 1, "fp8")
    for expert, tensor in ((8, 1), (1, 8), (2, 4)):
        per = weight_bytes_per_device(FLASH, expert, tensor, "fp8")
        assert whole / 8 <= per < whole / 4  # what stays replicated is small
    plans = plan(FLASH, devices=8, hbm_gb=141, ctx=65536, sessions=4, weights="fp8")
    assert sorted((p.expert, p.tensor) for p in plans) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    best = plans[0]
    assert best.total_bytes == min(p.total_bytes for p in plans) and best.fits
    state = capacity_bytes(FLASH, 65536)
    assert best.states_bytes == STATES_PER_SESSION * 4 * state
    assert best.batch_bytes == 9 * state
    assert best.usable_bytes == int(141e9 * 0.9)


def test_cli_prints_the_plan_and_exits_by_fit(capsys) -> None:
    assert cli.main(["plan", "--devices", "8", "--hbm-gb", "141", "--ctx", "65536"]) == 0
    out = capsys.readouterr().out
    assert "mesh: expert=1,tensor=8" in out and "fits: yes" in out
    argv = ["plan", "--devices", "8", "--hbm-gb", "16", "--ctx", "65536", "--json"]
    assert cli.main(argv) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["devices"] == 8 and not d["plans"][0]["fits"] and len(d["plans"]) == 4
    assert cli.main(["plan", "--devices", "8", "--hbm-gb", "16", "--sessions", "0"]) == 1
