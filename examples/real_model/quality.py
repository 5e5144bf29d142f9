"""Perplexity of SmolLM2 on real text through each K/V path, on the M3 example's engine.

A window of the longest context is one request: prefilled in chunks by the engine
(continuous batching, several windows in flight); each prefill row's logits give log p(next
token). Perplexity @C = exp(mean NLL) over the predictions of the window's first C tokens
(C − 1 per window). Attention is causal, so these are exactly the perplexities of C-token
windows starting at the same place: one run of the longest window serves every context.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from minimax_m3.engine import Engine, EngineConfig

from . import model

# Real English every Debian machine has (the base-files package), in this order: long texts
# first so that one 8192-token window is mostly one document.
CORPUS_FILES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "Apache-2.0", "MPL-2.0", "Artistic",
                "LGPL-3", "BSD")
LICENSES = "/usr/share/common-licenses"


def corpus_tokens(tokenizer, files=CORPUS_FILES, root=LICENSES) -> list[int]:
    """The files' text, tokenized one file at a time and concatenated (missing files skipped)."""
    ids = []
    for name in files:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                ids += tokenizer.encode(f.read()).ids
    return ids


def windows(tokens, context: int, count: int, offset: int = 0) -> list[list[int]]:
    """``count`` non-overlapping windows of ``context`` tokens from ``offset`` (fewer if the
    text runs out; ValueError if not even one fits)."""
    out = [tokens[offset + i * context: offset + (i + 1) * context] for i in range(count)]
    out = [w for w in out if len(w) == context]
    if not out:
        raise ValueError(f"the text has {len(tokens)} tokens, too few for one {context}-token "
                         f"window from {offset}")
    return out


class ScoringEngine(Engine):
    """The M3 Engine, also scoring every prefill row (its per-step hook, ``Engine.on_step``):
    NLL of the prompt's next token (and, with ``keep_logits``, the rows' logits)."""

    def __init__(self, *args, keep_logits: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.nll: dict[int, list[float]] = {}
        self.prefill_logits: dict[int, list[np.ndarray]] = {}
        self.keep_logits = keep_logits
        self.kv_amax = np.zeros((self.cfg.num_layers, 2))

    def on_step(self, out, prefill, decoding):
        t = self.ecfg.max_running * self.ecfg.decode_query_len      # the first prefill row
        for r, n in prefill:
            start, rows = r.num_cached, slice(t, t + n)
            targets = np.asarray(r.prompt[start + 1:start + n + 1])        # the next tokens
            k = len(targets)                                                 # n, or n − 1 at the end
            logit_rows = out["row_logits"][rows]
            self.nll.setdefault(r.rid, []).extend(
                (out["row_lse"][rows][:k] - logit_rows[np.arange(k), targets]).tolist())
            if self.keep_logits:
                self.prefill_logits.setdefault(r.rid, []).extend(np.array(logit_rows))
            t += n
        self.kv_amax = np.maximum(self.kv_amax, out["kv_amax"])


@dataclasses.dataclass
class PathResult:
    path: str
    perplexity: dict[int, float]      # context -> perplexity
    nll_tokens: dict[int, int]        # context -> predicted tokens
    prefill_tok_s: float
    blocks: np.ndarray                # [L, 2] selected, visible (token, block) pairs


def engine_config(contexts, max_running: int, chunk_size: int) -> EngineConfig:
    """One shape for every window of a path (block table for the longest context)."""
    longest = max(contexts) + 1                           # + the one sampled token
    pages = max_running * -(-longest // 128)
    return EngineConfig(num_pages=pages, max_running=max_running, chunk_size=chunk_size,
                        max_seq_len=-(-longest // 128) * 128, compare=False)


def score_windows(params, cfg, ecfg, requests, keep_logits=False) -> ScoringEngine:
    """Runs ``requests`` ([(rid, tokens)]) as prompts (1 new token each) and returns the engine
    (``engine.nll[rid]``: per-token NLL, natural log)."""
    engine = ScoringEngine(params, cfg, ecfg, model=model, keep_logits=keep_logits)
    for rid, toks in requests:
        engine.add_request(rid, toks, max_new_tokens=1)
    engine.run()
    return engine


def run_path(params, base_cfg, path, wins: list[list[int]], contexts, ecfg) -> PathResult:
    """Perplexity of one K/V path @ each context (a prefix of every window, see above)."""
    cfg = base_cfg.with_path(path)
    engine = score_windows(params, cfg, ecfg, list(enumerate(wins)))
    ppl, count = {}, {}
    for c in contexts:
        nll = [x for v in engine.nll.values() for x in v[:c - 1]]
        ppl[c], count[c] = math.exp(float(np.mean(nll))), len(nll)
    s = engine.stats
    tok_s = s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else float("nan")
    return PathResult(path, ppl, count, tok_s, engine.stats.blocks.copy())


def calibrate(params, base_cfg, tokens, ecfg):
    """Per-layer NVFP4 K/V global scales from the bf16 path's K/V amax on ``tokens``."""
    engine = score_windows(params, base_cfg.with_path("bf16-dense"), ecfg, [(0, tokens)])
    return model.calibrated_kv_scales(engine.kv_amax), engine.kv_amax


def format_table(results: list[PathResult], contexts) -> str:
    """Markdown table: perplexity per path and context, and the change against bf16-dense."""
    base = next((r for r in results if r.path == "bf16-dense"), None)
    head = "| path | " + " | ".join(f"@{c}" for c in contexts) + " | prefill tok/s |"
    lines = [head, "|" + "---|" * (len(contexts) + 2)]
    for r in results:
        cells = []
        for c in contexts:
            cell = f"{r.perplexity[c]:.3f}"
            if base is not None and r is not base:
                cell += f" ({100 * (r.perplexity[c] / base.perplexity[c] - 1):+.2f}%)"
            cells.append(cell)
        lines.append(f"| {r.path} | " + " | ".join(cells) + f" | {r.prefill_tok_s:.0f} |")
    return "\n".join(lines)


def plot(results: list[PathResult], contexts, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(contexts, [r.perplexity[c] for c in contexts], marker="o", label=r.path)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context (tokens per window)")
    ax.set_ylabel("perplexity")
    ax.set_title("SmolLM2-135M on /usr/share/common-licenses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
