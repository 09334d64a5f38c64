"""Disk checkpoints of decode states, keyed by rendered-text prefix.

`store` is the interface the engine calls (`KVStore`, `DiskHit`, `NoStore`); `disk.DiskStore`
is the Orbax-backed store behind `--kv-disk-dir`, `fingerprint.model_fingerprint` the model
identity it checks, `policy` ds4's save and eviction arithmetic, `payload` the state ↔ arrays
mapping. Import `ds4jax.kvstore.disk` for the store (Orbax itself loads on first use).
"""
