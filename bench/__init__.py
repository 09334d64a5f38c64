"""Benchmarks (`make bench`). Timings live here, never in test assertions."""
