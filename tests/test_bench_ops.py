"""`bench.ops.count_ops`, the operations a compiled program runs (issue 27), on programs
whose count follows from their structure: a loop's body counts once per iteration, a
conditional counts one branch (the smallest in `total`, the largest in `most`), and the
free instructions count nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench.ops import count_ops

X = jnp.arange(64.0).reshape(8, 8)


def _ops(f, *args):
    return count_ops(jax.jit(f).lower(*args).compile().as_text())


def _loop(trips: int):
    def body(_i, x):
        # a reduction feeding an elementwise op and a dot: kernels XLA cannot merge away
        return jnp.tanh(x @ x / (jnp.sum(x, axis=0, keepdims=True) + 1.0))

    return lambda x: jax.lax.fori_loop(0, trips, body, x)


def test_a_loop_counts_its_body_once_per_iteration() -> None:
    three, six, nine = (_ops(_loop(n), X) for n in (3, 6, 9))
    per_three = six.total - three.total
    assert per_three > 0 and nine.total - six.total == per_three
    assert per_three % 3 == 0  # three iterations of the same body
    assert three.unknown_loops == six.unknown_loops == 0


def test_a_conditional_counts_one_branch_smallest_and_largest() -> None:
    def f(p, x):
        heavy = lambda x: _loop(5)(x)  # noqa: E731
        return jax.lax.cond(p, heavy, lambda x: x + 1.0, x)

    both = _ops(f, jnp.bool_(True), X)
    heavy = _ops(_loop(5), X)
    assert both.total < heavy.total <= both.most
    assert both.by_kind["conditional"] == 1


FREE_AND_ONE_KERNEL = """HloModule m

%fused (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%a)
}

ENTRY %main (p: f32[4]) -> (f32[4], f32[2,2]) {
  %p = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  %b = f32[2,2]{1,0} bitcast(%p)
  %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
  %g = f32[4]{0} get-tuple-element(%x), index=0
  ROOT %t = (f32[4]{0}, f32[2,2]{1,0}) tuple(%f, %b)
}
"""


def test_free_instructions_count_nothing_and_a_fusion_one() -> None:
    ops = count_ops(FREE_AND_ONE_KERNEL)
    assert ops.total == ops.most == 1 and dict(ops.by_kind) == {"fusion kLoop": 1}
    assert _ops(lambda x: jnp.tanh(x) * 2.0, X).total == 1  # compiled: one fused kernel


def test_the_decode_step_is_counted_on_the_tiny_model() -> None:
    from bench.ops import decode_step_ops
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    ops = decode_step_ops(cfg, init_params(cfg, 0), init_state(cfg, 512), 1)
    # every layer runs at least its attention and MoE matmuls, each hc_pre a Sinkhorn loop
    assert ops.total > 10 * cfg.num_layers and ops.unknown_loops == 0
    assert ops.by_kind["dot"] + ops.by_kind["fusion kCustom"] >= 2 * cfg.num_layers


@pytest.mark.parametrize("text", ["", "HloModule m\n"])
def test_text_without_an_entry_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="no ENTRY"):
        count_ops(text)
