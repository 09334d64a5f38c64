"""The scheduler's step: which rows step, and the batched program that steps them.

`tick` admits, prefills, and steps every active row in one batched program
(`model.batch.step`, or `paged_step` over the page pool) with per-row sampling, forcing and
stop conditions (`decoding.RowDecoder`); under `stall_bound` a prompt's next chunk rides in
the step (`interleave`). Rows join and leave at step boundaries: a finished row leaves as
its session's frontier and the batch shrinks with its longest row. `Stepping` is a part of
`Engine`, which makes and owns the batch, the rows and their keys (`core`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from ds4jax.decoding import CHOOSE, SAMPLE, token_logprob
from ds4jax.engine.admission import next_chunk
from ds4jax.engine.placement import on_mesh
from ds4jax.engine.ticket import Ticket
from ds4jax.interleave import chunk_limit, next_prefill
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import prefill
from ds4jax.model.sharding import fetch
from ds4jax.sampling import sample_rows

#: folded into a row's key for a `CHOOSE` draw, apart from the step's own split of it
CHOOSE_SALT = 0x4E414D45
#: one row's draw, on the host's copy of its logits
_sample_one = jax.jit(sample_rows)


def draw_among(logits: np.ndarray, ids: Sequence[int], key_data: np.ndarray,
               sampling: tuple[np.ndarray, ...]) -> int:  # fmt: skip
    """One of `ids`, drawn by `sampling` (one row of `sampling_arrays`) from `logits` [V]
    with every other token masked out, keyed by `key_data` folded with `CHOOSE_SALT`."""
    masked = np.full(logits.shape, -np.inf, np.float32)
    ids = np.asarray(ids, np.int64)
    masked[ids] = logits[ids]
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), CHOOSE_SALT)
    return int(np.asarray(_sample_one(masked[None], key[None], *sampling))[0])


def sampling_arrays(size: int) -> tuple[np.ndarray, ...]:
    """A step's per-row (temperature, top_k, top_p, min_p), each off."""
    return (
        np.zeros(size, np.float32),
        np.zeros(size, np.int32),
        np.ones(size, np.float32),
        np.zeros(size, np.float32),
    )


def sampling_row(arrays: tuple[np.ndarray, ...], row: int, ticket: Ticket, vocab_size: int) -> None:
    """Fill `row` of `sampling_arrays` with its request's sampling."""
    sp = ticket.prepared.sampling
    temperature, top_k, top_p, min_p = arrays
    temperature[row], top_k[row], top_p[row], min_p[row] = (
        sp.temperature,
        min(sp.top_k, vocab_size),  # past the vocabulary: all of it, as off
        sp.top_p,
        sp.min_p,
    )


class Stepping:
    """The scheduler's tick, the batched decode step, and rows leaving the batch."""

    @property
    def busy(self) -> bool:
        """Requests waiting, prefilling or decoding."""
        return bool(self.waiting or self._prefilling or any(self._rows))

    @property
    def rows_active(self) -> int:
        """Rows of the decode batch serving a request now."""
        return sum(t is not None for t in self._rows)

    def tick(self, limit: int | None = None) -> None:
        """One scheduler step: admit a waiting request if a row is free (the oldest, or
        beside the prompts in flight a short one: `Admission._next_admission`), evaluate
        the next chunk of one prompt in flight (`_next_prefill`), and step every active
        row. Requests join and leave at step boundaries.

        With `stall_bound`, while rows decode the chunk rides inside their step (a mixed
        step, `model.batch.step`'s `chunk`) and is at most `limit` tokens — by default
        `chunk_limit()`, from the costs measured here — so a long prompt does not stall the
        decoding streams; a batch size whose plain step was not measured yet steps plain
        first. Otherwise the chunk is a program of its own before the step, in whole chunks
        (`limit`: the largest size). A group's followers are handed the leader's `limit`."""
        with self._lock:
            self._drop_withdrawn()
            for gone in [t for t in self._prefilling if t.withdrawn]:
                self._withdraw(gone)
            self._admit()
            size = self._step_size()
            if limit is None:
                limit = self.chunk_limit()
            ticket = self._next_prefill()
            if ticket is not None and not (size and self.stall_bound):
                self._prefilled(ticket)
                self._prefill_chunk(ticket, limit)
                ticket = None
            elif ticket is not None and size not in self.tick_costs.step_s:
                ticket = None  # this tick measures the plain step
            if not any(self._rows):
                return
            t0 = time.perf_counter()
            stepped, chunk = self._decode_step(ticket, limit)
            took = time.perf_counter() - t0
            if not stepped:
                if ticket is not None:  # every row ended before stepping
                    self._prefilled(ticket)
                    self._prefill_chunk(ticket, limit)
            elif chunk:
                self._prefilled(ticket)
                self.tick_costs = self.tick_costs.chunked(
                    chunk, took - self.tick_costs.step_s[stepped])  # fmt: skip
                self.mixed_steps += 1
            else:
                self.tick_costs = self.tick_costs.stepped(stepped, took)

    def _next_prefill(self) -> Ticket | None:
        """The prompt in flight whose chunk this tick evaluates (`interleave.next_prefill`)."""
        if not self._prefilling:
            return None
        return self._prefilling[next_prefill(
            [len(t.tokens) - t.done_tokens for t in self._prefilling],
            [t.passed for t in self._prefilling],
        )]  # fmt: skip

    def _prefilled(self, chosen: Ticket) -> None:
        """A chunk of `chosen` is evaluated this tick: the other prompts in flight count a
        tick passed over (a tick that runs no chunk counts for none)."""
        for t in self._prefilling:
            t.passed = 0 if t is chosen else t.passed + 1

    def _free_rows(self) -> int:
        """Batch rows serving no request."""
        return sum(t is None for t in self._rows)

    def chunk_limit(self) -> int:
        """The most prompt tokens the next tick evaluates (`interleave.chunk_limit`)."""
        return chunk_limit(self.chunk_sizes, self._step_size(), self.tick_costs,
                           self.stall_bound)  # fmt: skip

    def _step_size(self) -> int:
        """The batch size the next decode step runs at (0: no row decodes); with data
        shards always the whole batch, whose blocks of rows are the shards'."""
        active = [i for i, t in enumerate(self._rows) if t is not None]
        if active and self.shards > 1:
            return self.max_batch
        return batch_ops.bucket(active[-1] + 1) if active else 0

    def _shard_rows(self, shard: int) -> range:
        block = self.max_batch // self.shards
        return range(shard * block, (shard + 1) * block)

    def _free_row(self, shard: int | None = None) -> int | None:
        """A free batch row (of `shard`'s block with data shards)."""
        rows = range(self.max_batch) if shard is None else self._shard_rows(shard)
        for i in rows:
            if self._rows[i] is None:
                return i
        return None

    def abort(self, err: Exception) -> None:
        """Fail every request in the scheduler (after a step raised): their rows and the
        batch are dropped; sessions keep their last completed frontiers."""
        with self._lock:
            tickets = [*self.waiting, *self._prefilling, *(t for t in self._rows if t is not None)]
            self.waiting.clear()
            self._prefilling = []
            self._rows = [None] * self.max_batch
            self._release_tables()
            self._batch_span = self.spans[0]
            self._batch = self._new_batch()
        for t in tickets:
            t.fail(err)

    def _decode_step(self, filling: Ticket | None = None, limit: int = 0) -> tuple[int, int]:
        """One batched step for every active row; finished rows leave the batch. `filling`:
        its prompt's next chunk (at most `limit` tokens) rides in the step. With
        speculation on, a step of few enough rows and no chunk is speculative
        (`_speculative_step`). Returns (the step's batch size, the chunk's padded size), 0
        for what did not run."""
        size = self._step_size()
        spec = self.spec
        if (spec is not None and filling is None and 0 < self.rows_active <= self.spec_max_batch
                and not self._logprob_rows() and not self._naming_rows()):  # fmt: skip
            return self._speculative_step(size)
        override = np.full(size, -1, np.int32)
        sampling = sampling_arrays(size)
        stepping, pending = [], set()
        for row, ticket in enumerate(self._rows[:size]):
            if ticket is None:
                continue
            if spec is not None and spec.pending[row] >= 0:  # decided by a speculative step
                override[row] = spec.pending[row]
                pending.add(row)
            else:
                planned = ticket.decoder.plan()
                if planned is None:
                    self._finish_row(row)
                    continue
                override[row] = planned
            sampling_row(sampling, row, ticket, self.cfg.vocab_size)
            if override[row] == CHOOSE:
                override[row] = self._choose(row, ticket, sampling)
            stepping.append(row)
        if not stepping:
            return 0, 0
        if self._bursts(filling, stepping, override):
            self._burst(size, stepping, sampling)
            return 0, 0
        self._grow_batch(stepping, 1)
        self._fit_rows(size)
        grid = None
        if self.pages is not None:
            grid = self._grid(size, stepping)
            stepping = [r for r in stepping if self._rows[r] is not None]
            if not stepping:
                return 0, 0
        chunk, nxt = None, None if filling is None else next_chunk(filling, limit, self.chunk_sizes)
        if nxt is not None:
            done = filling.done_tokens
            padded = np.zeros(nxt[1], np.int32)
            padded[: nxt[0] - done] = filling.tokens[done : nxt[0]]
            chunk = (filling.state, padded, np.int32(nxt[0] - done))
            self.mixed_prompt_tokens += nxt[0] - done
        scored = self._logprob_rows(stepping)
        self._batch, tokens, keys, prompt, scores = self._step(
            self._batch, grid, override, self._keys[:size], *sampling, chunk=chunk,
            logprobs=bool(scored),
        )  # fmt: skip
        tokens, keys = fetch(tokens), fetch(keys)
        if scores is not None:
            scores = tuple(fetch(x) for x in scores)
        for row in stepping:
            self._keys[row] = keys[row]
            ticket = self._rows[row]
            if spec is not None:
                spec.stepped_plain(row)
            if row not in pending:  # a pending token is its decoder's already
                t = int(tokens[row])
                entry = None
                if row in scored:
                    chosen, top, ids = (x[row] for x in scores)
                    k = scored[row]
                    entry = token_logprob(self.tokenizer, t, chosen, ids[:k], top[:k])
                ticket.decoder.accept(t, entry)
            if ticket.on_token is not None:
                ticket.on_token()
            if ticket.decoder.done:
                self._finish_row(row)
        if filling is not None:  # after the rows: a completed prompt takes a row
            if nxt is None:
                self._chunk_done(filling, filling.state, filling.done_tokens)
            else:
                self._chunk_done(filling, prompt, nxt[0])
        return size, 0 if nxt is None else nxt[1]

    @property
    def _bursts_run(self) -> bool:
        """Whether this engine bursts at all (on, dense rows, no speculation): what warm-up
        compiles the bursts for."""
        return self.burst > 1 and self.pages is None and self.spec is None

    def _bursts(self, filling: Ticket | None, stepping: list[int], override: np.ndarray) -> bool:
        """Whether this step is a burst (`model.batch.burst`): on, dense rows that all
        sample, no prompt waiting or prefilling (it would wait the burst out), no
        speculation, no log-probabilities, a row with room for more than one token (a
        burst evaluates all its steps); under `stall_bound` once a plain step of this size
        was measured (a prompt that arrives rides in the next step, at a known cost)."""
        size = len(override)
        return (self._bursts_run and filling is None
                and not self._prefilling and not self.waiting
                and (not self.stall_bound or size in self.tick_costs.step_s)
                and all(override[r] == SAMPLE for r in stepping)
                and max(self._rows[r].decoder.room(self.burst) for r in stepping) > 1
                and not self._logprob_rows(stepping))  # fmt: skip

    def _burst(self, size: int, stepping: list[int], sampling: tuple[np.ndarray, ...]) -> None:
        """Up to `burst` tokens per row in one program; each row's decoder takes them in
        order while it would have sampled them (`RowDecoder.take`), and a row that took
        fewer than the program evaluated steps back to its last (`model.batch.rewind_row`)
        with that token's key, so its state, tokens and key are a plain step's."""
        eos = self.tokenizer.eos_id
        allowed = np.zeros(size, np.int32)
        for row in stepping:
            allowed[row] = max(1, self._rows[row].decoder.room(self.burst))
        self._grow_batch(stepping, int(allowed.max()))
        self._fit_rows(size)
        with on_mesh(self.mesh):
            self._batch, tokens, keys, logits = batch_ops.burst(
                self.params, self._batch, allowed, self._keys[:size], *sampling, np.int32(eos),
                cfg=self.cfg, size=size, steps=self.burst,
            )  # fmt: skip
        self.bursts += 1
        tokens, keys = fetch(tokens), fetch(keys)
        for row in stepping:
            ticket = self._rows[row]
            decoder, start = ticket.decoder, len(ticket.decoder.tokens)
            taken = 0
            for i in range(int(allowed[row])):
                t = int(tokens[i, row])
                if i == 0:
                    decoder.accept(t)
                elif not decoder.take(t):
                    break
                taken += 1
                if ticket.on_token is not None:
                    ticket.on_token()
                if decoder.done:
                    break
            self._keys[row] = keys[taken - 1, row]
            ran = [int(t) for t in tokens[: allowed[row], row]]
            evaluated = ran.index(eos) if eos in ran else len(ran)
            if len(decoder.tokens) - start < evaluated:
                with on_mesh(self.mesh):
                    self._batch = batch_ops.rewind_row(self._batch, np.int32(row),
                                                       np.int32(len(decoder.tokens)),
                                                       logits[taken - 1, row])  # fmt: skip
            if decoder.done:
                self._finish_row(row)

    def _naming_rows(self) -> bool:
        """Whether an active row spells, or may next spell, a call's name
        (`RowDecoder.naming`): it steps plain, never inside a speculative step."""
        return any(t is not None and t.decoder is not None and t.decoder.naming
                   for t in self._rows)  # fmt: skip

    def _choose(self, row: int, ticket: Ticket, sampling: tuple[np.ndarray, ...]) -> int:
        """The token a row draws among its decoder's `choices` (`decoding.CHOOSE`): the
        row's own sampling (`sampling_arrays`' row) over its logits with every other token
        masked out, keyed by the row's key folded with `CHOOSE_SALT` (so a seeded request
        repeats); forced into the step like any other token."""
        return draw_among(fetch(self._batch.logits[row]), ticket.decoder.choices,
                          self._keys[row], tuple(a[row : row + 1] for a in sampling))  # fmt: skip

    def _logprob_rows(self, rows: Sequence[int] | None = None) -> dict[int, int]:
        """The active rows (of `rows`) that report log-probabilities → their k."""
        out = {}
        for row in range(self.max_batch) if rows is None else rows:
            ticket = self._rows[row]
            if ticket is not None and ticket.prepared.sampling.logprobs is not None:
                out[row] = ticket.prepared.sampling.logprobs
        return out

    def _grow_batch(self, stepping: list[int], tokens: int) -> None:
        """The batch's span, grown when a step's `tokens` per row would pass its end."""
        need = self._span(max(len(self._rows[r].decoder.tokens) for r in stepping) + tokens)
        if need > self._batch_span:
            self._resize_batch(need)

    def _step(self, batch: Any, grid: np.ndarray | None, override: np.ndarray,
              *sampling: np.ndarray, chunk: Any = None, logprobs: bool = False,
              ) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
        """One batched step of `len(override)` rows: dense rows, or (`grid`: their page
        tables) rows reading and writing the page pool; `chunk` (`model.batch.Chunk`) rides
        along. Returns (batch, tokens, keys, the chunk's prompt state or None, with
        `logprobs` the step's `model.batch.Logprobs` else None)."""
        size = len(override)
        args = (override, *sampling, np.int32(self.tokenizer.eos_id))
        if self.pages is None:
            with on_mesh(self.mesh):
                out = batch_ops.step(self.params, batch, *args, chunk, cfg=self.cfg, size=size,
                                     logprobs=logprobs)  # fmt: skip
        else:
            with on_mesh(self.mesh):
                out = batch_ops.paged_step(
                    self.params, batch, self.pages.arrays, grid, *args, chunk, cfg=self.cfg,
                    size=size, span=self._batch_span, shards=self.shards, logprobs=logprobs,
                )  # fmt: skip
            self.pages.arrays = out[1]
            out = (out[0], *out[2:])
        batch, tokens, keys, rest = out[0], out[1], out[2], list(out[3:])
        prompt = rest.pop(0) if chunk is not None else None
        return batch, tokens, keys, prompt, rest.pop(0) if logprobs else None

    def _prefill(self, state: Any, tokens: Sequence[int], chunk_sizes: Sequence[int]) -> Any:
        """`state` grown by `tokens` (`forward.prefill`, on the mesh)."""
        with on_mesh(self.mesh):
            return prefill(self.params, state, tokens, self.cfg, chunk_sizes=chunk_sizes)[0]

    def _finish_row(self, row: int) -> None:
        ticket = self._rows[row]
        self._rows[row] = None
        try:
            state = self._row_frontier(row, len(ticket.decoder.tokens))
            result = replace(ticket.decoder.finish(state), **ticket.route_fields())
        except Exception as err:
            ticket.fail(err)
        else:
            ticket.succeed(result)
        finally:
            self._enforce_budget(ticket.session.slot)
            active = [len(t.decoder.tokens) + 1 for t in self._rows if t is not None]
            need = self._span(max(active, default=0))
            if need < self._batch_span:  # the longest row left: the step shrinks with it
                self._resize_batch(need)
