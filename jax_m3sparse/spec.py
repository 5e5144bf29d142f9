"""Cache geometry (SPEC §1, §3): :class:`KVCacheSpec`, byte offsets, supported shapes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("LBHNC", "BLHNC")
"""5-D cache layouts (SPEC §3.3): [L, P, 2Hkv, N, C] or [P, L, 2Hkv, N, C]."""

NVFP4_GROUP = 16
"""Elements per E4M3 block scale (SPEC §2.1)."""


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of an NVFP4 paged KV cache (SPEC §3.1).

    Args:
      num_kv_heads: Hkv, KV heads the cache stores (the global count for a cache sharded over
        devices: jax_m3sparse.sharding.tp_cache_spec).
      head_dim: D, a multiple of 32 (128 for MiniMax M3).
      block_size: N, tokens per page (= tokens per sparse block); 128, the one value every
        op serves (SPEC §1), so any other is rejected here rather than by every op later.

    Slot ``2h`` of a page holds K of KV head ``h``, slot ``2h + 1`` its V. Each
    (page, slot) tile is ``N * full_dim`` bytes: the data plane (``D/2`` bytes per
    token) then the scale plane (``D/16`` bytes per token), SPEC §3.2.
    """

    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 128

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {v!r}")
        if self.head_dim % 32:
            raise ValueError(f"KVCacheSpec.head_dim must be a multiple of 32, got {self.head_dim}")
        if self.block_size != 128:
            raise ValueError(f"KVCacheSpec.block_size must be 128 (SPEC §1: the ops serve "
                             f"N = 128 only), got {self.block_size}")

    @property
    def num_head_slots(self) -> int:
        """2·Hkv: one K and one V slot per KV head."""
        return 2 * self.num_kv_heads

    @property
    def full_dim(self) -> int:
        """Bytes per token and head slot: D/2 data + D/16 scales (72 for D = 128)."""
        return self.head_dim // 2 + self.head_dim // NVFP4_GROUP

    @property
    def tile_bytes(self) -> int:
        """Bytes of one (page, slot) tile: N · full_dim."""
        return self.block_size * self.full_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer: 2·Hkv · N · full_dim."""
        return self.num_head_slots * self.tile_bytes

    def cache_shape(self, num_pages: int, num_layers: int | None = None,
                    layout: str = "LBHNC") -> tuple[int, ...]:
        """Shape of a one-layer (``num_layers=None``) or all-layer cache (SPEC §3.3)."""
        check_counts(("num_pages", num_pages, 0), ("num_layers", num_layers, 1))
        tail = (self.num_head_slots, self.block_size, self.full_dim)
        if num_layers is None:
            return (num_pages, *tail)
        check_layout(layout)
        return (num_layers, num_pages, *tail) if layout == "LBHNC" else (num_pages, num_layers, *tail)

    def tile_offsets(self, token: int) -> tuple[int, int]:
        """Byte offsets of token ``token``'s data and scales inside a tile (SPEC §3.2)."""
        data = token * (self.head_dim // 2)
        scales = self.block_size * (self.head_dim // 2) + token * (self.head_dim // NVFP4_GROUP)
        return data, scales

    def page_offset(self, page: int, layer: int = 0, *, num_pages: int, num_layers: int = 1,
                    layout: str = "LBHNC") -> int:
        """Byte offset of page ``page`` of layer ``layer`` in the flat cache (SPEC §3.3):
        ``(layer·P + page)·page_bytes`` for LBHNC (and 4-D), ``(page·L + layer)·page_bytes``
        for BLHNC. Python ints, so offsets past 2³¹ are exact."""
        check_layout(layout)
        index = page * num_layers + layer if layout == "BLHNC" else layer * num_pages + page
        return index * self.page_bytes


def tile_offsets(token: int, head_dim: int = 128, block_size: int = 128) -> tuple[int, int]:
    """Byte offsets (data, scales) of ``token`` inside one (page, slot) tile, SPEC §3.2."""
    return KVCacheSpec(1, head_dim, block_size).tile_offsets(token)


def allocate_kv_cache(spec: KVCacheSpec, num_pages: int, num_layers: int | None = None,
                      layout: str = "LBHNC") -> jnp.ndarray:
    """A zeroed ``uint8`` cache of ``spec.cache_shape(num_pages, num_layers, layout)``."""
    return jnp.zeros(spec.cache_shape(num_pages, num_layers, layout), jnp.uint8)


INDEX_KEY_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)   # the index-key cache (SPEC §8)


def check_counts(*named):
    """ValueError naming the first ``(name, value, low)`` whose value is given (not None) but
    not an integer >= low (bools are not counts)."""
    for name, value, low in named:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def allocate_index_cache(num_pages: int, num_layers: int | None = None, *, index_dim: int = 128,
                         block_size: int = 128, dtype=jnp.bfloat16) -> jnp.ndarray:
    """A zeroed key-only index cache for :func:`write_index_keys` / :func:`select_blocks`
    (SPEC §8): ``[P, N, Di]`` (``num_layers=None``) or ``[L, P, N, Di]``, bfloat16 or
    float8_e4m3fn, the same pages (and ``block_table``) as the K/V cache.

    Raises:
      ValueError: ``num_pages`` not an integer >= 0, ``num_layers`` / ``index_dim`` /
        ``block_size`` not integers >= 1.
      TypeError: ``dtype`` other than bfloat16 or float8_e4m3fn.
    """
    check_counts(("num_pages", num_pages, 0), ("num_layers", num_layers, 1),
                 ("index_dim", index_dim, 1), ("block_size", block_size, 1))
    if np.dtype(dtype) not in tuple(np.dtype(d) for d in INDEX_KEY_DTYPES):
        raise TypeError(f"dtype must be bfloat16 or float8_e4m3fn, got {np.dtype(dtype)}")
    shape = (num_pages, block_size, index_dim)
    return jnp.zeros(shape if num_layers is None else (num_layers, *shape), dtype)


def layout_code(layout, ndim: int) -> int:
    """The layout attribute for a cache of rank ``ndim``: 0 for a 4-D (one-layer) cache, else
    :func:`check_layout`. A 5-D cache must name its layout: ``[L, P, ...]`` and ``[P, L, ...]``
    have the same rank, and a guess reads the wrong pages without a word."""
    if ndim == 5 and layout is None:
        raise ValueError("a 5-D kv_cache needs layout='LBHNC' ([L, P, 2Hkv, N, C]) or 'BLHNC' "
                         "([P, L, 2Hkv, N, C]): its shape cannot say which (SPEC §3.3)")
    return 0 if ndim != 5 and layout is None else check_layout(layout)


def check_layout(layout) -> int:
    """The layout's attribute code (0 = LBHNC, 1 = BLHNC); ValueError otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return LAYOUTS.index(layout)


# What each platform's native kernels serve (SPEC §1): exact values, or (low, high) ranges.
_KERNEL_LIMITS = {
    "rocm": dict(arch="gfx950", head_dim=128, group=frozenset({8, 16}), topk_blocks=16, block_size=128),
    "cuda": dict(arch="sm_90", head_dim=128, group=(1, 16), topk_blocks=(1, 64), block_size=128),
}


def unsupported_reason(num_heads: int, num_kv_heads: int, head_dim: int, topk_blocks: int | None,
                       block_size: int, platform: str | None = None) -> str | None:
    """None if ``platform``'s backend serves this geometry, else one sentence naming every
    violated requirement and the values seen (SPEC §1).

    ``platform`` None or "cpu": any G = Hq/Hkv ≥ 1, K ≥ 1, N = 128, D a multiple of 32
    (the CPU backend and the reference). "rocm": the gfx950 kernels (D = 128, G = 16 or 8,
    K = 16, N = 128). "cuda": the sm_90 kernels (D = 128, 1 ≤ G ≤ 16, 1 ≤ K ≤ 64, N = 128;
    q in bf16 or f16, checked when lowering). For :func:`full_attention` K plays no part
    (every block is attended): pass ``topk_blocks=None``; its CUDA and gfx950 kernels serve any
    context.
    """
    problems = []
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        problems.append(f"num_heads ({num_heads}) must be a positive multiple of "
                        f"num_kv_heads ({num_kv_heads})")
    if head_dim < 32 or head_dim % 32:
        problems.append(f"head_dim must be a multiple of 32 (got {head_dim})")
    if topk_blocks is not None and topk_blocks < 1:
        problems.append(f"topk_blocks must be >= 1 (got {topk_blocks})")
    if block_size != 128:
        problems.append(f"block_size must be 128 (got {block_size})")
    limits = _KERNEL_LIMITS.get(platform)
    if limits and not problems:
        group = num_heads // num_kv_heads
        for name, seen in (("head_dim", head_dim), ("group", group),
                           ("topk_blocks", topk_blocks), ("block_size", block_size)):
            if seen is None:                # full attention: no K
                continue
            want = limits[name]
            label = "num_heads / num_kv_heads" if name == "group" else name
            if isinstance(want, tuple) and not want[0] <= seen <= want[1]:
                problems.append(f"{label} must be between {want[0]} and {want[1]} (got {seen})")
            elif isinstance(want, frozenset) and seen not in want:
                problems.append(f"{label} must be one of {sorted(want)} (got {seen})")
            elif not isinstance(want, (tuple, frozenset)) and seen != want:
                problems.append(f"{label} must be {want} (got {seen})")
    if not problems:
        return None
    where = f"the {platform} ({limits['arch']}) kernels" if limits else "jax_m3sparse"
    return f"{where} cannot serve this geometry: " + "; ".join(problems) + "."
