"""Serve real text through MiniMax M3 on jax_m3sparse's NVFP4 sparse path.

    python examples/minimax_m3_generate.py                      # a small random M3, CPU, ~30 s
    python examples/minimax_m3_generate.py --temperature 0.8 --top-p 0.95 --seed 1 --logprobs 5
    python examples/minimax_m3_generate.py --checkpoint DIR --tp 8 --no-compare
    python examples/minimax_m3_generate.py --config DIR/config.json --dry-run --tp 8 \
        --context-len 131072 --batch 8        # fits an H200 (--device-memory-gb 141)?

Without ``--checkpoint`` the model is M3's architecture at CPU size with seeded random
weights (the generated text is gibberish: the point is the serving path and its accuracy
against the same model with a bf16 cache). ``--checkpoint DIR`` loads an M3 checkpoint
directory as published (config.json, safetensors shards, transformers' or the upstream names,
FP8 blocks, tokenizer.json); see examples/minimax_m3/checkpoint.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from minimax_m3 import runtime, text
from minimax_m3.config import EXPERT_FORMATS, EXPERT_LABELS, ModelConfig
from minimax_m3.engine import Engine, EngineConfig
from minimax_m3.sampling import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    io = p.add_argument_group("input / output")
    io.add_argument("--prompt-file", action="append", help="a text file to serve (repeatable); "
                    "default: a few files under /usr/share/common-licenses cut to 300-2800 tokens")
    io.add_argument("--max-prompt-tokens", type=int, default=None, help="cut every prompt to this")
    io.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    io.add_argument("--plot", metavar="FILE.png", help="draw accuracy per layer and decode step")
    io.add_argument("--tokens-json", metavar="FILE.json",
                    help="write the generated tokens per request (to compare runs, e.g. --tp)")
    io.add_argument("--platform", help="JAX backend (cpu, cuda, rocm, ...); default: JAX's choice")
    io.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel devices: heads, every MLP and expert, and the NVFP4 "
                         "cache sharded over them (simulated CPU devices on the CPU)")
    model = p.add_argument_group("model")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="an M3 checkpoint directory (else random weights of the flags below)")
    model.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="cast weights to this (unset: the checkpoint's dtype; FP8 "
                            "checkpoints dequantize to bfloat16)")
    d = ModelConfig()
    model.add_argument("--hidden", type=int, default=d.hidden_size, help="random model: width")
    model.add_argument("--layers", type=int, default=d.num_hidden_layers,
                       help="random model: layers (the first a full-attention dense-MLP layer, "
                            "the rest sparse attention with MoE)")
    model.add_argument("--heads", type=int, default=d.num_attention_heads,
                       help="random model: query heads Hq")
    model.add_argument("--kv-heads", type=int, default=d.num_key_value_heads,
                       help="random model: KV heads Hkv (= index heads)")
    model.add_argument("--experts", type=int, default=d.num_local_experts,
                       help="random model: routed experts")
    model.add_argument("--experts-per-tok", type=int, default=d.num_experts_per_tok,
                       help="random model: experts each token is routed to")
    model.add_argument("--intermediate", type=int, default=d.intermediate_size,
                       help="random model: per-expert (and shared-expert) width; the dense MLP "
                            "is 4x (as in M3)")
    model.add_argument("--weight-seed", type=int, default=0, help="random-weight seed")
    model.add_argument("--baseline-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                       help="the comparison (baseline) stream's caches")
    model.add_argument("--index-cache-dtype", default="bfloat16",
                       choices=("bfloat16", "float8_e4m3fn"),
                       help="the index keys' paged cache (FP8 halves its bytes and the "
                            "selection's reads)")
    model.add_argument("--moe-impl", default="auto",
                       choices=("auto", "dense", "dense_batched", "gather", "ragged", "grouped",
                                "tokamax"),
                       help="the routed experts' formulation (minimax_m3/moe.py; auto: dense "
                            "on the CPU, grouped on GPUs)")
    model.add_argument("--expert-format", default="bf16",
                       choices=EXPERT_FORMATS,
                       help="the routed experts' weights on the device: mxfp8 keeps fp8 with an "
                            "exponent per 32 inputs (half the bytes; lossless from an MXFP8 "
                            "checkpoint, quantized on the device from others); mxfp8_w8a8 also "
                            "quantizes the experts' inputs per 32 (dynamic, as the MXFP8 "
                            "checkpoint's activation_scheme) and multiplies fp8 by fp8; mxfp4 / "
                            "nvfp4 keep packed E2M1 with a scale per 32 / 16 inputs (a quarter "
                            "of the bytes; quantized on the device)"),
    plan = p.add_argument_group("dry run (no weights)")
    plan.add_argument("--config", metavar="PATH", help="a config.json (or its directory): the "
                      "model's shapes (with random weights unless --dry-run)")
    plan.add_argument("--dry-run", action="store_true",
                      help="build the model abstractly and print per-device bytes; no run")
    plan.add_argument("--context-len", type=int, default=131072, help="tokens per request")
    plan.add_argument("--batch", type=int, default=8, help="requests of --context-len")
    plan.add_argument("--device-memory-gb", type=float, default=141.0,
                      help="say whether the plan fits a device of this size, with "
                           "--reserve-gb left for activations, and what fits it in each "
                           "weight and index-cache format (default 141: an H200, the GPU "
                           "the real-size bench ran on; e.g. 192 for an AMD MI300X; 0: no check)")
    plan.add_argument("--mem-fraction", type=float, default=None,
                      help="the plan only: the share of each device JAX's pool will take "
                           "(unset: $XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75); the "
                           "plan fits --device-memory-gb × this. A run takes its pool from "
                           "XLA_PYTHON_CLIENT_MEM_FRACTION")
    plan.add_argument("--reserve-gb", type=float, default=8.0,
                      help="per-device memory the plan keeps free for activations and workspace")
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
                     help="skip the bf16 baseline stream (no accuracy figures, about 2x faster)")
    smp = p.add_argument_group("sampling (on the device; the defaults are greedy)")
    smp.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax)")
    smp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    smp.add_argument("--top-p", type=float, default=1.0,
                     help="keep the most likely tokens up to this probability mass (1: off)")
    smp.add_argument("--seed", type=int, default=0,
                     help="sampling seed: request i draws from seed + i, its token at position "
                          "p from the key (seed + i, p), whatever its batch")
    smp.add_argument("--logprobs", type=int, default=0, metavar="N",
                     help="also return the N most likely tokens' log-probabilities per token")
    smp.add_argument("--stop-token-ids", type=int, nargs="*", default=[],
                     help="token ids that end a request (kept as its last token), besides EOS")
    smp.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at EOS (config.json's eos_token_id, the tokenizer's)")
    return p.parse_args(argv)


def model_config(args) -> ModelConfig:
    """The checkpoint's (or --config's) config.json, else the random model of the flags."""
    from minimax_m3.config import DENSE_MLP, FULL, MOE, SPARSE, from_hf_config  # noqa: PLC0415
    source = args.checkpoint or args.config
    if source:
        return from_hf_config(source, baseline_dtype=args.baseline_dtype,
                              index_cache_dtype=args.index_cache_dtype, moe_impl=args.moe_impl,
                              expert_format=args.expert_format)
    L = args.layers
    return ModelConfig(hidden_size=args.hidden, num_hidden_layers=L,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       index_n_heads=args.kv_heads, num_local_experts=args.experts,
                       num_experts_per_tok=args.experts_per_tok,
                       intermediate_size=args.intermediate,
                       shared_intermediate_size=args.intermediate,
                       dense_intermediate_size=4 * args.intermediate,
                       layer_types=(FULL,) + (SPARSE,) * (L - 1),
                       mlp_layer_types=(DENSE_MLP,) + (MOE,) * (L - 1),
                       baseline_dtype=args.baseline_dtype,
                       index_cache_dtype=args.index_cache_dtype, moe_impl=args.moe_impl,
                       expert_format=args.expert_format)


def main(argv=None):
    args = parse_args(argv)
    flags = runtime.apply_xla_flags()
    if args.tp > 1 and not args.dry_run and "xla_force_host_platform_device_count" not in flags:
        # Simulated CPU devices; must be set before JAX starts (harmless on GPU backends).
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.tp}"
    import jax  # noqa: PLC0415 (the platform must be chosen before JAX starts a backend)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    cfg = model_config(args)
    if args.dry_run:
        from minimax_m3 import plan  # noqa: PLC0415
        p = plan.plan(cfg, tp=args.tp, context_len=args.context_len, batch=args.batch,
                      device_memory_gb=args.device_memory_gb, reserve_gb=args.reserve_gb,
                      mem_fraction=args.mem_fraction)
        print(plan.format_plan(p))
        return p
    return serve(args, cfg)


def load_model(args, cfg, mesh):
    """The checkpoint's params placed on ``mesh``, or random weights; quantized experts
    (``--expert-format``) are made on the device from the loaded bf16 ones, or kept as they
    are stored when the checkpoint's experts are in that FP4 format."""
    from tqdm import tqdm  # noqa: PLC0415
    from minimax_m3 import checkpoint, model, moe, parallel  # noqa: PLC0415
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, mesh)
    if not args.checkpoint:
        return model.init_params(cfg, args.weight_seed, shardings, dtype=args.dtype)
    if cfg.fp4_experts and checkpoint.expert_storage(args.checkpoint) == cfg.expert_format:
        with tqdm(total=checkpoint.count_tensors(cfg), unit="tensor", desc="loading") as bar:
            return checkpoint.load_params(args.checkpoint, cfg, shardings, dtype=args.dtype,
                                          progress=bar.update)
    bf16 = dataclasses.replace(cfg, expert_format="bf16")
    with tqdm(total=checkpoint.count_tensors(bf16), unit="tensor", desc="loading") as bar:
        params = checkpoint.load_params(
            args.checkpoint, bf16, parallel.param_shardings(model.param_shapes(bf16), bf16, mesh),
            dtype=args.dtype, progress=bar.update)
    if cfg.expert_format == "bf16":
        return params
    return moe.quantize_experts(params, shardings, cfg.expert_format)


def sampling_note(args, stops) -> str:
    """One line: how tokens are sampled and what stops a request."""
    how = ("greedy" if args.temperature == 0 else
           f"temperature {args.temperature}, top-k {args.top_k or 'off'}, top-p {args.top_p}, "
           f"seed {args.seed}")
    return how + (f", stop tokens {stops}" if stops else ", no stop token")


def serve(args, cfg):
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    import jax_m3sparse as m3  # noqa: PLC0415
    from jax_m3sparse.sharding import kv_head_replicas  # noqa: PLC0415
    from minimax_m3 import parallel, report  # noqa: PLC0415

    cfg = dataclasses.replace(cfg, kv_replicas=kv_head_replicas(cfg.num_key_value_heads, args.tp))
    mesh = parallel.make_mesh(args.tp)
    # Prompts before weights: a bad prompt file or tokenizer fails before a long load.
    tokenizer = text.tokenizer_for(args.checkpoint)
    prompts = text.load_prompts(args.prompt_file, args.max_prompt_tokens, tokenizer)
    if (top := max(max(t) for _, t in prompts)) >= cfg.vocab_size:
        raise ValueError(f"prompt token id {top} >= the model's vocab_size {cfg.vocab_size} "
                         f"(tokenizer: {tokenizer.name})")
    params = load_model(args, cfg, mesh)
    need = sorted(-(-(len(t) + args.max_new_tokens + args.spec_tokens) // cfg.block_size)
                  for _, t in prompts)
    ecfg = EngineConfig(num_pages=args.num_pages or sum(need[-args.max_running:]),
                        max_running=args.max_running, chunk_size=args.chunk_size,
                        spec_tokens=args.spec_tokens, max_seq_len=need[-1] * cfg.block_size,
                        compare=not args.no_compare, tp=args.tp, num_logprobs=args.logprobs)
    stops = [*([] if args.ignore_eos else
               text.eos_token_ids(args.checkpoint or args.config, tokenizer)), *args.stop_token_ids]
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    print(f"backend {jax.default_backend()}, tp {args.tp} of {jax.device_count()} devices; "
          f"MiniMax M3: {cfg.num_layers} layers ({len(cfg.sparse_layers)} sparse attention, "
          f"{moe_layers} MoE of {cfg.num_local_experts} "
          f"{EXPERT_LABELS[cfg.expert_format]}experts "
          f"top-{cfg.num_experts_per_tok} + shared), hidden {cfg.hidden_size}, Hq {cfg.num_attention_heads}, Hkv "
          f"{cfg.num_key_value_heads}, D {cfg.head_dim}, top-{cfg.index_topk_blocks} of "
          f"{cfg.block_size}-token blocks; weights: "
          f"{args.checkpoint or f'random (seed {args.weight_seed})'}"
          f"; tokenizer: {tokenizer.name}; sampling: {sampling_note(args, stops)}")
    cpu_paths = m3.cpu_attention_paths() if jax.default_backend() == "cpu" else None
    if cpu_paths:
        print(f"CPU attention path: {cpu_paths[1]} (available here: {', '.join(cpu_paths[0])}; BUILD.md)")
    if not args.checkpoint:
        print("NOTE: random weights -> the generated text is gibberish; the point is the serving "
              "path and its accuracy.")

    engine = Engine(params, cfg, ecfg)
    for rid, (name, tokens) in enumerate(prompts):
        engine.add_request(rid, tokens, args.max_new_tokens, SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=(args.seed + rid) % 2 ** 32, stop_token_ids=tuple(stops)))
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
        print(f"  request {r.rid} -> {tokenizer.printable(r.generated)}"
              + (" [stop token]" if r.finish_reason == "stop" else ""))
        if r.logprobs:
            lp, ids, tops = r.logprobs[0]
            print(f"    mean logprob {np.mean([x[0] for x in r.logprobs]):.3f}; first token's "
                  f"top {len(ids)}: " + ", ".join(f"{i}: {v:.2f}" for i, v in zip(ids, tops)))
    summary = report.summarize(engine, wall)
    kv = engine.caches["kv"]
    summary.update(tp=args.tp, kv_cache_bytes=kv.nbytes,
                   kv_cache_bytes_per_device=parallel.bytes_per_device(kv),
                   cache_kv_heads=cfg.cache_kv_heads,
                   generated={r.rid: r.generated for r in finished},
                   logprobs={r.rid: r.logprobs for r in finished})
    print(report.format_summary(summary, cfg))
    st = engine.stats
    summary["decode_step_ms"] = 1e3 * st.decode_seconds / max(st.decode_only_steps, 1)
    if st.decode_only_steps and summary["decode_tok_s"] > 0:
        print(f"decode step: {summary['decode_step_ms']:.2f} ms per decode-only step "
              f"({st.decode_only_steps} timed steps), {1e3 / summary['decode_tok_s']:.2f} "
              f"ms per decoded token")
    else:   # every token came from a prefill step or a step beside one: nothing to time
        print("decode step: no decode-only step was timed (more --max-new-tokens would)")
    if args.tokens_json:
        with open(args.tokens_json, "w") as f:
            json.dump({str(k): [int(t) for t in v] for k, v in summary["generated"].items()}, f)
    if args.plot:
        if "attn_cos" not in summary:
            print("--plot needs the baseline stream (drop --no-compare)")
        else:
            report.plot(engine, summary, args.plot)
            print(f"plot written to {args.plot}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, MemoryError) as e:   # bad flags, a model that does not fit: the message
        if os.environ.get("M3_TRACEBACK"):
            raise
        sys.exit(f"error: {e}\n(M3_TRACEBACK=1 shows where)")
