"""SmolLM2-135M-Instruct (a real pretrained Llama) on the MiniMax M3 example's engine.

What NVFP4 K/V and top-k block sparsity cost a real model in perplexity; see
examples/real_model_quality.py.
"""
