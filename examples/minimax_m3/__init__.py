"""A JAX MiniMax M3 inference example over jax_m3sparse's NVFP4 sparse attention.

Modules: ``config`` (sizes), ``model`` (layers, the jitted step), ``checkpoint`` (safetensors),
``engine`` (pages, continuous batching, speculative decoding), ``text`` (bytes <-> tokens,
default prompts), ``report`` (summary and plot). Entry point: ``examples/minimax_m3_generate.py``.
"""
