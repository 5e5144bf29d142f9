"""M3's MLPs: swiglu-oai dense MLPs and the sigmoid-routed mixture of experts.

transformers' ``MiniMaxM3VLDenseMLP``, ``MiniMaxM3VLTopKRouter``, ``MiniMaxM3VLExperts`` and
``MiniMaxM3VLSparseMoeBlock``, in JAX. Weights keep PyTorch's ``[out, in]`` orientation; the
packed ``gate_up_proj`` is held as ``[..., 2, I, H]`` (gate half first) so that tensor parallel
can split ``I`` and every device keeps matching gate and up rows.

The routed experts are grouped matmuls (``jax.lax.ragged_dot_general``) over the tokens sorted
by expert, so their work follows ``num_experts_per_tok``, not ``num_local_experts`` (M3: 4 of
128). On this project's CPUs a dense dispatch (every expert on every token, masked) measured
1.3–2.5× faster at CPU sizes (jaxlib 0.10.2's CPU ragged_dot computes every group); it would
cost M3 32× the FLOPs, so the grouped form is the one kept (README, "The model").

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

from .parallel import AXIS, leaf_spec

_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),     # x [m, in] · w[g] [out, in]
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def linear(x, w):
    """``x @ w.T`` for a PyTorch-layout weight ``[out, in]``, in the weight's dtype with fp32
    accumulation (bf16 checkpoints stay bf16; fp32 ones compute in fp32)."""
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def swiglu_oai(gate_up, alpha, limit):
    """``gate_up [..., 2, I]`` -> ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``,
    g = min(gate, limit) (transformers' ``_apply_gate``)."""
    gate = jnp.minimum(gate_up[..., 0, :], limit)
    up = jnp.clip(gate_up[..., 1, :], -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(gate * alpha)


def dense_mlp(p, x, cfg):
    """``MiniMaxM3VLDenseMLP``: p ``gate_up_proj [2, I, H]``, ``down_proj [H, I]``; x ``[T, H]``."""
    gu = jnp.einsum("th,gih->tgi", x.astype(p["gate_up_proj"].dtype), p["gate_up_proj"],
                    preferred_element_type=jnp.float32)
    return linear(swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit), p["down_proj"])


def route(p, x, cfg):
    """``MiniMaxM3VLTopKRouter``: sigmoid scores; the correction bias only chooses.

    Returns ``(weights float32[T, k], experts int32[T, k])``, weights renormalised to sum 1.
    """
    scores = jax.nn.sigmoid(linear(x, p["gate"]).astype(jnp.float32))
    _, experts = jax.lax.top_k(scores + p["e_score_correction_bias"].astype(jnp.float32),
                               cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def experts(p, x, weights, chosen, cfg):
    """``MiniMaxM3VLExperts``: Σ_k weights[t, k] · expert_{chosen[t, k]}(x[t]).

    p ``gate_up_proj [E, 2, I, H]``, ``down_proj [E, H, I]`` (I may be this device's slice).
    """
    E, _, I, H = p["gate_up_proj"].shape
    k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)                 # (token, k) pairs grouped by expert
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    w_gu, w_down = p["gate_up_proj"], p["down_proj"]
    xs = x[token].astype(w_gu.dtype)
    gu = jax.lax.ragged_dot_general(xs, w_gu.reshape(E, 2 * I, H), sizes, _RAGGED,
                                    preferred_element_type=jnp.float32).reshape(-1, 2, I)
    h = swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit).astype(w_down.dtype)
    y = jax.lax.ragged_dot_general(h, w_down, sizes, _RAGGED, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((x.shape[0], H), jnp.float32).at[token].add(y)


def sparse_moe(p, x, cfg):
    """``MiniMaxM3VLSparseMoeBlock``: routed experts × routed_scaling_factor + shared expert."""
    weights, chosen = route(p, x, cfg)
    routed = experts(p["experts"], x, weights, chosen, cfg)
    return routed * cfg.routed_scaling_factor + dense_mlp(p["shared_experts"], x, cfg)


# ----------------------------------------------------------------------------- tensor parallel
def mlp(p, x, cfg, moe: bool):
    """The layer's MLP on ``x [T, H]`` (fp32 out). Under a mesh with a "tp" axis of size > 1
    (``jax.set_mesh``, see engine.py) it runs per device on the local ``I`` slices and sums
    the partial outputs with one ``psum``."""
    body = functools.partial(sparse_moe if moe else dense_mlp, cfg=cfg)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return body(p, x)
    tp = mesh.shape[AXIS]
    specs = jax.tree_util.tree_map_with_path(lambda path, _: leaf_spec(path, cfg, tp), p)

    def local(p_, x_):
        return jax.lax.psum(body(p_, x_), AXIS)

    return jax.shard_map(local, in_specs=(specs, P()), out_specs=P(), check_vma=False)(p, x)
