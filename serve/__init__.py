"""`ds4jax serve`: the HTTP server in front of the engine, for agents that speak Anthropic
Messages (`/v1/messages`), OpenAI Responses (`/v1/responses`) or Chat Completions
(`/v1/chat/completions`).

Requests are parsed and rendered by `ds4jax.chat` and served by `ds4jax.engine`; this
package holds only what HTTP adds, so the engine is the same one notebooks and benchmarks
drive:

* `main`: the command's flags, loading the model, Hypercorn;
* `app`: the Quart routes, thin, with each protocol's error shape;
* `worker`: the one thread that steps the engine, bridged back to asyncio;
* `protocol`, `responses_wire`, `chat_wire`: each protocol's responses and SSE events, pure
  functions of engine results;
* `openapi`: `/openapi.json` and `/docs`, from the request schemas requests are checked
  against; `metrics` and `logs`: `/metrics` and the log lines operators read.
"""
