"""A small continuous-batching engine around a model step (:class:`ModelStep`).

The Python side only schedules: it owns the page allocator and the per-request state, builds
numpy arrays for one step (decode requests first, prefill chunks after, padded to a few shape
buckets) and reads back the sampled tokens (sampling happens in the step: ``sampling.py``).
All model work is the one jitted step; each padded shape is compiled once (jit's cache; a
jax.monitoring hook counts compilations), never per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from . import compare as m3_compare
from . import model as m3_model
from . import parallel
from .config import ModelConfig
from .sampling import GREEDY, SamplingParams, batch_arrays


# ----------------------------------------------------------------------------- model interface
@runtime_checkable
class ModelStep(Protocol):
    """What the :class:`Engine` drives: a module (or object) with these two functions.
    Implemented by ``minimax_m3.model``, ``minimax_m3.compare`` (the served step beside its
    baseline stream) and ``real_model.model`` (a Llama)."""

    def allocate_caches(self, cfg, num_pages: int) -> dict:
        """The step's caches: a flat dict of arrays, donated to every step (under ``--tp``
        the entry "kv" is sharded over its head slots, the others replicated)."""

    def forward_step(self, params, caches: dict, batch: dict, *, cfg, num_decode_requests: int,
                     decode_query_len: int, num_logprobs: int = 0,
                     return_logits: bool = False) -> tuple[dict, dict]:
        """One jitted step (caches donated). ``batch``: ``tokens [T]``, ``slot_mapping [T]``,
        ``query_lens``, ``context_lens [R]``, ``block_table [R, M]`` (decode requests first,
        each ``decode_query_len`` rows; SPEC §5.6) and ``sampling.batch_arrays``' ``[S]``
        arrays. Returns ``(caches, out)``; ``out`` holds at least ``tokens int32[S]`` (the
        sampled rows' tokens) and ``blocks [L, 2]`` (token-block pairs attended, visible); with
        ``num_logprobs`` N ``logprob [S]``, ``top_logprobs [S, N]``, ``top_ids [S, N]``; with
        ``return_logits`` ``logits float32[S, V]``."""


# ----------------------------------------------------------------------------- pages
class PageAllocator:
    """A free list of cache pages. Pages are never shared: double frees and leaks raise."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages - 1, -1, -1))   # pop() hands out low ids first
        self.owner: dict[int, int] = {}                        # page -> request id
        self.peak_in_use = 0
        self.total_allocations = 0

    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, n: int, owner: int) -> list[int]:
        if n > len(self.free_pages):
            raise RuntimeError(f"out of pages: want {n}, {len(self.free_pages)} free")
        pages = [self.free_pages.pop() for _ in range(n)]
        for p in pages:
            assert p not in self.owner, f"page {p} handed out twice"
            self.owner[p] = owner
        self.total_allocations += n
        self.peak_in_use = max(self.peak_in_use, len(self.owner))
        return pages

    def free(self, pages: list[int], owner: int) -> None:
        for p in pages:
            if self.owner.pop(p, None) != owner:
                raise RuntimeError(f"page {p} freed by request {owner}, which does not own it")
            self.free_pages.append(p)


# ----------------------------------------------------------------------------- requests
@dataclasses.dataclass
class Request:
    """One prompt's state. ``tokens`` = prompt + generated; the first ``num_cached`` are in
    the caches (a decoding request's last token is not: it is the next step's input)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    tokens: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" (sampled a stop token, kept) or "length"
    # per generated token: logits rows (EngineConfig.keep_logits), (logprob, top ids, top
    # logprobs) (EngineConfig.num_logprobs)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    logprobs: list[tuple] = dataclasses.field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        """Adds a generated token; a stop token (kept) or the last allowed one finishes."""
        self.tokens.append(token)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_new_tokens:
            self.finish_reason = "length"


def propose_drafts(tokens: list[int], n: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafts: the ``n`` tokens that followed the latest earlier occurrence of
    the longest suffix n-gram (3, 2, then 1 tokens); the last token repeated if none."""
    arr = np.asarray(tokens)
    for g in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = arr[-g:]
        for start in range(len(tokens) - g - 1, -1, -1):
            if np.array_equal(arr[start:start + g], tail):
                follow = tokens[start + g:start + g + n]
                return follow + [tokens[-1]] * (n - len(follow))
    return [tokens[-1]] * n


# ----------------------------------------------------------------------------- engine
class _CompileCounter:
    """Counts XLA backend compilations (a jax.monitoring hook), to prove one per shape."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


_COMPILES = _CompileCounter()


@dataclasses.dataclass
class EngineConfig:
    num_pages: int = 48             # the CLI sizes it from the prompts
    max_running: int = 4            # requests in flight (= padded decode / prefill rows)
    chunk_size: int = 256           # prefill tokens per step (all prefill requests together)
    max_seq_len: int = 8192         # sets the block table width M
    spec_tokens: int = 0            # prompt-lookup draft tokens verified per decode step
    compare: bool = True            # run the baseline stream alongside (compare.py)
    tp: int = 1                     # tensor-parallel devices (parallel.py); 1: one device
    follow: str = "served"          # whose sampled tokens are generated: "served" or "baseline"
    num_logprobs: int = 0           # top-N log-probabilities per generated token (0: none)
    keep_logits: bool = False       # keep each generated token's logits row (host memory)

    @property
    def decode_query_len(self) -> int:
        return 1 + self.spec_tokens

    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded prefill token counts: two shapes (decode-only, with a chunk), two compilations.
        A short tail chunk pads to ``chunk_size``: cheaper here than a third compile."""
        return (0, self.chunk_size)


class Engine:
    """Continuous batching: admit, chunked prefill, batched decode, sampling in the step (+
    prompt-lookup speculative decoding), stop tokens. :meth:`on_step` sees every step's output
    (override it to record more than :class:`RunStats` does)."""

    def __init__(self, params, cfg: ModelConfig, ecfg: EngineConfig, model: ModelStep = m3_model):
        # model: a ModelStep (examples/real_model passes its Llama here). With ecfg.compare the
        # M3 step runs inside compare.py's wrapper, which adds the baseline stream.
        if not isinstance(model, ModelStep):
            raise TypeError(f"{model!r} lacks allocate_caches / forward_step (engine.ModelStep)")
        if ecfg.compare:
            if model is not m3_model:
                raise ValueError("compare=True: the baseline stream is the MiniMax M3 model's "
                                 "(compare.py); run this model with compare=False")
            model = m3_compare
        if ecfg.follow not in ("served", "baseline") or (ecfg.follow == "baseline"
                                                         and not ecfg.compare):
            raise ValueError(f"follow={ecfg.follow!r}: 'served', or 'baseline' with compare")
        self.params, self.cfg, self.ecfg, self.model = params, cfg, ecfg, model
        self.caches = model.allocate_caches(cfg, ecfg.num_pages)
        self.mesh = None
        if ecfg.tp > 1:
            self.mesh = parallel.make_mesh(ecfg.tp)
            self.params, self.caches = parallel.shard(params, self.caches, cfg, self.mesh)
        self.host_bytes = 0                      # bytes the last step brought to the host
        self.allocator = PageAllocator(ecfg.num_pages)
        self.max_blocks = -(-ecfg.max_seq_len // cfg.block_size)
        self.compiles: dict[tuple, int] = {}     # padded batch shapes -> XLA compilations
        self.compile_seconds = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = RunStats(cfg.num_layers)

    # -- requests
    def add_request(self, rid: int, prompt: list[int], max_new_tokens: int,
                    sampling: SamplingParams = GREEDY) -> None:
        need = len(prompt) + max_new_tokens + self.ecfg.spec_tokens
        if need > self.max_blocks * self.cfg.block_size or not prompt or max_new_tokens < 1:
            raise ValueError(f"request {rid}: {len(prompt)} prompt tokens + {max_new_tokens} "
                             f"new do not fit max_seq_len {self.ecfg.max_seq_len} (or none)")
        limit = getattr(self.cfg, "max_position_embeddings", None)   # M3's; other models: none
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise ValueError(f"request {rid}: {len(prompt)} prompt tokens + {max_new_tokens} "
                             f"new exceed the model's max_position_embeddings {limit} "
                             f"(config.json)")
        self.waiting.append(Request(rid, list(prompt), max_new_tokens, sampling))

    def _pages_needed(self, r: Request) -> int:
        """Pages for the whole request (prompt, new tokens, rejected-draft slots)."""
        return -(-(len(r.prompt) + r.max_new_tokens + self.ecfg.spec_tokens) // self.cfg.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.ecfg.max_running:
            need = self._pages_needed(self.waiting[0])
            if need > self.allocator.num_free():
                if not self.running:
                    raise RuntimeError(f"request {self.waiting[0].rid} needs {need} pages, the "
                                       f"pool has {self.allocator.num_pages}: raise --num-pages")
                return
            r = self.waiting.pop(0)
            r.pages = self.allocator.allocate(need, r.rid)
            self.running.append(r)

    def _finish(self, r: Request) -> None:
        self.allocator.free(r.pages, r.rid)
        r.pages = []
        self.running.remove(r)
        self.finished.append(r)

    # -- one step
    def _slot(self, r: Request, pos: int) -> int:
        return r.pages[pos // self.cfg.block_size] * self.cfg.block_size + pos % self.cfg.block_size

    def _build_batch(self):
        """One step's numpy arrays: R_half decode rows (each ``decode_query_len`` tokens: the
        last token and its drafts), then up to R_half prefill chunks sharing ``chunk_size``
        tokens, padded to a bucket; and the sampling arrays of its ``S`` sampled rows: every
        decode row (sample ``i·dql + k`` = row ``i·dql + k``), then the last token of each
        prefill chunk that completes its prompt (sample ``R_half·dql + j`` for chunk j), −1
        elsewhere. Returns (batch, decoding, [(request, n)], drafts)."""
        e = self.ecfg
        dql, R_half = e.decode_query_len, e.max_running
        decoding = [r for r in self.running if not r.prefilling][:R_half]
        prefill, budget = [], e.chunk_size
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.prompt) - r.num_cached, budget)
                prefill.append((r, n))
                budget -= n
        n_pre = e.chunk_size - budget
        bucket = next(b for b in e.prefill_buckets() if b >= n_pre)
        T = R_half * dql + bucket
        S = R_half * dql + (R_half if bucket else 0)
        tokens = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        qlens = np.zeros(2 * R_half, np.int32)
        ctx = np.zeros(2 * R_half, np.int32)
        table = np.full((2 * R_half, self.max_blocks), -1, np.int32)
        sample_rows = np.full(S, -1, np.int32)
        sampling = [GREEDY] * S
        drafts = {}
        for i, r in enumerate(decoding):
            d = propose_drafts(r.tokens, e.spec_tokens) if e.spec_tokens else []
            drafts[r.rid] = d
            rows = [r.tokens[-1], *d]
            tokens[i * dql:(i + 1) * dql] = rows
            slots[i * dql:(i + 1) * dql] = [self._slot(r, r.num_cached + j) for j in range(dql)]
            qlens[i], ctx[i] = dql, r.num_cached
            table[i, :len(r.pages)] = r.pages
            sample_rows[i * dql:(i + 1) * dql] = np.arange(i * dql, (i + 1) * dql)
            sampling[i * dql:(i + 1) * dql] = [r.sampling] * dql
        t = R_half * dql
        for j, (r, n) in enumerate(prefill):
            row = R_half + j
            tokens[t:t + n] = r.prompt[r.num_cached:r.num_cached + n]
            slots[t:t + n] = [self._slot(r, r.num_cached + k) for k in range(n)]
            qlens[row], ctx[row] = n, r.num_cached
            table[row, :len(r.pages)] = r.pages
            t += n
            if r.num_cached + n == len(r.prompt):     # the prompt's last token samples
                sample_rows[R_half * dql + j] = t - 1
                sampling[R_half * dql + j] = r.sampling
        batch = dict(tokens=tokens, slot_mapping=slots, query_lens=qlens, context_lens=ctx,
                     block_table=table, **batch_arrays(sample_rows, sampling))
        return batch, decoding, prefill, drafts

    def _run_step(self, batch):
        """Calls the jitted step and fetches its out (tokens, and what the options add); a
        call that compiles is timed as compilation, not as work."""
        key = tuple((k, v.shape) for k, v in sorted(batch.items()))
        before = _COMPILES.count
        t0 = time.perf_counter()
        # The mesh context lets the MLPs and the vocabulary run per device (shard_map).
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            self.caches, out = self.model.forward_step(
                self.params, self.caches, batch, cfg=self.cfg,
                num_decode_requests=self.ecfg.max_running,
                decode_query_len=self.ecfg.decode_query_len,
                num_logprobs=self.ecfg.num_logprobs, return_logits=self.ecfg.keep_logits)
        out = jax.device_get(out)
        self.host_bytes = sum(np.asarray(v).nbytes for v in jax.tree_util.tree_leaves(out))
        if self.ecfg.follow == "baseline":
            out["tokens"] = out["baseline_tokens"]
        seconds = time.perf_counter() - t0
        compiled = _COMPILES.count - before
        if compiled:
            self.compiles[key] = self.compiles.get(key, 0) + compiled
            self.compile_seconds += seconds
        return out, seconds, bool(compiled)

    def step(self) -> int:
        """Admits, runs one jitted step, takes its sampled tokens; finished requests (stop
        token or max_new_tokens) free their pages. Returns the number of tokens processed."""
        self._admit()
        batch, decoding, prefill, drafts = self._build_batch()
        out, seconds, compiled = self._run_step(batch)
        self.on_step(out, prefill, decoding)
        emitted, rows = self._accept_decodes(decoding, drafts, out)
        prefilled, first_tokens = self._advance_prefills(prefill, out)
        base = out.get("baseline_logits")
        self.stats.record_step(None if compiled else seconds, prefilled, emitted, len(decoding),
                               out.get("attn_stats"),
                               None if base is None else (out["logits"][rows], base[rows]))
        self.stats.blocks += np.asarray(out["blocks"], np.int64)
        if "same_blocks" in out:
            self.stats.same_blocks += np.asarray(out["same_blocks"], np.int64)
        for r in [r for r in self.running if r.done]:
            self._finish(r)
        return prefilled + emitted + first_tokens

    def on_step(self, out: dict, prefill: list[tuple[Request, int]],
                decoding: list[Request]) -> None:
        """The per-step hook: called once per step with what it returned, before the engine
        takes the sampled tokens. Override it to read more of ``out`` (the default does nothing);
        ``examples/real_model/quality.py`` scores every prefill row this way.

        ``out``: the model's ``forward_step`` output (:class:`ModelStep`), fetched to the host.
        ``decoding``: the decode requests; request i's ``decode_query_len`` rows (its last token,
        then its drafts) are batch rows and samples ``i·dql .. (i + 1)·dql − 1``. ``prefill``:
        ``(request, n)`` per prefill chunk, in batch order; the chunks' tokens follow one another
        from batch row ``max_running · decode_query_len``, and each ``request.num_cached`` is
        still its chunk's first position.
        """

    def _accept_decodes(self, decoding, drafts, out):
        """The decode rows' sampled tokens; drafts are kept while they equal the token sampled
        at the row before (prompt-lookup speculative decoding: each row samples its position
        with that position's key, so the tokens are those of plain decoding). Returns (tokens
        emitted, sample indices that emitted them)."""
        dql = self.ecfg.decode_query_len
        emitted, rows = 0, []
        for i, r in enumerate(decoding):
            sampled = out["tokens"][i * dql:(i + 1) * dql]
            d = drafts[r.rid]
            a = 0
            while a < len(d) and sampled[a] == d[a]:
                a += 1
            r.drafted += len(d)
            r.accepted += a
            n = self._emit(r, [int(t) for t in sampled[:a + 1]], i * dql, out)
            rows += range(i * dql, i * dql + n)
            r.num_cached += a + 1          # the input token and the accepted drafts
            emitted += n
        return emitted, rows

    def _advance_prefills(self, prefill, out):
        """Marks the chunks cached; a finished prompt takes its first new token (sample
        ``R_half·dql + j`` of chunk j). Returns (prompt tokens prefilled, first tokens)."""
        s0 = self.ecfg.max_running * self.ecfg.decode_query_len
        prefilled = first_tokens = 0
        for j, (r, n) in enumerate(prefill):
            r.num_cached += n
            prefilled += n
            if not r.prefilling:           # the prompt's last token gives the first new one
                first_tokens += self._emit(r, [int(out["tokens"][s0 + j])], s0 + j, out)
        return prefilled, first_tokens

    def _emit(self, r: Request, tokens: list[int], s: int, out) -> int:
        """Appends ``tokens`` (sampled at indices ``s, s + 1, ...``) until ``r`` finishes;
        records what the step returned for each. Returns how many were appended."""
        n = 0
        for k, t in enumerate(tokens):
            if r.done:
                break
            r.append(t)
            n += 1
            if self.ecfg.keep_logits:
                r.logits.append(np.array(out["logits"][s + k]))
            if self.ecfg.num_logprobs:
                r.logprobs.append((float(out["logprob"][s + k]), out["top_ids"][s + k].tolist(),
                                   out["top_logprobs"][s + k].tolist()))
            if "baseline_logits" in out:
                self.stats.record_token(out["logits"][s + k], out["baseline_logits"][s + k])
        return n

    def run(self, progress=None) -> list[Request]:
        """Steps until every request is finished; ``progress(n_tokens)`` after each step."""
        while self.waiting or self.running:
            n = self.step()
            if progress:
                progress(n)
        return sorted(self.finished, key=lambda r: r.rid)


# ----------------------------------------------------------------------------- statistics
def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


class RunStats:
    """Throughput and served-vs-baseline agreement (compare.py), accumulated over a run."""

    def __init__(self, num_layers: int):
        self.prefill_tokens = self.prefill_seconds = 0
        self.decode_tokens = self.decode_seconds = 0
        self.decode_only_steps = self.decode_requests = 0
        self.blocks = np.zeros((num_layers, 2), np.int64)    # (selected, visible) per layer
        self.same_blocks = np.zeros((num_layers, 2), np.int64)  # (same set, pairs), vs baseline
        self.attn_sums = np.zeros((num_layers, 4))          # over all rows of the run
        self.decode_steps: list[dict] = []                   # per step with decode rows
        self.logit_cos: list[float] = []                     # per generated token, vs baseline
        self.agree: list[bool] = []                          # same argmax, per generated token

    def record_token(self, served, baseline) -> None:
        """One generated token's served and baseline logits rows."""
        self.logit_cos.append(cosine(served, baseline))
        self.agree.append(bool(np.argmax(served) == np.argmax(baseline)))

    def record_step(self, seconds, prefill_tokens, decode_tokens, num_decoding, attn_stats,
                    logit_pairs):
        # Mixed steps count toward prefill (their time is dominated by the chunk); steps that
        # compiled (seconds None) count toward neither.
        if seconds is None:
            pass
        elif prefill_tokens:
            self.prefill_tokens += prefill_tokens
            self.prefill_seconds += seconds
        else:
            self.decode_tokens += decode_tokens
            self.decode_seconds += seconds
            self.decode_only_steps += 1
            self.decode_requests += num_decoding
        if attn_stats is None:
            return
        attn_stats = np.asarray(attn_stats, np.float64)      # [L, 2 (decode, prefill), 4]
        self.attn_sums += attn_stats.sum(axis=1)
        if num_decoding and logit_pairs is not None and len(logit_pairs[0]):
            served, base = logit_pairs
            self.decode_steps.append(dict(
                attn_cos=[_cos_from_sums(s) for s in attn_stats[:, 0]],
                logit_cos=float(np.mean([cosine(a, b) for a, b in zip(served, base)])),
                agree=float(np.mean(served.argmax(-1) == base.argmax(-1)))))

    def per_layer(self):
        """(cosine, relative Frobenius error) of the served attention output per layer."""
        return ([_cos_from_sums(s) for s in self.attn_sums],
                [float(np.sqrt(s[3] / max(s[2], 1e-30))) for s in self.attn_sums])


def _cos_from_sums(s) -> float:
    return float(s[0] / max(np.sqrt(s[1] * s[2]), 1e-30))
