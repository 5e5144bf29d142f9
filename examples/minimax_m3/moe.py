"""M3's MLPs: swiglu-oai dense MLPs and the sigmoid-routed mixture of experts.

transformers' ``MiniMaxM3VLDenseMLP``, ``MiniMaxM3VLTopKRouter``, ``MiniMaxM3VLExperts`` and
``MiniMaxM3VLSparseMoeBlock``, in JAX. Weights keep PyTorch's ``[out, in]`` orientation; the
packed ``gate_up_proj`` is held as ``[..., 2, I, H]`` (gate half first) so that tensor parallel
can split ``I`` and every device keeps matching gate and up rows.

The routed experts have these formulations, chosen by ``cfg.moe_impl`` (:func:`resolve_impl`):

* ``"dense"``: every expert on every token, each output weighted by the token's routing weight
  (0 where not chosen). Exact, sort-free, static-shaped; reads every expert's weights and does
  ``num_local_experts / num_experts_per_tok`` times the routed FLOPs (M3: 32×). It wins where
  ``ragged_dot`` is lowered as a masked product over every group (jaxlib's CPU backend, and the
  GPU backend of jaxlib 0.11.2: examples/minimax_m3/README.md, "The model");
* ``"dense_batched"``: the same, with the down projection as one matmul per expert;
* ``"gather"``: dense dispatch over the routed experts only — the ``min(E, T·k)`` distinct
  experts of the batch are gathered, then run on every token. Reads ``≈ routed / E`` of the
  weights: the decode formulation on GPUs while ``T·k ≤ E``;
* ``"ragged"``: the ``T·k`` (token, expert) pairs sorted by expert (a static row count; the
  group sizes are data), two ``jax.lax.ragged_dot_general`` calls, the rows weighted and summed
  back per token. Reads only the experts the batch routes to, and computes only routed FLOPs,
  wherever the backend's ``ragged_dot`` is a grouped GEMM;
* ``"grouped"``: the same sorted rows through :func:`jax_m3sparse.grouped_matmul` (on CUDA our
  grouped GEMM kernel, which reads each routed expert's weights once and skips the others;
  elsewhere XLA's ``ragged_dot``). bf16 or MXFP8 weights (``cfg.expert_format``: fp8 with an
  E8M0 exponent per 32 inputs, read as they are, half the bytes);
* ``"tokamax"``: the same sorted rows through ``tokamax.ragged_dot_general`` (Pallas Mosaic GPU
  / Triton kernels; optional, imported only when asked for);
* ``"auto"``: one of those per backend and load (:data:`AUTO`, from measurements): "grouped"
  on GPUs, dense dispatch on CPUs.

MXFP8 experts (``gate_up_proj`` / ``down_proj`` fp8 beside ``*_scale`` uint8) run as they are
through "grouped"; every other formulation first widens them to bf16
(:func:`jax_m3sparse.mxfp8_dequantize`, the same values the kernel multiplies). Under
``expert_format`` "mxfp8_w8a8" the experts' inputs are MXFP8 too and every backend takes
"grouped" (fp8 × fp8 on CUDA, SPEC §9.2; the reference's dequantized products elsewhere).
FP4 experts (``expert_format`` "mxfp4" / "nvfp4", SPEC §9.3: packed E2M1 bytes beside their
``*_scale``, and for NVFP4 a float32 ``*_scale_2`` per expert, as the published checkpoints
store them) run through "grouped" on every backend too: NVFP4's per-expert ``weight_scale_2``
multiplies the gate/up products and the routing weight (one fp32 multiply per output, never a
rounding of the weights), which only the sorted rows know per expert.

Tensor parallel (``parallel.py``): every MLP's intermediate axis ``I`` is split over the mesh
axis "tp" (Megatron style; each device holds ``1/tp`` of every expert, never all of one
expert's rows and never all experts); the router and the shared expert's output join the
routed sum on each device, and one ``psum`` per MLP layer adds the devices' partial outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_m3sparse

from .layers import linear
from .parallel import AXIS, leaf_spec


def swiglu_oai(gate_up, alpha, limit):
    """``gate_up [..., 2, I]`` -> ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``,
    g = min(gate, limit) (transformers' ``_apply_gate``): the arithmetic of
    :func:`jax_m3sparse.grouped_matmul`'s ``"swiglu_oai"`` epilogue (SPEC §9 item 6)."""
    return jax_m3sparse.reference.swiglu(gate_up[..., 0, :], gate_up[..., 1, :], "swiglu_oai",
                                         alpha, limit)


def dense_mlp(p, x, cfg):
    """``MiniMaxM3VLDenseMLP``: p ``gate_up_proj [2, I, H]``, ``down_proj [H, I]``; x ``[T, H]``."""
    _, I, H = p["gate_up_proj"].shape
    gu = linear(x, p["gate_up_proj"].reshape(2 * I, H), cfg).reshape(-1, 2, I)
    return linear(swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit), p["down_proj"], cfg)


def route(p, x, cfg, live=None):
    """``MiniMaxM3VLTopKRouter``: sigmoid scores; the correction bias only chooses; the weights
    renormalised to sum 1. One :func:`jax_m3sparse.route_experts` call, which also groups the
    (token, expert) pairs by expert for the grouped formulations (on CUDA one kernel, on gfx950
    two, in place of XLA's top-k, argsort, scatters and gathers). ``live bool[T]``: padding rows (False) join no
    expert's group. Returns a :class:`jax_m3sparse.ExpertRouting` (``weights``, ``experts``
    ``[T, k]``, the grouping fields)."""
    scores = jax.nn.sigmoid(linear(x, p["gate"], cfg).astype(jnp.float32))
    return jax_m3sparse.route_experts(scores, cfg.num_experts_per_tok,
                                      bias=p["e_score_correction_bias"].astype(jnp.float32),
                                      live=live)


IMPLS = ("auto", "dense", "dense_batched", "gather", "ragged", "grouped", "tokamax")

# "auto": per backend, the formulation for a call whose load is T·k / E (routed pairs per
# expert): (largest load or None, impl) pairs, first match wins ("tokamax" skipped where it
# does not import, "grouped" where the weights are not bf16). CPU (Zen 3, jax 0.10.2):
# ragged_dot is a masked product over every group, slower than dense dispatch at every size
# measured, and the small default model keeps dense (grouped_matmul's CPU kernel, since
# 2026-12-07, was within this shared machine's noise of dense dispatch on the tiny bench's
# MoE: hidden 256, 16 experts of 64; it pays where experts are many, --moe-impl grouped). GPU (one H200, jaxlib 0.11.2, one TP-8
# rank of M3: E 128, k 4, H 6144, I 384; the real-size bench, per layer inside a scan over 42
# layers): "grouped" (jax_m3sparse.grouped_matmul) 184 µs at T = 4, 499 µs at T = 128, 1.74 ms
# for a 2048-token prefill chunk; "gather" 266 µs, 1.88 ms, 9.46 ms; dense dispatch 1.67-1.77
# ms at every decode T and 7.1 ms for the chunk (BENCHMARKS.md).
AUTO = {"cpu": ((None, "dense"),),
        "gpu": ((None, "grouped"), (1.0, "gather"), (None, "dense"))}


def tokamax_available() -> bool:
    """Whether ``import tokamax`` works (0.0.17 imports ``xprof`` at import time)."""
    try:
        import tokamax  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, load: float, backend: str | None = None,
                 weight_dtype=jnp.bfloat16) -> str:
    """The formulation ``impl`` names for a call of ``load = T·k / E`` routed (token, expert)
    pairs per expert on ``backend`` (default: JAX's): ``impl`` itself, or for "auto" the first
    :data:`AUTO` entry whose bound admits ``load`` ("tokamax" entries are skipped when it does
    not import, "grouped" ones when the weights are neither bfloat16, MXFP8's fp8 nor packed
    FP4's uint8).

    Raises:
      ValueError: an unknown ``impl``; "grouped" asked for with float32 / float16 weights.
    """
    if impl not in IMPLS:
        raise ValueError(f"moe_impl {impl!r}: one of {IMPLS}")
    bf16 = jnp.dtype(weight_dtype) in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8)
    if impl == "grouped" and not bf16:
        raise ValueError(f"moe_impl 'grouped' (jax_m3sparse.grouped_matmul) takes bfloat16, "
                         f"MXFP8 or FP4 expert weights, got {jnp.dtype(weight_dtype)}: use --dtype "
                         f"bfloat16 or moe_impl 'ragged' / 'dense'")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    for bound, choice in AUTO.get(backend, AUTO["gpu"] if backend in ("cuda", "rocm") else
                                  AUTO["cpu"]):
        if not (bound is None or load <= bound):
            continue
        if (choice == "tokamax" and not tokamax_available()) or (choice == "grouped" and not bf16):
            continue
        return choice
    return "dense"


def experts(p, x, routing, cfg, impl: str | None = None):
    """``MiniMaxM3VLExperts``: Σ_k weights[t, k] · expert_{experts[t, k]}(x[t]), fp32 ``[T, H]``.

    p ``gate_up_proj [E, 2, I, H]``, ``down_proj [E, H, I]`` (I may be this device's slice);
    x ``[T, H]``; ``routing`` a :class:`jax_m3sparse.ExpertRouting` (:func:`route`). ``impl``
    (default ``cfg.moe_impl``): see the module docstring; every formulation gives the same sum
    (fp32: to rounding). The sorted formulations give the routing's padding rows (not live)
    no expert: 0 out, and no expert's weights read for them.

    Raises:
      ValueError: unknown impl; ImportError: "tokamax" asked for and not importable.
    """
    T, k = routing.experts.shape
    load = T * k / p["gate_up_proj"].shape[0]                             # T·k / E
    impl = resolve_impl(impl or getattr(cfg, "moe_impl", "auto"), load,
                        weight_dtype=p["gate_up_proj"].dtype)
    if getattr(cfg, "expert_format", "bf16") in GROUPED_ONLY:
        # fp8 × fp8 (SPEC §9.2) and FP4 weights (§9.3) are grouped_matmul's on every backend (the
        # CPU's reference multiplies the dequantized values): one formulation, the same numbers
        # everywhere
        impl = "grouped"
    if impl == "grouped":
        return experts_sorted(p, x, routing, cfg, jax_m3sparse.grouped_matmul)
    p = dequantized(p)
    weights, chosen = routing.weights, routing.experts
    if impl == "dense":
        return experts_dense(p, x, weights, chosen, cfg)
    if impl == "dense_batched":
        return experts_dense(p, x, weights, chosen, cfg, batched_down=True)
    if impl == "gather":
        return experts_gathered(p, x, weights, chosen, cfg)
    return experts_sorted(p, x, routing, cfg, _grouped_dot(impl))


def dequantized(p):
    """``p`` with quantized expert weights widened to bf16 (``*_scale`` / ``*_scale_2`` leaves
    dropped; NVFP4's per-expert ``scale_2`` multiplied in, then rounded); bf16 ``p`` as it is."""
    if "gate_up_proj_scale" not in p:
        return p
    out = {}
    for name in ("gate_up_proj", "down_proj"):
        data, scale = p[name], p[name + "_scale"]
        if data.dtype == jnp.float8_e4m3fn:
            out[name] = jax_m3sparse.mxfp8_dequantize(data, scale)
            continue
        w = jax_m3sparse.fp4_dequantize(data, scale, jnp.float32)
        if name + "_scale_2" in p:
            s2 = p[name + "_scale_2"]
            w = w * s2.reshape(*s2.shape, *(1,) * (w.ndim - s2.ndim))
        out[name] = w.astype(jnp.bfloat16)
    return out


def experts_dense(p, x, weights, chosen, cfg, batched_down: bool = False, experts=None):
    """Dense dispatch: every expert on every token, each output scaled by its routing weight.

    ``experts int32[U]``: the expert id of each of ``p``'s U rows (default: row e is expert e;
    :func:`experts_gathered` passes the routed subset). ``batched_down``: the down projection
    as one matmul per expert (``[E, T, H]`` fp32, then summed over experts) instead of one
    contraction over experts and ``I`` together, which needs ``down_proj [E, H, I]`` transposed
    (a copy of every expert's down weights per call on XLA's GPU backend)."""
    w_gu, w_down = p["gate_up_proj"], p["down_proj"]
    ids = jnp.arange(w_gu.shape[0]) if experts is None else experts
    dense_w = jnp.sum(jnp.where(chosen[:, :, None] == ids, weights[:, :, None], 0.0),
                      axis=1)                                            # [T, U]
    gu = jnp.einsum("th,egih->etgi", x.astype(w_gu.dtype), w_gu,
                    preferred_element_type=jnp.float32)
    h = swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit) * dense_w.T[:, :, None]
    if batched_down:
        return jnp.sum(jnp.einsum("eti,ehi->eth", h.astype(w_down.dtype), w_down,
                                  preferred_element_type=jnp.float32), axis=0)
    return jnp.einsum("eti,ehi->th", h.astype(w_down.dtype), w_down,
                      preferred_element_type=jnp.float32)


def experts_gathered(p, x, weights, chosen, cfg):
    """Dense dispatch over the routed experts only: the ``U = min(E, T·k)`` distinct experts
    of the batch (static bound; unused entries gather expert E − 1 and get zero weight) are gathered,
    then run on every token. Reads ``U / E`` of the weights (plus the gathered copy): for
    decode batches where ``T·k`` is well below E."""
    T, k = chosen.shape
    E = p["gate_up_proj"].shape[0]
    U = min(E, T * k)
    ids = jnp.unique(chosen.reshape(-1), size=U, fill_value=E).astype(jnp.int32)  # E: unused
    sub = {name: p[name][jnp.minimum(ids, E - 1)] for name in ("gate_up_proj", "down_proj")}
    return experts_dense(sub, x, weights, chosen, cfg, batched_down=True,
                         experts=jnp.where(ids < E, ids, -1))


# rhs [G, out, in] (PyTorch layout), contracting lhs [M, in] with rhs's last axis
_OUT_IN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _grouped_dot(impl: str):
    """``dot(lhs, rhs [G, out, in], group_sizes [G], lhs_rows=None, out_dtype=f32) -> [M, out]``
    (bf16 rhs; fp32 sums), like jax_m3sparse.grouped_matmul: with ``lhs_rows`` the product of
    ``lhs[lhs_rows]`` (gathered first here; grouped_matmul reads them in place)."""
    if impl == "ragged":
        general = jax.lax.ragged_dot_general
    elif impl == "tokamax":
        try:
            import tokamax  # noqa: PLC0415
        except ImportError as e:
            raise ImportError(f"moe_impl 'tokamax': the tokamax package does not import ({e}); "
                              f"pip install tokamax, or use 'ragged' / 'dense'") from e
        # Its Mosaic GPU kernel wants rhs [G, in, out]; with our [G, out, in] it transposes
        # rhs inside (tokamax's TODO), a copy of every expert's weights per call.
        general = tokamax.ragged_dot_general
    else:
        raise ValueError(f"no grouped dot for moe_impl {impl!r}")
    return lambda lhs, rhs, sizes, lhs_rows=None, out_dtype=jnp.float32: general(
        lhs if lhs_rows is None else lhs[lhs_rows], rhs, sizes, _OUT_IN,
        preferred_element_type=jnp.float32).astype(out_dtype)


def experts_sorted(p, x, routing, cfg, dot):
    """Grouped formulation: the routing's pairs grouped by expert, two grouped matmuls over the
    routed rows only (``T·k`` of them, static), each row weighted, then summed back per token.
    MXFP8 weights pass their ``*_scale`` exponents to ``dot`` (jax_m3sparse.grouped_matmul);
    under ``expert_format`` "mxfp8_w8a8" each product's inputs are MXFP8 too (the tokens once,
    per 32 of H; the SwiGLU outputs per 32 of I: dynamic, as the MXFP8 checkpoint's
    ``activation_scheme`` says). The SwiGLU and the routing weight are an XLA
    fusion between the two products; with ``cfg.moe_epilogue`` (and ``dot`` =
    :func:`jax_m3sparse.grouped_matmul`) the gate_up kernel's epilogue does them (SPEC §9 item
    6; NVFP4's scale_2 as ``group_scale``) — off by default: the M3 step measured slower with
    it on an H100 at decode 64 and prefill (docs/perf-log/moe-grouped-gemm.md)."""
    T, k = routing.experts.shape
    w_gu, w_down = p["gate_up_proj"], p["down_proj"]
    E, _, I = w_gu.shape[:3]
    H = x.shape[-1]
    wide = w_gu.dtype in (jnp.bfloat16, jnp.float32)
    act = w_gu.dtype if wide else jnp.bfloat16          # lhs dtype (quantized weights: bf16)
    scales = ({} if "gate_up_proj_scale" not in p else
              dict(gu=(p["gate_up_proj_scale"].reshape(E, 2 * I, -1),),
                   down=(p["down_proj_scale"],)))
    sizes = routing.group_sizes
    w8a8 = getattr(cfg, "expert_format", "bf16") == "mxfp8_w8a8"
    s_gu = s_down = 1.0
    if "gate_up_proj_scale_2" in p:   # NVFP4: each sorted row's expert's weight_scale_2
        expert = jnp.zeros(T * k, jnp.int32).at[routing.inverse.reshape(-1)].set(
            routing.experts.reshape(-1))
        s_gu = p["gate_up_proj_scale_2"][expert][:, None, None]
        s_down = p["down_proj_scale_2"][expert]

    def rows(a):     # the product's lhs: bf16, or MXFP8 with its exponents
        if not w8a8:
            return (a.astype(act),), {}
        data, exps = jax_m3sparse.mxfp8_quantize(a)
        return (data,), dict(lhs_scale=exps)

    # the pairs' tokens [T·k, H], gathered as the first product reads them
    a, kw = rows(x)
    kw_down = {}
    if getattr(cfg, "moe_epilogue", False) and dot is jax_m3sparse.grouped_matmul:
        h = dot(*a, w_gu.reshape(E, 2 * I, -1), sizes, *scales.get("gu", ()),
                lhs_rows=routing.sorted_tokens, activation="swiglu_oai", alpha=cfg.swiglu_alpha,
                limit=cfg.swiglu_limit, row_scale=routing.sorted_weights,
                group_scale=p.get("gate_up_proj_scale_2"),
                out_dtype=jnp.float32 if w8a8 else act, **kw)
        kw_down = dict(group_scale=p.get("down_proj_scale_2"))
    else:
        gu = dot(*a, w_gu.reshape(E, 2 * I, -1), sizes, *scales.get("gu", ()),
                 lhs_rows=routing.sorted_tokens, **kw).reshape(T * k, 2, I) * s_gu
        # The routing weight before down_proj, as dense dispatch applies it (same bf16 rounding).
        h = (swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit)
             * (routing.sorted_weights * s_down)[:, None])
    # Each pair's output in the activations' dtype (bf16 models: rounded once, as transformers'
    # bf16 experts are; half the bytes the GEMM writes and the sum reads), summed in fp32.
    a, kw = rows(h)
    y = dot(*a, w_down, sizes, *scales.get("down", ()), out_dtype=act, **kw, **kw_down)   # [T·k, H]
    return jnp.sum(y[routing.inverse.reshape(-1)].reshape(T, k, H).astype(jnp.float32), axis=1)


def sparse_moe(p, x, cfg, live=None):
    """``MiniMaxM3VLSparseMoeBlock``: routed experts × routed_scaling_factor + shared expert.
    ``live bool[T]``: padding rows (False) go to no routed expert (:func:`experts`)."""
    routed = experts(p["experts"], x, route(p, x, cfg, live), cfg)
    return routed * cfg.routed_scaling_factor + dense_mlp(p["shared_experts"], x, cfg)


# ----------------------------------------------------------------------------- tensor parallel
def mlp(p, x, cfg, moe: bool, live=None):
    """The layer's MLP on ``x [T, H]`` (fp32 out); ``live bool[T]``: the rows that are tokens
    (:func:`sparse_moe`; None: all). Under a mesh with a "tp" axis of size > 1
    (``jax.set_mesh``, see engine.py) it runs per device on the local ``I`` slices and sums
    the partial outputs with one ``psum``."""
    live = jnp.ones(x.shape[0], bool) if live is None else live
    def body(p_, x_, live_):
        return sparse_moe(p_, x_, cfg, live_) if moe else dense_mlp(p_, x_, cfg)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return body(p, x, live)
    tp = mesh.shape[AXIS]
    specs = jax.tree_util.tree_map_with_path(lambda path, _: leaf_spec(path, cfg, tp), p)

    def local(p_, x_, live_):
        return jax.lax.psum(body(p_, x_, live_), AXIS)

    return jax.shard_map(local, in_specs=(specs, P(), P()), out_specs=P(),
                         check_vma=False)(p, x, live)


# ----------------------------------------------------------------------------- expert formats
GROUPED_ONLY = ("mxfp8_w8a8", "mxfp4", "nvfp4")   # formats only "grouped" runs (experts())
_EXPERT_DIMS = {"gate_up_proj": 3, "down_proj": 2}   # axes after the expert axis ([2, I, H], [H, I])


def expert_leaves(fmt: str, name: str, shape) -> dict:
    """``{leaf: (shape, dtype)}``: what one bf16 routed-expert weight ``name`` (``gate_up_proj
    [..., E, 2, I, H]`` or ``down_proj [..., E, H, I]``) is held as under ``fmt`` (dtype None:
    the model's) — :func:`quantize_expert`'s outputs, in order."""
    *lead, K = shape
    f8, u8 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)
    if fmt == "bf16":
        return {name: (tuple(shape), None)}
    if fmt in ("mxfp8", "mxfp8_w8a8"):              # fp8 + E8M0 per 32 (SPEC §9.1)
        return {name: (tuple(shape), f8), name + "_scale": ((*lead, K // 32), u8)}
    if fmt == "mxfp4":                              # packed E2M1 + E8M0 per 32 (§9.3)
        return {name: ((*lead, K // 2), u8), name + "_scale": ((*lead, K // 32), u8)}
    experts = tuple(shape[:len(shape) - _EXPERT_DIMS[name]])
    return {name: ((*lead, K // 2), u8), name + "_scale": ((*lead, K // 16), f8),   # NVFP4
            name + "_scale_2": (experts, jnp.dtype(jnp.float32))}


def expert_leaf_names(fmt: str, name: str) -> tuple[str, ...]:
    """The leaves routed-expert weight ``name`` is held as under ``fmt``, in
    :func:`expert_leaves`' order (``name``, then its scales)."""
    return tuple(expert_leaves(fmt, name, _ANY_SHAPE))


def expert_leaf_dtype(fmt: str, leaf: str):
    """The dtype of one routed-expert ``leaf`` (e.g. ``gate_up_proj_scale``) under ``fmt``
    (None: the model's)."""
    return expert_leaves(fmt, leaf.split("_scale")[0], _ANY_SHAPE)[leaf][1]


_ANY_SHAPE = (1, 1, 1, 1, 32)   # expert_leaves' names and dtypes do not depend on the shape


def quantize_expert(w, fmt: str, name: str) -> tuple:
    """A bf16 / fp32 routed-expert weight ``w`` (shaped as :func:`expert_leaves` says) in
    ``fmt``: MXFP8 / MXFP4 by jax_m3sparse's quantizers; NVFP4 with ModelOpt's per-expert
    ``weight_scale_2`` = max|w| / (6 · 448) over the expert's whole matrix (gate and up
    together, as the checkpoint shares it), then :func:`jax_m3sparse.nvfp4_quantize`."""
    if fmt in ("mxfp8", "mxfp8_w8a8"):
        return jax_m3sparse.mxfp8_quantize(w)
    if fmt == "mxfp4":
        return jax_m3sparse.mxfp4_quantize(w)
    lead = w.shape[:w.ndim - _EXPERT_DIMS[name]]
    flat = w.reshape(-1, *w.shape[len(lead):])
    amax = jnp.max(jnp.abs(flat.astype(jnp.float32)), axis=tuple(range(1, flat.ndim)))
    s2 = jnp.where(amax > 0, amax / jnp.float32(6 * 448), jnp.float32(1))
    data, scale = jax.vmap(jax_m3sparse.nvfp4_quantize)(flat, s2)
    return (data.reshape(*lead, *data.shape[1:]), scale.reshape(*lead, *scale.shape[1:]),
            s2.reshape(lead))


def quantize_experts(params, shardings, fmt: str):
    """``params`` with every MoE segment's bf16 routed experts quantized to ``fmt`` on their
    devices (:func:`quantize_expert`), one stacked layer at a time. Lossless for weights read
    from an MXFP8 checkpoint (their values are fp8 · 2^e: requantized exactly) and for MXFP4
    ones (e2m1 · 2^e, requantized to the same values); NVFP4 ones are requantized with a new
    scale_2 (the checkpoint's bytes are not kept yet).

    ``shardings``: parallel.param_shardings of ``fmt``'s shapes (scale leaves included). Each
    bf16 expert leaf is deleted once converted, so the peak holds one leaf in both forms; the
    caller must not use ``params``' old expert leaves afterwards."""
    segments = []
    for seg, sh in zip(params["segments"], shardings["segments"]):
        ex = seg.get("mlp", {}).get("experts")
        if ex is None or "gate_up_proj_scale" in ex:
            segments.append(seg)
            continue
        new, ex_sh = dict(ex), sh["mlp"]["experts"]
        for name in ("gate_up_proj", "down_proj"):
            leaves = expert_leaves(fmt, name, ex[name].shape)
            new.update(zip(leaves, _quantize_stacked(ex[name], fmt, name, leaves,
                                                     tuple(ex_sh[n] for n in leaves))))
        segments.append({**seg, "mlp": {**seg["mlp"], "experts": new}})
    return {**params, "segments": segments}


def _quantize_stacked(w, fmt, name, leaves, out_shardings):
    """A stacked ``[L, ...]`` bf16 leaf -> its quantized leaves, layer by layer into donated
    buffers; ``w`` deleted."""
    bufs = tuple(jax.jit(functools.partial(jnp.zeros, shape, dt), out_shardings=sh)()
                 for (shape, dt), sh in zip(leaves.values(), out_shardings))

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=out_shardings)
    def put(bufs, w, j):
        return tuple(b.at[j].set(q) for b, q in zip(bufs, quantize_expert(w[j], fmt, name)))

    for j in range(w.shape[0]):
        bufs = put(bufs, w, jnp.int32(j))
    jax.block_until_ready(bufs)
    w.delete()
    return bufs
