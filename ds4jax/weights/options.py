"""The command-line options that say how to load a model, shared by every command that
loads one: the `ds4jax` subcommands (`ds4jax.cli`) and the server (`serve.main`).

They live below both so that the server does not import the CLI that dispatches to it,
and so that the two spell each flag, its choices and its help once. Only `argparse` is
imported: `--help` must not pay for JAX or Orbax (whose import also takes over logging
before `serve` configures it).
"""

from __future__ import annotations

import argparse


def add_weights(sp: argparse.ArgumentParser) -> None:
    # the names `checkpoint.WEIGHTS` maps (not imported: see the module docstring)
    sp.add_argument(
        "--weights", choices=["f32", "bf16", "fp8", "fp4-experts"], default="f32",
        help="f32 (default), bf16 (both dequantize a release at load), fp8: the official "
        "release's FP8 linears and FP4 experts stay so on device, expanded inside the step, "
        "or fp4-experts: only the routed experts stay FP4 (two per byte), the rest f32 "
        "values (held in bf16 where every value is a bf16 value)",
    )  # fmt: skip


def add_attention_impl(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--attention-impl", choices=["auto", "xla", "pallas"], default=None,
        help="attention: the config's (default; usually auto: per op the faster measured "
        "choice on this platform), xla (jnp twins) or pallas (the kernels)",
    )  # fmt: skip


def add_mesh(sp: argparse.ArgumentParser) -> None:
    # what `model.sharding.mesh_for` reads from it
    sp.add_argument(
        "--mesh", default=None,
        help="[data=D,]expert=E,tensor=T: shard the params over a device mesh (data: split "
        "the decode batch's rows, the routed experts over data × expert, the other params "
        "replicated along data); 'none': one device (default: every device on the tensor "
        "axis where the shapes divide)",
    )  # fmt: skip


def add_hub_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--revision", default=None,
        help="a Hugging Face Hub repo id's branch, tag or commit (default main)",
    )  # fmt: skip
    sp.add_argument(
        "--download-dir", default=None,
        help="the Hugging Face cache a repo id is read from and fetched into (default "
        "HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )  # fmt: skip
