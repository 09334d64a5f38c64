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


def test_paged_fp8_states_fit_eight_flash_sessions_of_64k_on_a_v5e_16() -> None:
    """Issue 26's bar, on paper: today's states need 35.1 GB a device there; in fp8 pages
    the 8 sessions (each with its fork point) and the batch fit the 14.4 GB usable."""
    from ds4jax.kvstore.pages import pages_for
    from ds4jax.model import pages

    kw = dict(devices=16, hbm_gb=16, ctx=65536, sessions=8, weights="fp8")
    dense = plan(FLASH, **kw)[0]
    assert not dense.fits and round(dense.total_bytes / 1e9, 1) == 35.1
    paged = plan(FLASH, **kw, paged="fp8")[0]
    page, part = pages.page_bytes(FLASH, "fp8"), pages.session_bytes(FLASH, "fp8")
    assert paged.states_bytes == 8 * ((pages_for(65536) + 1) * page + 2 * part)
    assert paged.batch_bytes == 8 * part  # rows hold no copies: only their small parts
    assert paged.fits and paged.sessions_fit >= 8
    # sessions_fit is exact: that many fit, one more does not
    n = paged.sessions_fit
    assert plan(FLASH, **{**kw, "sessions": n}, paged="fp8")[0].fits
    assert not plan(FLASH, **{**kw, "sessions": n + 1}, paged="fp8")[0].fits
    assert dense.sessions_fit == 0


def test_cli_labels_paged_plans_as_not_yet_served(capsys) -> None:
    argv = ["plan", "--devices", "16", "--hbm-gb", "16", "--ctx", "65536", "--sessions", "8",
            "--weights", "fp8", "--paged-state", "fp8"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "paged fp8 states (as `ds4jax serve --paged --state-dtype fp8` retains them" in out
    assert "fits: yes" in out and "sessions of 65,536 that fit" in out
