"""Model and engine configuration of the example."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A MiniMax M3-shaped decoder, small enough for a CPU.

    The attention geometry is M3's (D = 128, G = Hq/Hkv = 16, RoPE on 64 of 128 dims,
    theta 5e6, 128-token blocks, top-16 blocks); width, depth and the MLP are shrunk, and
    the MLP is a dense SwiGLU (the real model uses a mixture of experts).
    """

    vocab_size: int = 256            # byte-level tokenizer
    hidden_size: int = 1024
    num_layers: int = 4
    num_dense_layers: int = 1        # the first layers attend densely (all blocks)
    num_heads: int = 16              # Hq
    num_kv_heads: int = 1            # Hkv
    head_dim: int = 128              # D
    rope_dim: int = 64               # RoPE on the first 64 dims of each head
    rope_theta: float = 5e6
    intermediate_size: int = 1536    # SwiGLU width
    index_head_dim: int = 128        # Di of idx_q / idx_k
    topk_blocks: int = 16            # K
    block_size: int = 128            # N
    rms_eps: float = 1e-6
    kv_replicas: int = 1             # copies of each KV head in the cache (TP > Hkv, see --tp)

    def __post_init__(self):
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"num_dense_layers ({self.num_dense_layers}) must be in "
                             f"[0, num_layers = {self.num_layers}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim ({self.rope_dim}) must be even and <= head_dim")

    @property
    def cache_kv_heads(self) -> int:
        """KV heads the NVFP4 cache holds: each model KV head ``kv_replicas`` times
        (jax_m3sparse.sharding.replicate_kv_heads), so every TP device owns whole heads."""
        return self.num_kv_heads * self.kv_replicas

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - self.num_dense_layers
