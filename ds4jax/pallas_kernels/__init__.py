"""Pallas kernels, each beside its pure-jnp twin (lands with the kernel issue)."""
