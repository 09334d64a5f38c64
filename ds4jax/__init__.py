"""ds4jax: a JAX research engine and Anthropic Messages shim for DeepSeek V4."""

__version__ = "0.1.0"
