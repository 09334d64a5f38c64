"""The engine: the single owner of the params and of every retained state.

A request: validate (`prepare`, on the client's thread) → `submit` → the scheduler
(`tick`, one thread at a time under a lock; the server gives it one worker thread) routes
it (`continuation.pool.route`: a session and a decision) → prefills the suffix one chunk
per step (while other rows decode, a bounded chunk inside their step: `interleave`) →
retains the prompt-end state as a fork point → decodes it in a row of the batched step
(`model.batch`) beside every other active request, with sampling, forcing and stop
conditions per row (`decoding.RowDecoder`) and events through the streaming DSML
parser → updates that session's frontier and bindings → drops what the state budget no
longer holds (`pool.evictions`, saved to disk first when a store is configured). A live
frontier is replaced, never mutated, and only after the step that produced it finished; a
cancelled or failed request leaves a consistent frontier (the last evaluated token); one
cancelled before it had a row replaces no session (dropped unrouted while it waited, or
its prefilled prefix kept as a fork point). Fork
points hold prompt ends only, never a state that would paper over a tool-id mismatch.

With a page pool (`paged_pages`, `serve --paged`) retained frontiers are page tables and
small parts (`kvstore.page_store`), and so are the decode rows: a row holds its own
references to the prompt end's pages and grows its table by a token before each step
(`PagePool.advance`, which copies a partial page another frontier wrote past), the step
reads and writes pages through the tables (`model.batch.paged_step`), and the row leaves
as a frontier of its pages, no row copied. A row the full pool cannot grow, even after
fork points and idle sessions gave up what they alone held, ends with a 529.

`Engine(...)` alone is the single-session engine of the original rules (one session, no
fork points, one request at a time); `ds4jax serve` runs it with `--sessions` (default 4),
fork points on and `--max-batch` (default 8).

The package, by what each part holds or works on:

- `requests`: the request types and errors (`Prepared`, `SamplingParams`, `EngineError`),
  at the bottom: `decoding` names them, and the engine imports `decoding`;
- `prepare`: a converted request to a `Prepared` one (validation, render, tokens);
- `ticket`: one request in the scheduler;
- `core`: `Engine`, the owner — the states it makes, warm-up, the client entry points;
- `sessions`: sessions, frontiers, fork points, the state budget, the host tier, saves;
- `admission`: routing, the base state, the chunked prefill up to a row;
- `stepping`: the tick and the batched step, rows leaving the batch;
- `speculative`: the speculative step's glue (`ds4jax.speculation`);
- `paging`: the rows' page tables and frontiers kept as pages;
- `placement`: where states, the batch and the page pool live on the mesh.
"""

from ds4jax.decoding import Result, TokenLogprob, ToolCallStarted
from ds4jax.engine.core import Engine
from ds4jax.engine.requests import EngineError, Prepared, SamplingParams

__all__ = [
    "Engine",
    "EngineError",
    "Prepared",
    "Result",
    "SamplingParams",
    "TokenLogprob",
    "ToolCallStarted",
]
