"""The ops are inference-only (SPEC §7): differentiating through one says so.

JAX's own error ("Differentiation rule for 'm3sparse_sparse_decode' not implemented") does not
say why or what to do. A JVP rule that raises covers ``jax.grad``, ``jax.jvp``, ``jax.vjp`` and
``jax.linearize``; it only runs when a tangent reaches the op, so operands under
``jax.lax.stop_gradient`` (or integer/uint8 operands) are fine.
"""

from __future__ import annotations

from jax.interpreters import ad


def forbid_derivatives(*primitives) -> None:
    for prim in primitives:
        ad.primitive_jvps[prim] = _raise_for(prim.name.removeprefix("m3sparse_"))


def _raise_for(op: str):
    def jvp(primals, tangents, **params):
        raise NotImplementedError(
            f"jax_m3sparse.{op} is inference-only: it has no derivative (SPEC §7). Put "
            "jax.lax.stop_gradient on its float operands (q, key, value, k_scale, v_scale) where "
            "they depend on what you differentiate, or differentiate a pure-jnp model instead.")

    return jvp
