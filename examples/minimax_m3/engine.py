"""A small continuous-batching engine around :func:`model.forward_step`.

The Python side only schedules: it owns the page allocator and the per-request state, builds
numpy arrays for one step (decode requests first, prefill chunks after, padded to a few shape
buckets) and reads back logits. All model work is the one jitted step; each padded shape is
compiled once (jit's cache; a jax.monitoring hook counts compilations), never per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np

from . import model as m3_model
from . import parallel
from .config import ModelConfig


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
    tokens: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)      # per generated token
    ref_logits: list[np.ndarray] = dataclasses.field(default_factory=list)
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
        return len(self.generated) >= self.max_new_tokens


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
    compare: bool = True            # run the reference stream alongside
    tp: int = 1                     # tensor-parallel devices (parallel.py); 1: one device
    follow: str = "served"          # whose greedy tokens are generated: "served" or "reference"

    @property
    def decode_query_len(self) -> int:
        return 1 + self.spec_tokens

    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded prefill token counts: two shapes (decode-only, with a chunk), two compilations.
        A short tail chunk pads to ``chunk_size``: cheaper here than a third compile."""
        return (0, self.chunk_size)


class Engine:
    """Continuous batching: admit, chunked prefill, batched decode, greedy (+ speculative)."""

    def __init__(self, params, cfg: ModelConfig, ecfg: EngineConfig, model=m3_model):
        # model: a module with allocate_caches(cfg, num_pages, compare) and the jitted
        # forward_step of model.py's signature (examples/real_model passes its Llama here).
        self.params, self.cfg, self.ecfg, self.model = params, cfg, ecfg, model
        self.caches = model.allocate_caches(cfg, ecfg.num_pages, ecfg.compare)
        self.mesh = None
        if ecfg.tp > 1:
            self.mesh = parallel.make_mesh(ecfg.tp)
            self.params, self.caches = parallel.shard(params, self.caches, cfg, self.mesh)
        if ecfg.follow not in ("served", "reference") or (ecfg.follow == "reference"
                                                          and not ecfg.compare):
            raise ValueError(f"follow={ecfg.follow!r}: 'served', or 'reference' with compare")
        self.allocator = PageAllocator(ecfg.num_pages)
        self.max_blocks = -(-ecfg.max_seq_len // cfg.block_size)
        self.compiles: dict[tuple, int] = {}     # padded batch shapes -> XLA compilations
        self.compile_seconds = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = RunStats(cfg.num_layers)

    # -- requests
    def add_request(self, rid: int, prompt: list[int], max_new_tokens: int) -> None:
        need = len(prompt) + max_new_tokens + self.ecfg.spec_tokens
        if need > self.max_blocks * self.cfg.block_size or not prompt:
            raise ValueError(f"request {rid}: {len(prompt)} prompt tokens + {max_new_tokens} "
                             f"new do not fit max_seq_len {self.ecfg.max_seq_len}")
        self.waiting.append(Request(rid, list(prompt), max_new_tokens))

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
        tokens, padded to a bucket. Returns (batch, decoding, [(request, n)], drafts)."""
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
        tokens = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        qlens = np.zeros(2 * R_half, np.int32)
        ctx = np.zeros(2 * R_half, np.int32)
        table = np.full((2 * R_half, self.max_blocks), -1, np.int32)
        drafts = {}
        for i, r in enumerate(decoding):
            d = propose_drafts(r.tokens, e.spec_tokens) if e.spec_tokens else []
            drafts[r.rid] = d
            rows = [r.tokens[-1], *d]
            tokens[i * dql:(i + 1) * dql] = rows
            slots[i * dql:(i + 1) * dql] = [self._slot(r, r.num_cached + j) for j in range(dql)]
            qlens[i], ctx[i] = dql, r.num_cached
            table[i, :len(r.pages)] = r.pages
        t = R_half * dql
        for j, (r, n) in enumerate(prefill):
            row = R_half + j
            tokens[t:t + n] = r.prompt[r.num_cached:r.num_cached + n]
            slots[t:t + n] = [self._slot(r, r.num_cached + k) for k in range(n)]
            qlens[row], ctx[row] = n, r.num_cached
            table[row, :len(r.pages)] = r.pages
            t += n
        batch = dict(tokens=tokens, slot_mapping=slots, query_lens=qlens, context_lens=ctx,
                     block_table=table)
        return batch, decoding, prefill, drafts

    def _run_step(self, batch):
        """Calls the jitted step; a call that compiles is timed as compilation, not as work."""
        key = tuple((k, v.shape) for k, v in sorted(batch.items()))
        before = _COMPILES.count
        t0 = time.perf_counter()
        # The mesh context lets the MLPs run per device (moe.mlp's shard_map).
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            self.caches, out = self.model.forward_step(
                self.params, self.caches, batch, cfg=self.cfg,
                num_decode_requests=self.ecfg.max_running,
                decode_query_len=self.ecfg.decode_query_len, compare=self.ecfg.compare)
        out = jax.device_get(out)
        if self.ecfg.follow == "reference":
            out["greedy"] = out["ref_greedy"]
        seconds = time.perf_counter() - t0
        compiled = _COMPILES.count - before
        if compiled:
            self.compiles[key] = self.compiles.get(key, 0) + compiled
            self.compile_seconds += seconds
        return out, seconds, bool(compiled)

    def step(self) -> int:
        """Admits, runs one jitted step, samples; returns the number of tokens processed."""
        self._admit()
        batch, decoding, prefill, drafts = self._build_batch()
        out, seconds, compiled = self._run_step(batch)
        emitted, rows = self._accept_decodes(decoding, drafts, out)
        prefilled, first_tokens = self._advance_prefills(prefill, out)
        ref = out.get("ref_logits")
        self.stats.record_step(None if compiled else seconds, prefilled, emitted, len(decoding),
                               out.get("attn_stats"),
                               None if ref is None else (out["logits"][rows], ref[rows]))
        self.stats.blocks += np.asarray(out["blocks"], np.int64)
        if "same_blocks" in out:
            self.stats.same_blocks += np.asarray(out["same_blocks"], np.int64)
        for r in [r for r in self.running if r.done]:
            self._finish(r)
        return prefilled + emitted + first_tokens

    def _accept_decodes(self, decoding, drafts, out):
        """Greedy tokens of the decode rows; drafts are kept while they match the greedy
        token of the row before (prompt-lookup speculative decoding). Returns (tokens
        emitted, logits rows that emitted them)."""
        logits, ref, dql = out["logits"], out.get("ref_logits"), self.ecfg.decode_query_len
        emitted, rows = 0, []
        for i, r in enumerate(decoding):
            greedy = out["greedy"][i * dql:(i + 1) * dql]
            d = drafts[r.rid]
            a = 0
            while a < len(d) and greedy[a] == d[a]:
                a += 1
            r.drafted += len(d)
            r.accepted += a
            new = [*d[:a], int(greedy[a])][:r.max_new_tokens - len(r.generated)]
            for k in range(len(new)):
                self._log(r, logits[i * dql + k], None if ref is None else ref[i * dql + k])
                rows.append(i * dql + k)
            r.tokens += new
            r.num_cached += a + 1          # the input token and the accepted drafts
            emitted += len(new)
        return emitted, rows

    def _advance_prefills(self, prefill, out):
        """Marks the chunks cached; a finished prompt samples its first new token.
        Returns (prompt tokens prefilled, first tokens sampled)."""
        logits, ref = out["logits"], out.get("ref_logits")
        t = self.ecfg.max_running * self.ecfg.decode_query_len
        prefilled = first_tokens = 0
        for r, n in prefill:
            r.num_cached += n
            t += n
            prefilled += n
            if not r.prefilling:           # the prompt's last token gives the first new one
                self._log(r, logits[t - 1], None if ref is None else ref[t - 1])
                r.tokens.append(int(out["greedy"][t - 1]))
                first_tokens += 1
        return prefilled, first_tokens

    def _log(self, r: Request, row, ref_row):
        r.logits.append(np.array(row))
        if ref_row is not None:
            r.ref_logits.append(np.array(ref_row))

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
    """Throughput and served-vs-reference agreement, accumulated over a run."""

    def __init__(self, num_layers: int):
        self.prefill_tokens = self.prefill_seconds = 0
        self.decode_tokens = self.decode_seconds = 0
        self.decode_only_steps = self.decode_requests = 0
        self.blocks = np.zeros((num_layers, 2), np.int64)    # (selected, visible) per layer
        self.same_blocks = np.zeros((num_layers, 2), np.int64)  # (same set, pairs), served vs ref
        self.attn_sums = np.zeros((num_layers, 4))          # over all rows of the run
        self.decode_steps: list[dict] = []                   # per step with decode rows

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
            served, ref = logit_pairs
            self.decode_steps.append(dict(
                attn_cos=[_cos_from_sums(s) for s in attn_stats[:, 0]],
                logit_cos=float(np.mean([cosine(a, b) for a, b in zip(served, ref)])),
                agree=float(np.mean(served.argmax(-1) == ref.argmax(-1)))))

    def per_layer(self):
        """(cosine, relative Frobenius error) of the served attention output per layer."""
        return ([_cos_from_sums(s) for s in self.attn_sums],
                [float(np.sqrt(s[3] / max(s[2], 1e-30))) for s in self.attn_sums])


def _cos_from_sums(s) -> float:
    return float(s[0] / max(np.sqrt(s[1] * s[2]), 1e-30))
