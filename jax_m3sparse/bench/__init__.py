"""Benchmarks: ``python -m jax_m3sparse.bench {peak,pack,decode,prefill,select,all}``."""
