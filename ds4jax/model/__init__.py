"""DeepSeek V4 in functional JAX: config, params, decode state, forward (lands with the model issue)."""
