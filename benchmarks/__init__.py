"""Developer benchmarks that need the source checkout (FlyDSL kernel sources, the emulator layer);
run from the repository root as ``python -m benchmarks.<name>``. The installed package's own
tables are ``python -m jax_m3sparse.bench``."""
