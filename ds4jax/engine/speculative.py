"""Speculative steps in the engine (`speculative="mtp"`): the glue between the decode batch
and `ds4jax.speculation.Speculator`.

A step of few enough rows, none asking for log-probabilities and no prompt chunk riding
along, drafts with the MTP block and verifies (`model.speculative.verify_rows`, or
`paged_verify_rows`); the rows' tables are cut back to what they evaluated. Apart from
`stepping` because none of it runs without `--speculative`; `Speculating` is a part of
`Engine` (`core`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np

from ds4jax.engine.placement import place_state
from ds4jax.engine.stepping import sampling_arrays, sampling_row
from ds4jax.model.speculative import draft_rows, paged_verify_rows, verify_rows
from ds4jax.speculation import SAMPLE, Speculator, default_max_batch


class Speculating:
    """Turning speculation on, and the speculative step."""

    def _speculate(self, kind: str, max_batch: int | None) -> None:
        if kind != "mtp":
            raise ValueError(f"unknown speculative method {kind!r} (one: mtp)")
        if "mtp" not in self.params:
            raise ValueError("--speculative mtp needs the model's MTP block, and these "
                             "weights have none (`mtp.*` in the release)")  # fmt: skip
        if self.mesh is not None:
            raise ValueError("--speculative mtp runs on one device in this version: not "
                             "with a mesh (--mesh none)")  # fmt: skip
        self.spec = Speculator(self.cfg, self.max_batch, partial(place_state, self.mesh))
        self.spec_max_batch = default_max_batch() if max_batch is None else max_batch

    def _warm_speculative(self, batch: Any, grid: np.ndarray, size: int,
                          sampling: tuple[np.ndarray, ...]) -> Any:  # fmt: skip
        """Compile the speculative step of `size` rows (verify, then the block's drafts)
        on the throwaway `batch` (returned, donated on) and a throwaway window: the first
        request with speculation on waited 6–7 s for them on an empty compile cache. Every
        row samples and no draft is used; with pages, `grid`'s null tables read and write
        nothing."""
        first, second = np.full(size, SAMPLE, np.int32), np.full(size, -1, np.int32)
        mtp, drafts = self.spec.empty()
        args = (first, second, drafts, np.zeros(size, bool), *sampling,
                np.int32(self.tokenizer.eos_id))  # fmt: skip
        if self.pages is None:
            batch, out = verify_rows(self.params, batch, *args, cfg=self.cfg, size=size)
        else:
            batch, self.pages.arrays, out = paged_verify_rows(
                self.params, batch, self.pages.arrays, grid, *args, cfg=self.cfg, size=size,
                span=self._batch_span,
            )  # fmt: skip
        zeros = np.zeros(size, np.int32)
        jax.block_until_ready(draft_rows(self.params, mtp, drafts, out[-1],
                                         np.zeros((size, 2), np.int32), zeros, zeros,
                                         cfg=self.cfg, size=size))  # fmt: skip
        return batch

    def _speculative_step(self, size: int) -> tuple[int, int]:
        """`_decode_step` as a speculative step (`speculation.Speculator.step`)."""
        spec, eos = self.spec, self.tokenizer.eos_id
        sampling = sampling_arrays(size)
        plans, decoders = {}, {}
        for row, ticket in enumerate(self._rows[:size]):
            if ticket is None:
                continue
            plan = spec.plan_row(row, ticket.decoder, eos)
            if plan is None:
                self._finish_row(row)
                continue
            sampling_row(sampling, row, ticket, self.cfg.vocab_size)
            plans[row], decoders[row] = plan, ticket.decoder
        if not plans:
            return 0, 0
        self._grow_batch(list(plans), 2)
        self._fit_rows(size)
        grid = None
        if self.pages is not None:
            grid = self._grid(size, list(plans), 2)
            plans = {r: p for r, p in plans.items() if self._rows[r] is not None}
            if not plans:
                return 0, 0

        def verify(*args: Any) -> Any:
            if grid is None:
                self._batch, out = verify_rows(self.params, self._batch, *args, cfg=self.cfg,
                                               size=size)  # fmt: skip
                return out
            self._batch, self.pages.arrays, out = paged_verify_rows(
                self.params, self._batch, self.pages.arrays, grid, *args, cfg=self.cfg,
                size=size, span=self._batch_span,
            )  # fmt: skip
            return out

        keys, finished = spec.step(self.params, verify, plans, decoders, sampling,
                                   self._keys[:size], eos, size)  # fmt: skip
        for row in plans:
            self._keys[row] = keys[row]
            ticket = self._rows[row]
            if grid is not None:  # the table back to what the row evaluated
                held = spec.position(row, ticket.decoder)
                if held < self._tables[row].tokens:
                    self._tables[row] = self.pages.pool.trim(self._tables[row], held)
            if ticket.on_token is not None:
                ticket.on_token()
        for row in finished:
            self._finish_row(row)
        return size, 0
