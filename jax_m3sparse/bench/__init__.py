"""Benchmarks: ``python -m jax_m3sparse.bench {pack,decode,prefill,gfx950-static}``."""
