"""Speculative decoding in the engine's batch (issue 29): the MTP block drafts, a step
verifies, the host's decoders run one token ahead of the device.

`Speculator` holds what speculation adds to the decode batch — each row's MTP window state
and draft (on device), and on the host each row's *pending* token: decided (sampled by the
previous step, or forced) and given to its decoder, not yet evaluated. A step
(`model.speculative.verify_rows`) evaluates a row's pending token and the one after it —
the block's draft when the decoder would sample there, the forced token when it forces
one — and draws the token after what it kept, which becomes the next pending one. So a
row gains one or two tokens a step, each distributed exactly as plain decoding's (greedy:
the same tokens; see `model.speculative` for the rejection rule), and every state a row
leaves with has evaluated exactly the tokens its decoder holds — the same frontier plain
decoding leaves, so live tool continuation, forks and disk checkpoints see no difference.

The decoders are driven through `plan()` / `accept(t)` / `done` / `tokens`, as the plain
step drives them (`decoding.RowDecoder`): a decoder only ever sees tokens in order, each
accepted once. A row's evaluated length is `len(tokens)`, less its pending token.

The block's window starts at a row's first speculative step and follows the row while it
speculates; a plain step (the gate closed it, a prompt chunk rode along) restarts it, so
drafts right after see a short window — which costs acceptance, never exactness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.decoding import CHOOSE, SAMPLE
from ds4jax.model import batch as batch_ops
from ds4jax.model.speculative import Verify, draft_rows

#: the largest batch a speculative step runs at by default, per platform: measured with
#: `python -m bench speculative` (CPU, 2026-12-05: no batch size pays — see docs/batching.md,
#: "Speculative decoding"). GPU and TPU were not measured here (no device was lent); their
#: entries follow vLLM/SGLang's reports that V3/V4 MTP pays at low concurrency.
DEFAULT_MAX_BATCH = {"cpu": 0, "gpu": 4, "tpu": 4}


def default_max_batch() -> int:
    return DEFAULT_MAX_BATCH.get(jax.default_backend(), 0)


class Planner(Protocol):
    """What a step asks of a row's decoder (`decoding.RowDecoder` is one)."""

    tokens: list[int]

    @property
    def done(self) -> bool: ...

    def plan(self) -> int | None: ...

    def accept(self, t: int) -> None: ...


@dataclass
class SpecCounts:
    """What speculation did, for /metrics and the stats line."""

    steps: int = 0  # speculative steps run
    row_steps: int = 0  # rows they stepped
    proposed: int = 0  # drafts verified
    accepted: int = 0  # drafts kept
    forced: int = 0  # forced second tokens (kept without a draft)
    tokens: int = 0  # tokens the steps decided


@dataclass
class Plan:
    """One row's part in a step (host side)."""

    first: int  # its pending token, or SAMPLE
    at: int  # its evaluated length: where `first` goes
    second: int = -1  # a forced token after it (−1: none)
    draft: bool = False  # the block's draft goes after it


class Speculator:
    def __init__(self, cfg: Config, rows: int, place: Any) -> None:
        """`rows`: the decode batch's capacity; `place`: how the engine places a state."""
        self.cfg = cfg
        self._rows, self._place = rows, place
        self.mtp, self.drafts = self.empty()
        self.pending = [-1] * rows
        #: where each row's window started, and the position it has run up to (−1: none)
        self.start = [0] * rows
        self.ran_to = [-1] * rows
        self.counts = SpecCounts()

    def empty(self) -> tuple[Any, jax.Array]:
        """The block's window state and the drafts of every row, empty and placed as the
        step's are (also the throwaway pair `Engine.warm_up` compiles the step on)."""
        mcfg = self.cfg.mtp_block()
        state = batch_ops.empty_batch(mcfg, mcfg.sliding_window, self._rows).layers[0]
        return self._place(state), self._place(jnp.full(self._rows, -1, jnp.int32))

    # -------------------------------------------------------------- bookkeeping

    def admit(self, row: int) -> None:
        self.pending[row], self.ran_to[row] = -1, -1

    def position(self, row: int, dec: Planner) -> int:
        """The row's evaluated length: its decoder's tokens less the pending one."""
        return len(dec.tokens) - (self.pending[row] >= 0)

    def stepped_plain(self, row: int) -> None:
        """After a plain step evaluated the row's pending token (or sampled one): the
        window does not follow plain steps."""
        self.pending[row], self.ran_to[row] = -1, -1

    # -------------------------------------------------------------- one step

    def plan_row(self, row: int, dec: Planner, eos: int) -> Plan | None:
        """The row's part in the next step, or None: it is finished (nothing to evaluate)."""
        if self.pending[row] < 0:
            planned = dec.plan()
            if planned is None:
                return None
            if planned == CHOOSE:  # the engine steps a naming row plain (`_naming_rows`)
                raise RuntimeError(f"row {row} spells a call's name: it cannot speculate")
            if planned == SAMPLE:
                return Plan(SAMPLE, self.position(row, dec))
            dec.accept(planned)
            self.counts.tokens += 1
            if planned == eos:
                return None
            self.pending[row] = planned
        plan = Plan(self.pending[row], self.position(row, dec))
        if dec.done:
            return plan  # its last token is evaluated, then it leaves
        nxt = dec.plan()
        if nxt is None or nxt == CHOOSE:  # a name's token: drawn in a plain step
            return plan
        if nxt != SAMPLE:
            dec.accept(nxt)
            self.counts.tokens += 1
            plan.second = nxt
        elif self.ran_to[row] == plan.at:
            plan.draft = True
        return plan

    def step(
        self,
        params: Any,
        verify: Callable[..., Verify],
        plans: dict[int, Plan],
        decoders: dict[int, Planner],
        sampling: tuple[np.ndarray, ...],
        keys: np.ndarray,
        eos: int,
        size: int,
    ) -> tuple[np.ndarray, list[int]]:
        """One speculative step of rows [0, size) (`plans`: the stepping rows' parts,
        `plan_row`). `verify(*args)` runs the step's program over `model.speculative.Verify`'s
        arguments on whatever holds the rows (`verify_rows`, `paged_verify_rows`) and
        returns its outputs. Returns (next key data [size, 2], the rows that finished)."""
        first = np.full(size, SAMPLE, np.int32)
        second = np.full(size, -1, np.int32)
        use_draft = np.zeros(size, bool)
        for row, plan in plans.items():
            first[row], second[row], use_draft[row] = plan.first, plan.second, plan.draft
        t, x, kept, y, keys, X = verify(first, second, self.drafts, use_draft, keys, *sampling,
                                        np.int32(eos))  # fmt: skip
        t, x, kept, y, keys = jax.device_get((t, x, kept, y, keys))
        self.counts.steps += 1
        self.counts.row_steps += len(plans)
        after = np.zeros((size, 2), np.int32)
        count = np.zeros(size, np.int32)
        n = np.zeros(size, np.int32)
        finished = []
        for row, plan in plans.items():
            dec = decoders[row]
            n0 = plan.at
            decided = 0
            if plan.first == SAMPLE:
                dec.accept(int(t[row]))
                decided += 1
            evaluated = int(t[row] != eos)
            two = False
            if plan.second >= 0:
                self.counts.forced += 1
                two = evaluated and plan.second != eos
            elif plan.draft:
                self.counts.proposed += 1
                if kept[row]:
                    self.counts.accepted += 1
                    dec.accept(int(x[row]))
                    decided += 1
                    two = evaluated and int(x[row]) != eos
            evaluated += two
            self.pending[row] = -1
            if not dec.done:
                nxt = dec.plan()
                if nxt is not None and nxt != CHOOSE:  # a name's token: the next plain step's
                    token = int(y[row]) if nxt == SAMPLE else nxt
                    dec.accept(token)
                    decided += 1
                    if token != eos:
                        self.pending[row] = token
            self.counts.tokens += decided
            if dec.done and self.pending[row] < 0:
                finished.append(row)
            # the block runs over the evaluated positions whose next token is known
            follow = [int(x[row])] if two else []
            if self.pending[row] >= 0:
                follow.append(self.pending[row])
            count[row] = min(evaluated, len(follow))
            after[row, : len(follow)] = follow[:2]
            if self.ran_to[row] != n0:
                self.start[row] = n0
            n[row] = n0 - self.start[row]
            self.ran_to[row] = n0 + int(count[row]) if count[row] == evaluated else -1
        self.mtp, self.drafts = draft_rows(params, self.mtp, self.drafts, X, after, count, n,
                                           cfg=self.cfg, size=size)  # fmt: skip
        return keys, finished
