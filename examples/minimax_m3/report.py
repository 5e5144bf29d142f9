"""The end-of-run summary (throughput, pages, NVFP4-vs-bf16 accuracy) and the optional plot."""

from __future__ import annotations

import numpy as np

from .engine import Engine

# What a healthy run shows (tests/example/test_example.py checks them). NVFP4 itself gives rel-F
# about 0.1 on unit-RMS inputs (SPEC §6); random weights give flat logits with near-ties, so a few
# greedy tokens flip (defaults: about 88% agreement, logit cosine about 0.998).
BOUNDS = dict(attn_cos_min=0.98, attn_rel_f_max=0.2, logit_cos_min=0.98, agreement_min=0.7)


def summarize(engine: Engine, wall_seconds: float) -> dict:
    """Numbers of the run: throughput, pages, and the served-vs-baseline agreement (compare.py)."""
    s, a = engine.stats, engine.allocator
    out = dict(
        requests=len(engine.finished),
        prefill_tokens=s.prefill_tokens,
        prefill_tok_s=s.prefill_tokens / max(s.prefill_seconds, 1e-9),
        decode_tokens=s.decode_tokens,
        decode_tok_s=s.decode_tokens / max(s.decode_seconds, 1e-9),
        decode_batch=s.decode_requests / max(s.decode_only_steps, 1),
        generated_tokens=sum(len(r.generated) for r in engine.finished),
        compile_s=engine.compile_seconds,
        compiled_shapes=len(engine.compiles),
        wall_s=wall_seconds,
        pages_total=a.num_pages,
        pages_peak=a.peak_in_use,
        pages_allocated=a.total_allocations,
        pages_free_at_end=a.num_free(),
        blocks_attended=[float(sel / max(vis, 1)) for sel, vis in s.blocks],
        blocks_skipped=int(sum(max(vis - sel, 0) for sel, vis in s.blocks)),
        max_blocks=max((-(-len(r.tokens) // engine.cfg.block_size) for r in engine.finished),
                       default=0),
    )
    drafted = sum(r.drafted for r in engine.finished)
    if drafted:
        out["spec_acceptance"] = sum(r.accepted for r in engine.finished) / drafted
    if engine.ecfg.compare:
        cos, rel = s.per_layer()
        same = s.same_blocks[list(engine.cfg.sparse_layers)]
        out.update(
            attn_cos=cos, attn_rel_f=rel,
            same_selection=float(same[:, 0].sum() / max(same[:, 1].sum(), 1)) if len(same) else None,
            # over every generated token (each request's first one included)
            logit_cos=float(np.mean(s.logit_cos)), logit_cos_min=float(np.min(s.logit_cos)),
            agreement=float(np.mean(s.agree)))
    return out


def format_summary(s: dict, cfg) -> str:
    lines = [
        f"requests {s['requests']}, generated tokens {s['generated_tokens']}, wall {s['wall_s']:.1f} s "
        f""
        f"(of which {s['compile_s']:.1f} s in {s['compiled_shapes']} steps that compiled a new padded "
        f"shape; excluded from tokens/s)",
        f"prefill: {s['prefill_tokens']} tokens, {s['prefill_tok_s']:.0f} tokens/s "
        f"(timed steps with a prefill chunk; compile steps excluded)",
        f"decode:  {s['decode_tokens']} tokens, {s['decode_tok_s']:.1f} tokens/s (timed decode-only "
        f"steps, {s['decode_batch']:.1f} requests per step on average; tokens decoded beside a "
        f"prefill chunk count in that step)",
        f"pages:   peak {s['pages_peak']} of {s['pages_total']} in use, {s['pages_allocated']} "
        f"handed out over the run, {s['pages_free_at_end']} free at the end",
    ]
    if "kv_cache_bytes_per_device" in s:
        lines.append(f"NVFP4 cache: {s['kv_cache_bytes_per_device'] / 2**20:.2f} MiB per device "
                     f"({s['kv_cache_bytes'] / 2**20:.2f} MiB in all, tp {s['tp']}, "
                     f"{kv_heads(s.get('cache_kv_heads', '?'))} stored)")
    sparse = [s["blocks_attended"][i] for i in cfg.sparse_layers]
    if sparse:
        lines.append(f"sparse selection: {100 * np.mean(sparse):.1f}% of the visible (token, block) "
                     f"pairs attended, {s['blocks_skipped']} skipped (top-{cfg.index_topk_blocks} of up to "
                     f"{s['max_blocks']} blocks)")
    if "spec_acceptance" in s:
        lines.append(f"speculative: {100 * s['spec_acceptance']:.0f}% of prompt-lookup drafts accepted")
    if "attn_cos" in s:
        how = ("its own index keys and selections" if cfg.baseline_selection == "own"
               else "the same selections")
        lines.append(f"accuracy of the NVFP4 sparse path vs the same model with a "
                     f"{cfg.baseline_dtype} cache ({how}):")
        for layer, (c, r) in enumerate(zip(s["attn_cos"], s["attn_rel_f"])):
            kind = "sparse" if layer in cfg.sparse_layers else "full  "
            lines.append(f"  layer {layer} ({kind}, {cfg.mlp_layer_types[layer]:6s} MLP) attention "
                         f"output: cosine {c:.5f}, rel-F {r:.4f}")
        if s.get("same_selection") is not None and cfg.baseline_selection == "own":
            lines.append(f"  block selections: {100 * s['same_selection']:.2f}% of (token, KV head) "
                         f"pairs pick the same set in both streams (bf16 vs "
                         f"{cfg.baseline_dtype} index keys)")
        lines.append(f"  final logits: cosine mean {s['logit_cos']:.5f} (min {s['logit_cos_min']:.5f}); "
                     f"greedy-token agreement {100 * s['agreement']:.1f}%")
    return "\n".join(lines)


def plot(engine: Engine, summary: dict, path: str) -> None:
    """Per-layer attention agreement and per-decode-step logit agreement, one PNG."""
    import matplotlib  # noqa: PLC0415 (optional dependency)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    layers = np.arange(len(summary["attn_cos"]))
    ax1.bar(layers - 0.2, 1 - np.array(summary["attn_cos"]), 0.4, label="1 − cosine")
    ax1.bar(layers + 0.2, summary["attn_rel_f"], 0.4, label="rel-F error")
    ax1.set_xlabel("layer")
    ax1.set_title("attention output: NVFP4 sparse vs bf16 cache")
    ax1.set_yscale("log")
    errs = np.concatenate([1 - np.array(summary["attn_cos"]), summary["attn_rel_f"]])
    if (errs > 0).any():  # bars start at 0, which a log axis cannot show: start below the least
        ax1.set_ylim(bottom=errs[errs > 0].min() / 3)
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax1.set_xticks(layers)
    steps = engine.stats.decode_steps
    x = np.arange(len(steps))
    for layer in layers:
        ax2.plot(x, [1 - d["attn_cos"][layer] for d in steps], lw=0.8, ls=":",
                 label=f"1 − attention cosine, layer {layer}")
    ax2.plot(x, [1 - d["logit_cos"] for d in steps], color="k", label="1 − final-logit cosine")
    ax2.set_yscale("log")
    ax2.set_xlabel("decode step")
    ax2.set_title("per decode step (decode rows)")
    # Legends below the axes: inside, they hid bars and curves.
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    agree = np.cumsum([d["agree"] for d in steps]) / np.maximum(x + 1, 1)
    ax3 = ax2.twinx()
    ax3.plot(x, 100 * agree, color="tab:purple", label="greedy agreement so far (%)")
    ax3.set_ylim(0, 101)
    ax3.set_ylabel("greedy-token agreement so far (%)", color="tab:purple")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def kv_heads(n) -> str:
    """'1 KV head' / 'n KV heads'."""
    return f"{n} KV head" + ("" if n == 1 else "s")
