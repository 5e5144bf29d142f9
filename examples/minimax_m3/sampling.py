"""Token sampling on the device: greedy, temperature, top-k, top-p, top-N log-probabilities.

The step computes logits only for the ``S`` rows that sample (each decode row, the last token
of each prefill chunk that completes its prompt; ``sample_rows``, −1 = none) and samples them
here, so the host receives ``S`` token ids (and log-probabilities when asked), never logits.

Reproducible by construction: row s draws its noise from the key
``fold_in(key(seed[s]), position[s])``, where ``position`` is the absolute position of the token
being sampled. A request's tokens therefore depend on its seed, its prompt and the model only,
never on its batch, its step or the speculative drafts (a verified draft row samples its
position with the same key a plain decode step would).

Sampling is the Gumbel-max trick: ``argmax(z + g)`` over the kept tokens, ``z = logits / T``,
``g`` i.i.d. Gumbel(0, 1), is a draw from ``softmax(z)`` renormalised over those tokens. Top-k
is applied first, then top-p on the top-k-renormalised distribution (the order of transformers'
warpers and vLLM): the kept set is the smallest prefix of the sorted tokens whose probability
reaches ``top_p``. The mask is a threshold on the value of the last kept token, so tokens that
tie with it exactly are kept too. Rows with ``temperature < GREEDY_BELOW`` take the argmax
(lowest id on ties), as the engine always did.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

GREEDY_BELOW = 1e-5      # temperatures below this sample greedily (z = logits / T overflows)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: ``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` 1 =
    off; ``seed`` (uint32) keys the request's draws; a token of ``stop_token_ids`` ends the
    request (kept as its last generated token)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off; got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32) (got {self.seed})")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


GREEDY = SamplingParams()


def batch_arrays(rows, params=None) -> dict:
    """The step's sampling arrays (numpy) for ``S = len(rows)`` rows.

    rows: ``int[S]`` token rows of the step that sample (−1 = none). params: one
    :class:`SamplingParams` per row (None: greedy). Returns ``sample_rows int32[S]``, and
    unless every row is greedy ``temperature float32[S]``, ``top_k int32[S]``, ``top_p
    float32[S]``, ``seed uint32[S]``. Without them the step takes the argmax and compiles
    no sampler (the step is traced once per set of keys: greedy-only runs never compile it).
    """
    rows = np.asarray(rows, np.int32)
    params = [GREEDY] * len(rows) if params is None else list(params)
    if len(params) != len(rows):
        raise ValueError(f"{len(params)} SamplingParams for {len(rows)} rows")
    if all(p.temperature < GREEDY_BELOW for p in params):
        return dict(sample_rows=rows)
    get = lambda name, dtype: np.array([getattr(p, name) for p in params], dtype).reshape(-1)
    return dict(sample_rows=rows, temperature=get("temperature", np.float32),
                top_k=get("top_k", np.int32), top_p=get("top_p", np.float32),
                seed=get("seed", np.uint32))


def row_keys(seed, position):
    """``key[S]``: ``fold_in(key(seed), position)`` per row (seed ``uint32[S]``, position
    ``int32[S]``, the absolute position of the token being sampled)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def filter_mask(z, top_k, top_p):
    """``bool[S, V]``: the tokens top-k then top-p keep, per row of ``z float32[S, V]``.

    top_k ``int32[S]`` (0 or ≥ V: off), top_p ``float32[S]`` (≥ 1: off). At least the most
    likely token is always kept; tokens equal to the last kept value are kept too.
    """
    V = z.shape[-1]
    desc = -jnp.sort(-z, axis=-1)                                        # [S, V], descending
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)[:, None]
    in_k = jnp.arange(V)[None] < k
    p = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    above = jnp.cumsum(p, axis=-1) - p                 # mass of the tokens ranked before
    keep = in_k & ((above < top_p[:, None]) | (top_p[:, None] >= 1.0))
    last = jnp.sum(keep, axis=-1, keepdims=True) - 1                    # ≥ 0: rank 0 kept
    return z >= jnp.take_along_axis(desc, last, axis=-1)


def sample(logits, temperature, top_k, top_p, seed, position):
    """``int32[S]`` tokens from ``logits float32[S, V]`` with per-row parameters (``[S]``
    arrays as :func:`batch_arrays` makes them) and ``position int32[S]`` (see module doc)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    hot = temperature >= GREEDY_BELOW

    def stochastic():
        z = logits / jnp.where(hot, temperature, 1.0)[:, None]
        filtering = hot & (((top_k > 0) & (top_k < z.shape[-1])) | (top_p < 1.0))
        keep = jax.lax.cond(jnp.any(filtering), lambda: filter_mask(z, top_k, top_p),
                            lambda: jnp.ones(z.shape, bool))
        g = jax.vmap(lambda k: jax.random.gumbel(k, z.shape[-1:], jnp.float32))(
            row_keys(seed, position))
        return jnp.argmax(jnp.where(keep, z + g, -jnp.inf), axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(hot), stochastic, lambda: greedy)
    return jnp.where(hot, drawn, greedy)


def logprobs(logits, tokens, n: int) -> dict:
    """Log-probabilities under the model's distribution (``log_softmax(logits)``, before
    temperature and filters): ``logprob float32[S]`` of ``tokens``, and the ``n`` most likely
    tokens ``top_logprobs float32[S, n]``, ``top_ids int32[S, n]`` (n static, > 0)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, jnp.clip(tokens, 0)[:, None], axis=-1)[:, 0]
    vals, ids = jax.lax.top_k(logits, n)
    return dict(logprob=chosen - lse, top_logprobs=vals - lse[:, None],
                top_ids=ids.astype(jnp.int32))


def sample_rows_out(logits, batch, pos, *, num_logprobs: int = 0, return_logits: bool = False):
    """What a step returns for its sampled rows (the engine's model interface).

    logits ``float32[S, V]`` of the rows ``batch["sample_rows"]``; pos ``int32[T]`` the
    absolute position of every token row; batch without ``temperature``: every row greedy
    (:func:`batch_arrays`). Returns ``tokens int32[S]`` (−1 where
    ``sample_rows`` is −1), with ``num_logprobs`` :func:`logprobs`' arrays, with
    ``return_logits`` the ``logits`` themselves.
    """
    rows = batch["sample_rows"]
    if "temperature" in batch:
        position = jnp.where(rows >= 0, pos[jnp.clip(rows, 0, pos.shape[0] - 1)] + 1, 0)
        tokens = sample(logits, batch["temperature"], batch["top_k"], batch["top_p"],
                        batch["seed"], position)
    else:                                                # every row greedy
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = dict(tokens=jnp.where(rows >= 0, tokens, -1))
    if num_logprobs:
        out.update(logprobs(logits, tokens, num_logprobs))
    if return_logits:
        out["logits"] = logits
    return out
