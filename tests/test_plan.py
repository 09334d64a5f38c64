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


def test_data_parallel_search_keeps_the_served_rows_and_grows_sessions_with_data() -> None:
    """Issue 28 on paper: each data shard holds its own sessions, experts over every device.
    The data = 1 rows are today's plan exactly; a shard's room is counted in sessions and
    multiplied by the shards; the routed experts shrink with data × expert, the rest not."""
    kw = dict(devices=64, hbm_gb=16, ctx=65536, sessions=64, weights="fp8", paged="fp8",
              max_batch=64)  # fmt: skip
    served = plan(FLASH, **kw)
    searched = plan(FLASH, **kw, data_parallel=True)
    assert [p for p in searched if p.data == 1] == sorted(
        served, key=lambda p: (-p.sessions_fit, p.total_bytes, -p.expert)
    )
    best = searched[0]
    assert best.sessions_fit == max(p.sessions_fit for p in searched) and best.data > 1
    from ds4jax.kvstore.pages import pages_for
    from ds4jax.model import pages

    page, part = pages.page_bytes(FLASH, "fp8"), pages.session_bytes(FLASH, "fp8")
    per_session = pages_for(65536) * page + 2 * part + page
    for p in searched:
        room = p.usable_bytes - p.weights_bytes - p.batch_bytes
        assert p.sessions_fit == p.data * max(0, room // per_session)
        assert p.states_bytes == -(-64 // p.data) * per_session  # 1/data of the sessions
        assert p.batch_bytes == (64 // p.data) * part
    # the routed experts split over data × expert, the rest replicated along data: with
    # expert=1, tensor=4, bytes = rest + experts / data, so the savings go as 1 − 1/data
    one, two, four = (weight_bytes_per_device(FLASH, 1, 4, "fp8", d) for d in (1, 2, 4))
    assert 2 * (one - four) == 3 * (one - two) and one - two > 0.4 * one
    # linear in data until the replicated weights leave no room
    fits = {p.data: p.sessions_fit for p in searched if p.expert == 1 and p.tensor == 1}
    assert fits[64] > 0 and fits[64] % 64 == 0


def test_data_parallel_reproduces_vllms_dp8_against_tp8_at_1m() -> None:
    """vLLM, V4 on 8×B200 at 1M context: DP8 held 156.9× max concurrency against 20.43×
    for TP8, 7.68× (`shared/reference/paged-state.md` §4). The same arrangements here, with
    fp8 pages: the ratio, since absolute counts depend on each engine's reserve."""
    ps = plan(FLASH, devices=8, hbm_gb=192, ctx=1 << 20, sessions=1, weights="fp8",
              paged="fp8", data_parallel=True)  # fmt: skip
    by = {(p.data, p.expert, p.tensor): p for p in ps}
    dp8, tp8 = by[(8, 1, 1)], by[(1, 1, 8)]
    ratio = dp8.sessions_fit / tp8.sessions_fit
    print(f"DP8 {dp8.sessions_fit} / TP8 {tp8.sessions_fit} sessions of 1M = {ratio:.2f}x")
    assert 7.3 < ratio < 8.0  # below 8: DP replicates the attention weights TP splits
    assert ps[0].data == 8


def test_cli_data_parallel_names_the_arrangement(capsys) -> None:
    argv = ["plan", "--devices", "8", "--hbm-gb", "192", "--ctx", "1048576", "--sessions", "1",
            "--paged-state", "fp8", "--data-parallel"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh: data=8,expert=1,tensor=1" in out and "counted on paper" in out
    assert cli.main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plans"][0]["data"] == 8 and d["plans"][0]["mesh"] == "data=8,expert=1,tensor=1"


def test_weights_per_device_are_what_the_server_places_on_each_mesh() -> None:
    """`plan`'s weights per device against the bytes `param_shardings` puts on one device
    of real meshes (8 CPU devices, a subprocess): the demo's 4 experts on data=4,expert=2
    (their count not dividing data × expert) stay split over expert as the server places
    them — plan counted them whole on every device (6.5 MB against the served 5.0)."""
    import subprocess
    import sys

    from tests.conftest import forced_devices_env

    script = """
import json, math
import jax
from ds4jax.config import load_config
from ds4jax.model.params import param_shapes
from ds4jax.model.sharding import make_mesh, param_shardings
from ds4jax.plan import weight_bytes_per_device
cfg = load_config("demo")
out = []
for data, expert, tensor in ((4, 2, 1), (4, 1, 2), (2, 2, 2), (1, 8, 1), (1, 2, 4)):
    mesh = make_mesh(expert, tensor, data=data)
    shapes = param_shapes(cfg)
    sh = param_shardings(cfg, mesh)
    placed = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(sh)))
    planned = weight_bytes_per_device(cfg, expert, tensor, "f32", data)
    out.append([data, expert, tensor, placed, planned])
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=forced_devices_env(8), timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    for data, expert, tensor, placed, planned in rows:
        assert planned == placed, (data, expert, tensor, placed, planned)
