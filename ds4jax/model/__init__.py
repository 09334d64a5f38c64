"""DeepSeek V4 in functional JAX: params, decode state, forward, loading, sharding."""
