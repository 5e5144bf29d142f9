"""MiniMax M3's text model in JAX, served over jax_m3sparse's NVFP4 sparse attention.

Modules, one concern each: ``config`` (transformers' config fields, config.json), ``model``
(params, caches, layers, the jitted step), ``attention`` (RoPE, q/k/v, the indexer, paged
caches), ``moe`` (swiglu-oai MLPs, router, experts, their tensor-parallel map), ``checkpoint``
(lazy loading of checkpoint directories, both namings, FP8 blocks; writing), ``parallel``
(shardings), ``plan`` (``--dry-run``), ``engine`` (pages, continuous batching, speculative
decoding), ``text`` (tokenizers, default prompts), ``report`` (summary and plot). Entry point:
``examples/minimax_m3_generate.py``.
"""
