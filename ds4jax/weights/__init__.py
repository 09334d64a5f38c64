"""Weights apart from math: where a checkpoint comes from (a directory, a named config, a
Hugging Face Hub repo id), its layouts (transformers', the official FP8/FP4 release, our Orbax
params), reading and converting them into the parameter pytree of `ds4jax.model.params`, and
the flags every command that loads a model shares. `ds4jax.model` holds the forward pass,
the state and the layers — including `model.quantized`, the release formats as the step
reads them — and imports nothing from here."""
