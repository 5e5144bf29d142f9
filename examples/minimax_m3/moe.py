"""M3's MLPs: swiglu-oai dense MLPs and the sigmoid-routed mixture of experts.

transformers' ``MiniMaxM3VLDenseMLP``, ``MiniMaxM3VLTopKRouter``, ``MiniMaxM3VLExperts`` and
``MiniMaxM3VLSparseMoeBlock``, in JAX. Weights keep PyTorch's ``[out, in]`` orientation; the
packed ``gate_up_proj`` is held as ``[..., 2, I, H]`` (gate half first) so that tensor parallel
can split ``I`` and every device keeps matching gate and up rows.

The routed experts are dispatched densely: every expert runs on every token and its output
is weighted by the token's routing weight (zero where not chosen). Chosen by measurement on the
CPU (README, "The model"): ``jax.lax.ragged_dot`` (sorted tokens, grouped matmuls) was 1.3–4×
slower at the example's shapes, because jaxlib's CPU lowering of ragged_dot is itself a masked
product over every group for every row. Dense dispatch is exact, sort-free and static-shaped;
its FLOPs are ``num_local_experts / num_experts_per_tok`` times the routed ones (M3: 32×),
which a decode step at M3 size hides (it is bound by reading the experts' weights) and a
prefill chunk does not.

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
    """``MiniMaxM3VLExperts``: Σ_k weights[t, k] · expert_{chosen[t, k]}(x[t]), dispatched
    densely: every expert on every token, each output scaled by its routing weight (0 where
    not chosen), summed in one contraction over experts and ``I``.

    p ``gate_up_proj [E, 2, I, H]``, ``down_proj [E, H, I]`` (I may be this device's slice).
    """
    E = p["gate_up_proj"].shape[0]
    dense_w = jnp.sum(jnp.where(chosen[:, :, None] == jnp.arange(E), weights[:, :, None], 0.0),
                      axis=1)                                            # [T, E]
    w_gu, w_down = p["gate_up_proj"], p["down_proj"]
    gu = jnp.einsum("th,egih->etgi", x.astype(w_gu.dtype), w_gu,
                    preferred_element_type=jnp.float32)
    h = swiglu_oai(gu, cfg.swiglu_alpha, cfg.swiglu_limit) * dense_w.T[:, :, None]
    return jnp.einsum("eti,ehi->th", h.astype(w_down.dtype), w_down,
                      preferred_element_type=jnp.float32)


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
