"""grouped_matmul: one matmul per group of consecutive rows — the routed experts of a mixture of
experts, each expert's weights read once (SPEC §9)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive, f32, i64
from jax_m3sparse.mxfp4 import fp4_block


ACTIVATIONS = {None: 0, "swiglu": 1, "swiglu_oai": 2}   # the FFI's `activation` attribute
_ALIASES = {"swigluoai": "swiglu_oai"}                 # M3's config.json spelling


def _abstract_eval(lhs, rhs, group_sizes, rhs_scale, lhs_rows, lhs_scale, row_scale,
                   group_scale, *, gather, out_dtype, activation, alpha, limit):
    n = rhs.shape[1] // 2 if activation else rhs.shape[1]
    return ShapedArray(((lhs_rows if gather else lhs).shape[0], n), out_dtype)


def _platform_reason(platform, lhs, rhs, *_, **__):
    """Why ``platform``'s kernel cannot serve these shapes (raised when lowering), or None."""
    if platform == "cuda" and rhs.dtype != jnp.bfloat16 and lhs.shape[1] % 128:
        what = "MXFP8" if rhs.dtype == jnp.float8_e4m3fn else "FP4"
        return (f"the CUDA grouped_matmul kernel needs K (lhs.shape[1]) % 128 == 0 for {what} "
                f"weights (stages of 128 k, whole scale rows); got K = {lhs.shape[1]}")
    if platform == "cuda" and lhs.shape[1] % 8:
        return (f"the CUDA grouped_matmul kernel needs K (lhs.shape[1]) % 8 == 0 (16-byte rows); "
                f"got K = {lhs.shape[1]}")
    return None


_I32_MAX = 2**31 - 1


def _reference_when(platform, lhs, rhs, group_sizes, rhs_scale, lhs_rows, *_, gather, activation,
                    **__):
    """Calls a native kernel does not serve, lowered to the reference there. CPU: an MXFP8 lhs
    (W8A8). rocm (the gfx950 kernel, ffi/flydsl/grouped_matmul.py): an MXFP8 lhs, K not a
    multiple of 32, output columns not a multiple of 16, byte offsets past 32 bits or more tiles
    than a launch's grid holds."""
    if platform == "cpu":
        return lhs.dtype != jnp.bfloat16
    if platform != "rocm":
        return False
    K, N = lhs.shape[1], rhs.shape[1]
    cols = N // 2 if activation else N
    M = (lhs_rows if gather else lhs).shape[0]
    return (lhs.dtype != jnp.bfloat16 or K % 32 or cols % 16 or lhs.shape[0] * K * 2 > _I32_MAX
            or N * K * 2 > _I32_MAX or M * cols * 4 > _I32_MAX
            or -(-M // 16) + rhs.shape[0] + 1 > 65535)


# CUDA, the CPU (ffi/cpu/grouped_matmul.cc: bf16 rows) and rocm (gfx950, the shapes
# _reference_when leaves it); other calls lower to the reference (a product per group, each row
# selected).
grouped_matmul_p = define_primitive(
    "grouped_matmul",
    abstract_eval=_abstract_eval,
    reference=reference.grouped_matmul_impl,
    platform_reason=_platform_reason,
    reference_when=_reference_when,
    attributes=lambda gather, out_dtype, activation, alpha, limit: {   # out's dtype is its own
        "gather": i64(gather), "activation": i64(ACTIVATIONS[activation]), "alpha": f32(alpha),
        "limit": f32(limit)},
    native_platforms=("cpu", "cuda", "rocm"),
)


def _exponents(x, scale, name, what, labels):
    """``scale`` checked as the E8M0 exponents of ``x [*lead, K]`` (``labels`` names the lead
    dims): ``uint8[*lead, K/32]`` for an fp8 ``x`` (MXFP8), none (``[*lead, 0]``) for bf16."""
    lead, K = x.shape[:-1], x.shape[-1]
    dims = ", ".join(labels)
    if x.dtype == jnp.bfloat16:
        if scale is not None:
            raise ValueError(f"{name}_scale is for quantized {what} ({name} float8_e4m3fn: MXFP8"
                             f"{'; uint8: packed FP4' if name == 'rhs' else ''}); {name} is "
                             f"bfloat16: pass {name}_scale=None")
        return jnp.zeros((*lead, 0), jnp.uint8)
    if scale is None:
        raise ValueError(f"{name} is float8_e4m3fn (MXFP8): pass {name}_scale, uint8[{dims}, "
                         f"K/32] E8M0 exponents (jax_m3sparse.mxfp8_quantize makes both)")
    scale = jnp.asarray(scale)
    _checks.dtype(scale, f"{name}_scale", (jnp.uint8,))
    if K % 32:
        raise ValueError(f"MXFP8 {name} [{dims}, K] needs K % 32 == 0 (one exponent per 32 "
                         f"k): {name}.shape {x.shape}")
    if scale.shape != (*lead, K // 32):
        raise ValueError(f"MXFP8 {name}_scale must be [{dims}, K/32] = {(*lead, K // 32)}, got "
                         f"{name}_scale.shape {scale.shape}")
    return scale


def grouped_matmul(lhs, rhs, group_sizes, rhs_scale=None, *, lhs_rows=None, lhs_scale=None,
                   out_dtype=jnp.float32, activation=None, row_scale=None, group_scale=None,
                   alpha=1.702, limit=7.0):
    """``out[i] = lhs[i] · rhs[g]ᵀ`` for the rows i of group g, in fp32 (SPEC §9).

    The rows of ``lhs`` are grouped in order: group 0 is the first ``group_sizes[0]`` rows,
    group 1 the next ``group_sizes[1]``, and so on (XLA's ``ragged_dot`` convention, with
    ``rhs`` in PyTorch's ``[out, in]`` orientation per group). A mixture of experts sorts its
    (token, expert) pairs by expert and calls this once per projection: each routed expert's
    weights are read once per tile of its rows, unrouted experts not at all (CUDA; the CPU for
    bf16 rows; gfx950 for bf16 rows with K % 32 == 0 and output columns % 16 == 0; elsewhere
    the reference: every group's product over all rows, each row's selected — G times the work,
    for correctness).

    The weights may be MXFP8 (SPEC §9.1; :func:`jax_m3sparse.mxfp8_quantize`): ``rhs`` fp8
    e4m3 with ``rhs_scale``, one E8M0 exponent per 32 k. The CUDA kernel reads them as they are
    (half the bytes of bf16) and widens them in registers; the result equals the bf16 call on
    ``mxfp8_dequantize(rhs, rhs_scale)`` bit for bit, on every backend.

    The weights may be FP4 (SPEC §9.3; :mod:`jax_m3sparse.mxfp4`): ``rhs`` uint8 ``[G, N, K/2]``,
    two E2M1 codes per byte as the checkpoints store them, with ``rhs_scale`` uint8 E8M0
    exponents per 32 k (MXFP4; :func:`jax_m3sparse.mxfp4_quantize`) or float8_e4m3fn scales
    per 16 k (NVFP4; :func:`jax_m3sparse.nvfp4_quantize` with the expert's ``weight_scale_2``
    as its global scale, e.g. ModelOpt's max|w| / (6 · 448); one expert at a time or under
    ``jax.vmap``). The result is the bf16 call on ``fp4_dequantize(rhs, rhs_scale)`` — bit for
    bit on the CPU, to fp32 rounding on CUDA and gfx950, whose kernels read a quarter of bf16's
    bytes and sum in their own order (SPEC §9.3). NVFP4's per-expert ``weight_scale_2`` is
    ``group_scale``: one fp32 multiply of each product, never a rounding of the weights.

    The rows may be MXFP8 too (SPEC §9.2; ``lhs`` fp8 e4m3 with ``lhs_scale``, as
    :func:`jax_m3sparse.mxfp8_quantize` makes them from bf16 activations), with MXFP8 weights
    only: the CUDA kernel then multiplies fp8 by fp8 on the tensor cores and scales each
    32-k block's fp32 sum by its two exponents — no widening of the weights, and half the
    activation bytes. The products are those of the bf16 call on the two dequantized operands;
    only the summation order differs (fp32 rounding).

    With ``lhs_rows`` the rows are gathered as they are read (SPEC §9 item 4): row i of the
    product is ``lhs[lhs_rows[i]]``, the same bits as passing ``lhs[lhs_rows]`` without the
    sorted copy (a mixture of experts passes its tokens once and each pair's token id).

    The epilogue (SPEC §9 item 6) lets an expert's first projection finish in the kernel:
    ``group_scale`` multiplies group g's products (NVFP4's per-expert ``weight_scale_2``),
    ``activation`` joins each product row's gate half (output columns ``[0, N/2)``: the first
    N/2 rows of each ``rhs[g]``, as MiniMax M3's ``gate_up_proj [E, 2, I, H]`` reshaped to
    ``[E, 2I, H]`` stores them; a checkpoint that interleaves gate and up rows needs them
    reordered first) with its up half (columns ``[N/2, N)``) — ``"swiglu"``: ``silu(gate) ·
    up``; ``"swiglu_oai"`` (M3's ``hidden_act`` ``"swigluoai"``, also accepted by that name):
    ``(clip(up, ±limit) + 1) · g · sigmoid(alpha · g)``, ``g = min(gate, limit)`` — and
    ``row_scale`` multiplies each row (the routing weights), all in fp32 before the rounding to
    ``out_dtype``. The result is the second projection's input,
    ``[M, N/2]``: the ``[M, N]`` fp32 product never reaches memory. Example (the routed experts
    of one MoE layer, pairs sorted by expert)::

        h = grouped_matmul(x, gate_up, sizes, lhs_rows=pair_token, activation="swiglu_oai",
                           row_scale=pair_weight, out_dtype=jnp.bfloat16)      # [T·k, I]
        y = grouped_matmul(h, down, sizes, out_dtype=jnp.bfloat16)           # [T·k, H]

    Args:
      lhs: ``bfloat16[M, K]``, the rows sorted by group; with ``lhs_rows``, any ``bfloat16[T,
        K]`` (the tokens, unsorted). Or ``float8_e4m3fn`` (MXFP8, with ``lhs_scale`` and fp8
        ``rhs``).
      rhs: ``bfloat16[G, N, K]``, ``float8_e4m3fn[G, N, K]`` (MXFP8) or ``uint8[G, N, K/2]``
        (packed FP4), one ``[N, K]`` matrix per group.
      group_sizes: ``int32[G]`` rows per group. Data, not static: a negative size counts as 0,
        rows past M are dropped, and rows after the last group are 0 in the result.
      rhs_scale: ``uint8[G, N, K/32]`` E8M0 exponents, with fp8 ``rhs`` (the checkpoints'
        ``weight_scale_inv``) or FP4 ``rhs`` (MXFP4), 255 reading as NaN; or
        ``float8_e4m3fn[G, N, K/16]`` with FP4 ``rhs`` (NVFP4's ``weight_scale``).
      lhs_rows: optional ``int32[M]`` (data): the ``lhs`` row each product row reads, ``lhs``
        then being any ``[T, K]``; an index outside ``[0, T)`` reads a zero row.
      lhs_scale: ``uint8[M (or T with lhs_rows), K/32]`` E8M0 exponents of an fp8 ``lhs``;
        255 reads as NaN.
      out_dtype: ``float32`` (default) or ``bfloat16``: each fp32 result rounded to nearest
        even as it is stored (SPEC §9 item 5): half the bytes written, and read by the sum.
      activation: None (default), ``"swiglu"`` or ``"swiglu_oai"`` (static; N even): the
        output is ``[M, N/2]``, SPEC §9 item 6.
      row_scale: optional ``float32[M]`` (data), each output row's factor (after the
        activation).
      group_scale: optional ``float32[G]`` (data), each group's factor on its products (before
        the activation).
      alpha, limit: ``"swiglu_oai"``'s constants (static Python floats, not traced; M3's
        config: 1.702, 7.0); unused by ``"swiglu"``.

    Returns:
      ``[M, N]`` (``[M, N/2]`` with an activation) of ``out_dtype`` (M = ``lhs_rows``' length
      when given). Each element is a fixed-order fp32 sum over K: a row's result depends only
      on its own row, its group's matrix and scale and its row scale, never on the other rows
      or groups. Inference-only (SPEC §7).

    Raises:
      ValueError / TypeError at trace time for wrong ranks, dtypes or mismatched K / G, an fp8
      ``rhs`` without ``rhs_scale`` (or a scale with bf16 ``rhs``), the same for ``lhs`` and
      ``lhs_scale``, an fp8 ``lhs`` with bf16 or FP4 ``rhs``, K % 32 != 0 with MXFP8, FP4
      scales of another dtype or shape, an unknown activation or an odd N with one,
      ``row_scale`` / ``group_scale`` not float32 ``[M]`` / ``[G]``; on CUDA when K % 8 != 0
      (MXFP8, FP4: K % 128 != 0). On rocm (gfx950) nothing more is refused: calls its kernel
      does not serve (an MXFP8 ``lhs``, K % 32 != 0, result columns — N, or N/2 with an
      activation — not a multiple of 16) lower to the reference there.
    """
    lhs, rhs, group_sizes = _checks.index_arrays(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    _checks.rank(lhs, "lhs", 2, "[M, K]")
    _checks.rank(rhs, "rhs", 3, "[G, N, K]")
    _checks.rank(group_sizes, "group_sizes", 1, "[G]")
    _checks.dtype(lhs, "lhs", (jnp.bfloat16, jnp.float8_e4m3fn))
    _checks.dtype(rhs, "rhs", (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8))
    _checks.dtype(group_sizes, "group_sizes", (jnp.int32,))
    fp4 = rhs.dtype == jnp.uint8                       # two E2M1 codes per byte (SPEC §9.3)
    if lhs.shape[1] != rhs.shape[2] * (2 if fp4 else 1):
        shape = "rhs [G, N, K/2] (packed FP4)" if fp4 else "rhs [G, N, K]"
        raise ValueError(f"lhs [M, K] and {shape} must share K: lhs.shape {lhs.shape}, "
                         f"rhs.shape {rhs.shape}")
    _checks.dim("group_sizes", "length (G of rhs)", rhs.shape[0], group_sizes.shape[0])
    if fp4:
        if rhs_scale is None:
            raise ValueError("rhs is uint8 (packed FP4): pass rhs_scale, uint8[G, N, K/32] E8M0 "
                             "exponents (MXFP4) or float8_e4m3fn[G, N, K/16] scales (NVFP4)")
        rhs_scale = jnp.asarray(rhs_scale)
        fp4_block(rhs, rhs_scale)
    else:
        rhs_scale = _exponents(rhs, rhs_scale, "rhs", "weights", ("G", "N"))
    if lhs.dtype == jnp.float8_e4m3fn and rhs.dtype != jnp.float8_e4m3fn:
        raise ValueError("an MXFP8 lhs (float8_e4m3fn) needs MXFP8 rhs (float8_e4m3fn with "
                         "rhs_scale): SPEC §9.2 multiplies fp8 by fp8")
    lhs_scale = _exponents(lhs, lhs_scale, "lhs", "rows", ("T" if lhs_rows is not None else "M",))
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    gather = lhs_rows is not None
    if gather:
        lhs_rows, = _checks.index_arrays(lhs_rows=lhs_rows)
        _checks.rank(lhs_rows, "lhs_rows", 1, "[M]")
        _checks.dtype(lhs_rows, "lhs_rows", (jnp.int32,))
    else:
        lhs_rows = jnp.zeros((0,), jnp.int32)
    activation = _ALIASES.get(activation, activation)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'swiglu' or 'swiglu_oai' ('swigluoai'), got "
                         f"{activation!r}")
    if activation and rhs.shape[1] % 2:
        raise ValueError(f"activation {activation!r} joins rhs's gate and up halves: N "
                         f"(rhs.shape[1]) must be even, got {rhs.shape[1]}")
    M = lhs_rows.shape[0] if gather else lhs.shape[0]
    row_scale = _vector(row_scale, "row_scale", "M (rows of the product)", M)
    group_scale = _vector(group_scale, "group_scale", "G (rhs.shape[0])", rhs.shape[0])
    return grouped_matmul_p.bind(lhs, rhs, group_sizes, rhs_scale, lhs_rows, lhs_scale,
                                 row_scale, group_scale, gather=gather, out_dtype=out_dtype,
                                 activation=activation, alpha=float(alpha), limit=float(limit))


def _vector(x, name, what, n):
    """An optional float32 ``[n]`` operand, or the empty ``[0]`` that stands for none."""
    if x is None:
        return jnp.zeros((0,), jnp.float32)
    x = jnp.asarray(x)
    _checks.rank(x, name, 1, f"[{what.split()[0]}]")
    _checks.dtype(x, name, (jnp.float32,))
    _checks.dim(name, f"length ({what})", n, x.shape[0])
    return x
