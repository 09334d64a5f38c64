"""The shipped demo model's trained MTP block (issue 29): it is in the checkpoint, read only
on request (the model's own weights as they were before it was added, bit for bit), and
its drafts are the model's own greedy tokens most of the time on held-out prompts — where
random block weights almost never are. `train_mtp` runs end to end on a tiny setting."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.render import render
from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.demo.corpus import held_out_tasks, request_body
from ds4jax.demo.train import DEMO_DIR
from ds4jax.demo.train_mtp import main
from ds4jax.model.params import Params, init_params, param_shapes, path_name
from ds4jax.model.speculative import generate_greedy
from ds4jax.weights.checkpoint import load_model, read_metadata, restore_params

#: sha256 over (leaf name, dtype, bytes) of the model's weights as shipped before the block
#: was trained into the checkpoint: the block changed none of them
MAIN_DIGEST = "d6a2c8d2a898b7f76b6d2f74f3164d77407c084d247f8658c22f4490594839a7"


def digest(params: Params) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(leaf)
        h.update(path_name(path).encode())
        h.update(str(a.dtype).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def test_the_shipped_checkpoint_has_a_trained_block() -> None:
    assert read_metadata(DEMO_DIR)["mtp_layers"] == 1
    record = json.loads((DEMO_DIR / "training.json").read_text())
    assert {"settings", "final_loss", "train_seconds"} <= set(record)  # the model's own
    held = record["mtp"]["held_out"]
    assert held["trained"]["mtp_agrees"] >= 0.9 > 0.1 >= held["random_init"]["mtp_agrees"]


def test_loading_without_asking_gives_the_model_as_it_was() -> None:
    _, params = restore_params(DEMO_DIR)
    assert "mtp" not in params and digest(params) == MAIN_DIGEST
    _, served, *_ = load_model(DEMO_DIR, load_tokenizer=load_tokenizer)
    assert "mtp" not in served and digest(served) == MAIN_DIGEST


def test_loading_with_the_block() -> None:
    cfg, params = restore_params(DEMO_DIR, mtp=True)
    assert jax.tree.structure(params) == jax.tree.structure(param_shapes(cfg, mtp_layers=1))
    assert digest({k: v for k, v in params.items() if k != "mtp"}) == MAIN_DIGEST
    _, served, *_ = load_model(DEMO_DIR, mtp=True, load_tokenizer=load_tokenizer)
    assert digest(served["mtp"]) == digest(params["mtp"])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Held-out prompts (templates training never saw), two of each scored kind."""
    _, _, tok, _ = load_model(DEMO_DIR, load_tokenizer=load_tokenizer)
    out = []
    for kind in ("single", "parallel", "followup", "refusal"):
        for task in held_out_tasks(2, 1_000_003, kind):
            body = request_body(task, thinking=True, system=None)
            out.append(tok.encode_segments(render(parse_messages_request(body).conversation)))
    return out


def test_the_trained_block_drafts_the_models_tokens(prompts: list[list[int]]) -> None:
    """Greedy speculative decoding's acceptance (drafts kept / steps) over 32 tokens of
    each prompt: measured 1.00 (128 of 128 drafts kept) with the trained block, 0.03 with
    random block weights; the tokens are plain greedy decoding's either way."""
    cfg, params = restore_params(DEMO_DIR, mtp=True)
    rand = {**params, "mtp": init_params(cfg, 0, mtp_layers=1)["mtp"]}
    rate = {}
    for name, p in (("trained", params), ("random", rand)):
        runs = [generate_greedy(p, cfg, prompt, 32, 1024) for prompt in prompts]
        rate[name] = sum(r.accepted for r in runs) / sum(r.steps for r in runs)
        rate[name + " tokens"] = [r.tokens for r in runs]
    assert rate["trained tokens"] == rate["random tokens"]
    assert rate["trained"] >= 0.8 and rate["trained"] > rate["random"] + 0.6, rate


def test_train_mtp_end_to_end(tmp_path: Path) -> None:
    """A few steps on a few conversations, into a new directory: the model's weights are
    the source's bit for bit, the block is there, and the tokenizer and the source's
    training record come along with the block's record added."""
    out = tmp_path / "demo"
    args = ["--out", str(out), "--examples", "16", "--steps", "2", "--batch", "2",
            "--warmup", "1", "--suffix-lens", "384", "--eval-examples", "0"]  # fmt: skip
    assert main(args) == 0
    _, params = restore_params(out)
    assert digest(params) == MAIN_DIGEST
    _, full = restore_params(out, mtp=True)
    _, shipped = restore_params(DEMO_DIR, mtp=True)
    assert jax.tree.structure(full["mtp"]) == jax.tree.structure(shipped["mtp"])
    assert digest(full["mtp"]) != digest(shipped["mtp"])  # 2 steps: not the shipped block
    assert (out / "demo.model").read_bytes() == (DEMO_DIR / "demo.model").read_bytes()
    record = json.loads((out / "training.json").read_text())
    shipped_record = json.loads((DEMO_DIR / "training.json").read_text())
    assert {k: v for k, v in record.items() if k != "mtp"} == {
        k: v for k, v in shipped_record.items() if k != "mtp"
    }
    assert (
        record["mtp"]["settings"]["steps"] == 2 and len(record["mtp"]["loss_every_10_steps"]) == 1
    )
    assert record["mtp"]["held_out"] == {"trained": None, "random_init": None}
