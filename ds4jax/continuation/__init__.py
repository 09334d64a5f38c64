"""Which already-evaluated state a request continues from, decided before any model work.

No JAX here: the decision (`decide`, `pool`) is plain data and pure functions, so every rule
is a table-driven test; the engine owns the device states and applies what is decided.

* `types`: the values decided on — `LiveFrontier`, the tool and thinking `Bindings`,
  `RequestView`, `Decision` / `Rejection`, `CacheSource`;
* `evidence`: what a conversation says before tokenizing (the tool_result ids it answers,
  its trailing tool-result turn, exact replay of remembered tool calls);
* `decide`: the ladder — live tool output, visible thinking, live token or text prefix,
  fork point, disk, cold — first match wins, or a 409 that asks for the full history;
* `pool`: resident sessions and fork points, routing a request to one, and what to evict
  under the state-memory budget;
* `tool_memory`: tool id → the exact DSML bytes sampled, so a replayed call renders as the
  model wrote it; `reasoning_seal`: the Responses API's sealed reasoning, so a stateless
  replay renders it byte for byte.
"""
