"""Where retained states live besides the live rows: pages, the host tier, disk checkpoints.

`store` is the interface the engine calls (`KVStore`, `DiskHit`, `NoStore`, `SaveReason`);
`disk.DiskStore` is the Orbax-backed store behind `--kv-disk-dir`, built from `checkpoint`
(one checkpoint's files and checks), `index` (the store's mirror of its directory),
`tool_entries` (which remembered tool calls a text carries), `policy` (ds4's save and
eviction arithmetic), `payload` (the state ↔ arrays mapping) and `fingerprint` (the model
identity it checks); `background` saves off the request path. `pages` is the page pool's
bookkeeping and `page_store` the frontiers kept in pages at rest (`--paged`); `host` the
host-memory tier. Import `ds4jax.kvstore.disk` for the store (Orbax itself loads on first
use).
"""
