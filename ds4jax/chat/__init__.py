"""Everything between client JSON and token ids: tokenizers, the official V4 prompt
format, and DSML tool-call rendering and parsing. Pure Python, no JAX."""
