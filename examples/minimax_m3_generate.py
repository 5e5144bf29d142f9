"""Serve real text through a MiniMax M3-shaped model on jax_m3sparse's NVFP4 sparse path.

    python examples/minimax_m3_generate.py                      # defaults: < 3 min on 2 CPU cores
    python examples/minimax_m3_generate.py --prompt-file a.txt --prompt-file b.txt \
        --max-new-tokens 64 --spec-tokens 3 --plot accuracy.png

With the default seeded random weights the generated text is gibberish: the point is the
serving path (paged NVFP4 cache, indexer, sparse attention, continuous batching) and its
accuracy against the same model with a bf16 cache. ``--checkpoint`` loads real weights from a
safetensors file (see examples/minimax_m3/checkpoint.py for the names).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from minimax_m3 import text
from minimax_m3.config import ModelConfig
from minimax_m3.engine import Engine, EngineConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    io = p.add_argument_group("input / output")
    io.add_argument("--prompt-file", action="append", help="a text file to serve (repeatable); "
                    "default: a few files under /usr/share/common-licenses cut to 300-2800 bytes")
    io.add_argument("--max-prompt-tokens", type=int, default=None, help="cut every prompt to this")
    io.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    io.add_argument("--plot", metavar="FILE.png", help="draw accuracy per layer and decode step")
    io.add_argument("--tokens-json", metavar="FILE.json",
                    help="write the generated tokens per request (to compare runs, e.g. --tp)")
    io.add_argument("--platform", help="JAX backend (cpu, cuda, rocm, ...); default: JAX's choice")
    io.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel devices: heads, MLP and the NVFP4 cache sharded over "
                         "them (simulated CPU devices on the CPU; real GPUs when present)")
    model = p.add_argument_group("model")
    d = ModelConfig()
    model.add_argument("--hidden", type=int, default=d.hidden_size, help="model width")
    model.add_argument("--layers", type=int, default=d.num_layers, help="decoder layers")
    model.add_argument("--dense-layers", type=int, default=d.num_dense_layers, help="first layers that attend densely")
    model.add_argument("--heads", type=int, default=d.num_heads, help="query heads Hq")
    model.add_argument("--kv-heads", type=int, default=d.num_kv_heads, help="KV heads Hkv")
    model.add_argument("--intermediate", type=int, default=d.intermediate_size, help="SwiGLU width")
    model.add_argument("--checkpoint", metavar="PATH", help="safetensors weights (else random)")
    model.add_argument("--seed", type=int, default=0, help="random-weight seed")
    eng = p.add_argument_group("engine")
    e = EngineConfig()
    eng.add_argument("--chunk-size", type=int, default=e.chunk_size, help="prefill tokens per step")
    eng.add_argument("--max-running", type=int, default=e.max_running, help="requests in flight")
    eng.add_argument("--num-pages", type=int, default=None,
                     help="128-token cache pages; default: enough for the --max-running largest "
                          "requests at once (later requests reuse freed pages)")
    eng.add_argument("--spec-tokens", type=int, default=e.spec_tokens,
                     help="prompt-lookup draft tokens verified per decode step")
    eng.add_argument("--no-compare", action="store_true",
                     help="skip the bf16 reference stream (no accuracy figures, about 2x faster)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if args.tp > 1 and "xla_force_host_platform_device_count" not in flags:
        # Simulated CPU devices; must be set before JAX starts (harmless on GPU backends).
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.tp}"
    import jax  # noqa: PLC0415 (the platform must be chosen before JAX starts a backend)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    from tqdm import tqdm  # noqa: PLC0415

    import jax_m3sparse as m3  # noqa: PLC0415
    from minimax_m3 import report  # noqa: PLC0415
    from minimax_m3.checkpoint import load_checkpoint  # noqa: PLC0415
    from minimax_m3.model import init_params  # noqa: PLC0415

    cfg = ModelConfig(hidden_size=args.hidden, num_layers=args.layers,
                      num_dense_layers=args.dense_layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, intermediate_size=args.intermediate)
    from jax_m3sparse.sharding import kv_head_replicas  # noqa: PLC0415
    cfg = dataclasses.replace(cfg, kv_replicas=kv_head_replicas(cfg.num_kv_heads, args.tp))
    prompts = text.load_prompts(args.prompt_file, args.max_prompt_tokens)
    need = sorted(-(-(len(t) + args.max_new_tokens + args.spec_tokens) // cfg.block_size)
                  for _, t in prompts)
    longest = need[-1] * cfg.block_size
    ecfg = EngineConfig(num_pages=args.num_pages or sum(need[-args.max_running:]),
                        max_running=args.max_running, chunk_size=args.chunk_size,
                        spec_tokens=args.spec_tokens, max_seq_len=longest,
                        compare=not args.no_compare, tp=args.tp)
    params = load_checkpoint(args.checkpoint, cfg) if args.checkpoint else init_params(cfg, args.seed)
    print(f"backend {jax.default_backend()}, tp {args.tp} of {jax.device_count()} devices; {cfg.num_layers} layers ({cfg.num_dense_layers} dense), "
          f"hidden {cfg.hidden_size}, Hq {cfg.num_heads}, Hkv {cfg.num_kv_heads}, D {cfg.head_dim}, "
          f"top-{cfg.topk_blocks} of {cfg.block_size}-token blocks; weights: "
          f"{args.checkpoint or f'random (seed {args.seed})'}")
    cpu_paths = m3.cpu_attention_paths() if jax.default_backend() == "cpu" else None
    if cpu_paths:
        print(f"CPU attention path: {cpu_paths[1]} of {', '.join(cpu_paths[0])} (BUILD.md)")
    if not args.checkpoint:
        print("NOTE: random weights -> the generated text is gibberish; the point is the serving "
              "path and its accuracy.")

    engine = Engine(params, cfg, ecfg)
    for rid, (name, tokens) in enumerate(prompts):
        engine.add_request(rid, tokens, args.max_new_tokens)
        print(f"  request {rid}: {name}, {len(tokens)} tokens "
              f"({-(-len(tokens) // cfg.block_size)} blocks)")
    total = sum(len(t) + args.max_new_tokens for _, t in prompts)
    t0 = time.perf_counter()
    with tqdm(total=total, unit="tok", desc="serving") as bar:
        def progress(n):
            bar.update(n)
            bar.set_postfix(running=len(engine.running), waiting=len(engine.waiting),
                            pages_free=engine.allocator.num_free(), refresh=False)
        finished = engine.run(progress)
    wall = time.perf_counter() - t0

    for r in finished:
        print(f"  request {r.rid} -> {text.printable(r.generated)}")
    summary = report.summarize(engine, wall)
    kv = engine.caches["kv"]
    summary.update(tp=args.tp, kv_cache_bytes=kv.nbytes,
                   kv_cache_bytes_per_device=kv.addressable_shards[0].data.nbytes,
                   cache_kv_heads=cfg.cache_kv_heads,
                   generated={r.rid: r.generated for r in finished})
    print(report.format_summary(summary, cfg))
    st = engine.stats
    summary["decode_step_ms"] = 1e3 * st.decode_seconds / max(st.decode_only_steps, 1)
    print(f"decode step: {summary['decode_step_ms']:.2f} ms per decode-only step "
          f"({st.decode_only_steps} timed steps), {1e3 / max(summary['decode_tok_s'], 1e-9):.2f} "
          f"ms per decoded token")
    if args.tokens_json:
        with open(args.tokens_json, "w") as f:
            json.dump({str(k): [int(t) for t in v] for k, v in summary["generated"].items()}, f)
    if args.plot:
        if "attn_cos" not in summary:
            print("--plot needs the reference stream (drop --no-compare)")
        else:
            report.plot(engine, summary, args.plot)
            print(f"plot written to {args.plot}")
    return summary


if __name__ == "__main__":
    main()
