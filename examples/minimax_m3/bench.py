"""One tensor-parallel rank of MiniMax M3 at real size, timed: ``python -m examples.minimax_m3.bench``.

Builds what one of ``--tp`` GPUs runs (default: M3 at TP 8 — hidden 6144, 8 query heads, 1 KV
head, 128 experts of I = 384, shared expert 384, dense MLP 1536; the released layer pattern,
3 full-attention + dense-MLP layers then sparse + MoE), as many layers as fit the device
(``--layers``), random bf16 weights made on the device (model.init_params; the router's
correction bias 0, as a trained one balances the experts' load: ``balanced_router``), a page
pool for the largest batch × context with random cache contents (finite: random FP4 codes at
scale 1.0 — values decide the selection and the routing, so they must be finite; the step's
routing is reported per decode shape), and times, per step shape (decode batches × contexts, one prefill
chunk):

* the whole ``model.forward_step`` as a server calls it (wall, median after warmup; without the
  engine report's block counts unless ``--block-stats``) and its compile time;
* each part per layer, as its own jitted function over the built layers' weights (a
  ``lax.scan``, so that one call's launch cost is shared by the layers): attention, selection,
  MoE (each ``--moe-impls``), dense MLP, projections + norms + cache writes, lm_head +
  sampling. On GPUs with ``--kernel-times`` also the kernels' time from a profiler trace;

beside each part's floor (bytes ÷ ``--bandwidth`` or FLOPs ÷ ``--flops``, whichever is larger;
the MoE's counts only the experts the batch routes to, measured), and projects the time per
output token and tokens/s per GPU for all of the model's layers at TP ``--tp``, with the
all-reduces *modelled* (2 per layer of ``[T, hidden]`` bf16, ring, ``--link-bandwidth``, plus
``--collective-latency`` each). ``--json`` writes every number. CPU smoke test: ``--tiny``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import time

from . import runtime

M3_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "m3_config", "config.json")


DENSE_ROWS_DEFAULT = "16"       # cfg.dense_matmul_rows' default, as the bench's option


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m examples.minimax_m3.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=M3_CONFIG, help="the full model's config.json")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument("--keep-layer-types", action="store_true",
                    help="keep the config's layer_types (default: the released pattern, full "
                         "attention where the MLP is dense, sparse elsewhere)")
    ap.add_argument("--tp", type=int, default=8,
                    help="tensor parallel of the modelled system (default 8; --tiny: 1)")
    ap.add_argument("--layers", type=int, default=None, help="layers built (default: as many "
                    "as fit --mem-fraction of the device, at least the first sparse+MoE one)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.85; 0.5 when tokamax runs, "
                         "whose Mosaic kernels need memory outside XLA's pool)")
    ap.add_argument("--reserve-gb", type=float, default=10.0,
                    help="device memory kept for activations and workspace when fitting layers")
    ap.add_argument("--moe-impl", default="auto", help="the step's moe_impl (moe.IMPLS)")
    ap.add_argument("--expert-format", default="bf16",   # config.EXPERT_FORMATS (no jax yet)
                    choices=("bf16", "mxfp8", "mxfp8_w8a8", "mxfp4", "nvfp4"),
                    help="the routed experts' weights on the device (mxfp8: fp8 + an E8M0 "
                         "exponent per 32 inputs, through grouped_matmul; mxfp8_w8a8: their "
                         "inputs too, fp8 × fp8; mxfp4 / nvfp4: packed E2M1 with an E8M0 "
                         "exponent per 32 / an E4M3 scale per 16 inputs, SPEC §9.3)")
    ap.add_argument("--moe-epilogue", action="store_true",
                    help="cfg.moe_epilogue: the SwiGLU and routing weight in the gate_up "
                         "kernel (grouped_matmul's epilogue) instead of an XLA fusion")
    ap.add_argument("--index-cache-dtype", default=None, choices=("bfloat16", "float8_e4m3fn"),
                    help="the index keys' cache (default: the config's, bfloat16)")
    ap.add_argument("--moe-impls", default=None,
                    help="formulations timed as parts (default: --moe-impl's, dense, and "
                         "tokamax if it imports)")
    ap.add_argument("--batch", default="1,4,8,32,64,128", help="decode batch sizes (default: %(default)s)")
    ap.add_argument("--context", default="2048,16384", help="decode context lengths (default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill chunk tokens (0: none; default %(default)s)")
    ap.add_argument("--prefill-context", type=int, default=8192,
                    help="the chunk's request length (its last token's position + 1; default "
                         "%(default)s)")
    ap.add_argument("--quick", action="store_true", help="decode 4 and 128 at 16k, prefill 2048")
    ap.add_argument("--dense-matmul-rows", default=DENSE_ROWS_DEFAULT,
                    help="cfg.dense_matmul_rows (GPUs: bf16 projections of at most this many rows, "
                    "input width %% 64 == 0, through jax_m3sparse.dense_matmul; 0: XLA's dot; "
                    "default %(default)s); a list times each shape "
                    "once per value, the parts with the first")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per shape (default "
                    "%(default)s; the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default "
                    "%(default)s)")
    ap.add_argument("--no-parts", action="store_true",
                    help="time whole steps only (the floors still come from the parts' byte "
                         "and FLOP counts; no projection)")
    ap.add_argument("--block-stats", action="store_true",
                    help="the step also counts each sparse layer's attended blocks, as the "
                         "engine's report asks (default: as a server calls it, without)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="GPU: also each part's kernel time from a jax.profiler trace (a trace "
                         "per part and shape: slower)")
    ap.add_argument("--bandwidth", type=float, default=4.25e12,
                    help="B/s for memory floors (default: the H200's copy rate, 4.25e12)")
    ap.add_argument("--flops", type=float, default=790e12,
                    help="FLOP/s for compute floors (default: H200 dense bf16, 7.9e14)")
    ap.add_argument("--link-bandwidth", type=float, default=450e9,
                    help="B/s per GPU of the modelled ring all-reduce (NVLink; default 4.5e11)")
    ap.add_argument("--collective-latency", type=float, default=10e-6,
                    help="s per modelled collective (default 1e-5)")
    ap.add_argument("--seed", type=int, default=0, help="weights', caches' and batches' seed "
                    "(default 0)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.prefill = "4,128", "16384", 2048
    if args.tiny:
        args.tp = 1 if args.tp == 8 else args.tp
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    runtime.apply_xla_flags()                 # before JAX starts (Bench imports it)
    impls = _impls_requested(args)
    frac = args.mem_fraction or (0.5 if "tokamax" in impls else 0.85)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(frac))
    if "tokamax" in impls:
        _stub_xprof()
    bench = Bench(args, impls)   # imports jax: after the memory fraction is set
    report = bench.run()
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return report


def _impls_requested(args) -> list[str]:
    if args.moe_impls:
        return args.moe_impls.split(",")
    out = list(dict.fromkeys([args.moe_impl, "dense"]))   # the step's own, then dense dispatch
    _stub_xprof()
    try:
        import tokamax  # noqa: F401, PLC0415
        out.append("tokamax")
    except ImportError:
        pass
    return out


def _stub_xprof():
    """tokamax 0.0.17 imports ``xprof.cli.tools`` (a profiler with heavy dependencies) at
    import time for its own benchmarking; a stub lets it import when xprof is absent."""
    try:
        import xprof.cli.tools  # noqa: F401, PLC0415
    except ImportError:
        import types  # noqa: PLC0415
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None


# ----------------------------------------------------------------------------- the model
def full_config(args):
    from .config import DENSE_MLP, FULL, SPARSE, ModelConfig, from_hf_config  # noqa: PLC0415
    if args.tiny:
        return ModelConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=1, index_n_heads=1,
                           dense_intermediate_size=256, intermediate_size=64,
                           shared_intermediate_size=64, num_local_experts=16,
                           num_experts_per_tok=4, index_head_dim=64, index_topk_blocks=4,
                           layer_types=(FULL, SPARSE, SPARSE, SPARSE),
                           mlp_layer_types=(DENSE_MLP, "sparse", "sparse", "sparse"),
                           expert_format=args.expert_format,
                           moe_epilogue=getattr(args, "moe_epilogue", False))
    cfg = from_hf_config(args.config, expert_format=args.expert_format)
    if getattr(args, "index_cache_dtype", None):
        cfg = dataclasses.replace(cfg, index_cache_dtype=args.index_cache_dtype)
    if getattr(args, "moe_epilogue", False):
        cfg = dataclasses.replace(cfg, moe_epilogue=True)
    if not args.keep_layer_types:
        cfg = dataclasses.replace(cfg, layer_types=tuple(
            FULL if m == DENSE_MLP else SPARSE for m in cfg.mlp_layer_types))
    return cfg


def rank_config(full, tp: int, layers: int, moe_impl: str):
    """What one of ``tp`` devices computes, as a model of its own: heads, intermediate sizes
    (and the vocabulary, where the model splits it) divided by ``tp``; the first ``layers``
    layers. At tp > Hkv a device holds one replica of one KV head (kv_replicas)."""
    from jax.tree_util import DictKey  # noqa: PLC0415
    from .parallel import AXIS, check_divisible, leaf_spec  # noqa: PLC0415
    check_divisible(full, tp)
    hkv = max(1, full.num_key_value_heads // tp)
    vocab_split = AXIS in tuple(leaf_spec((DictKey("lm_head"),), full, tp))
    return dataclasses.replace(
        full, num_attention_heads=full.num_attention_heads // tp, num_key_value_heads=hkv,
        index_n_heads=hkv, intermediate_size=full.intermediate_size // tp,
        shared_intermediate_size=full.shared_intermediate_size // tp,
        dense_intermediate_size=full.dense_intermediate_size // tp,
        vocab_size=full.vocab_size // tp if vocab_split else full.vocab_size,
        num_hidden_layers=layers, layer_types=full.layer_types[:layers],
        mlp_layer_types=full.mlp_layer_types[:layers], kv_replicas=1, moe_impl=moe_impl)


def layer_bytes(cfg, attn, mlp, dtype_bytes=2) -> int:
    """One layer's weight bytes: ``dtype_bytes`` per element, quantized experts as stored
    (their leaves' own dtypes: model.param_dtypes)."""
    from . import model  # noqa: PLC0415
    from .moe import expert_leaf_dtype  # noqa: PLC0415
    from .parallel import is_shape  # noqa: PLC0415
    import jax  # noqa: PLC0415

    def nbytes(path, shape):
        names = [getattr(k, "key", None) for k in path]
        if cfg.quantized_experts and "experts" in names:
            return expert_leaf_dtype(cfg.expert_format, names[-1]).itemsize * math.prod(shape)
        return dtype_bytes * math.prod(shape)
    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map_with_path(
        nbytes, model.layer_shapes(cfg, attn, mlp), is_leaf=is_shape)))


# ----------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, args, impls):
        import jax  # noqa: PLC0415
        self.args, self.impls = args, impls
        self.backend = jax.default_backend()
        self.gpu = self.backend not in ("cpu",)
        self.full = full_config(args)
        self.batches = [int(b) for b in args.batch.split(",") if b]
        self.contexts = [int(c) for c in args.context.split(",") if c]
        self.dense_rows = [int(u) for u in args.dense_matmul_rows.split(",") if u]
        N = self.full.block_size
        self.part_cache = {}     # parts that depend on the token count only, by (part, T)
        self.pages = max([b * -(-c // N) for b in self.batches for c in self.contexts]
                         + [-(-args.prefill_context // N) if args.prefill else 0]) + 1

    # --- memory
    def cache_bytes_per_layer(self, cfg, sparse: bool) -> int:
        import jax_m3sparse as m3  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415
        spec = m3.KVCacheSpec(cfg.cache_kv_heads, cfg.head_dim, cfg.block_size)
        idx = (self.pages * cfg.block_size * cfg.index_head_dim
               * np.dtype(cfg.index_cache_dtype).itemsize if sparse else 0)
        return self.pages * spec.page_bytes + idx

    def choose_layers(self) -> tuple[int, dict]:
        """Layers that fit: the fixed weights, then layers in the model's order, each with its
        caches, until the pool less ``--reserve-gb`` is used."""
        import jax  # noqa: PLC0415
        from . import plan  # noqa: PLC0415
        from .config import SPARSE  # noqa: PLC0415
        one = rank_config(self.full, self.args.tp, 1, self.args.moe_impl)
        L = self.full.num_layers
        if self.args.layers:
            return min(self.args.layers, L), {}
        avail, source = plan.available_memory(jax.devices()[:1])
        fixed = 2 * one.vocab_size * one.hidden_size * 2 + one.hidden_size * 2
        budget = avail - self.args.reserve_gb * 1e9 - fixed
        n = 0
        for attn, mlp in zip(self.full.layer_types, self.full.mlp_layer_types):
            cost = layer_bytes(one, attn, mlp) + self.cache_bytes_per_layer(one, attn == SPARSE)
            if budget < cost:
                break
            budget -= cost
            n += 1
        first_moe = next((i + 1 for i, m in enumerate(self.full.mlp_layer_types) if m == "sparse"),
                         L)
        return max(n, min(first_moe, L)), dict(available_bytes=avail, source=source)

    # --- setup
    def build(self):
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from . import model  # noqa: PLC0415
        layers, mem = self.choose_layers()
        cfg = rank_config(self.full, self.args.tp, layers, self.args.moe_impl)
        self.cfg, self.mem = cfg, mem
        cache = sum(self.cache_bytes_per_layer(cfg, t == "minimax_m3_sparse")
                    for t in cfg.layer_types)
        t0 = time.perf_counter()
        self.params = balanced_router(model.init_params(cfg, self.args.seed, dtype=jnp.bfloat16,
                                                        cache_bytes=cache))
        jax.block_until_ready(self.params)
        self.init_s = time.perf_counter() - t0
        self.caches = random_caches(cfg, self.pages, self.args.seed)
        jax.block_until_ready(self.caches)

    def run(self) -> dict:
        self.build()
        print(format_header(self.summary()), flush=True)    # what is built, before the timings
        shapes = [("decode", b, c) for c in self.contexts for b in self.batches]
        if self.args.prefill:
            shapes.append(("prefill", self.args.prefill, self.args.prefill_context))
        rows = []
        for kind, n, ctx in shapes:
            for i, dense_rows in enumerate(self.dense_rows):
                self.cfg = dataclasses.replace(self.cfg, dense_matmul_rows=dense_rows)
                row = self.time_shape(kind, n, ctx, parts=i == 0)
                rows.append(row)
                print(format_row(row, self.args.tp), flush=True)
        return dict(self.summary(), shapes=rows)

    def summary(self) -> dict:
        """The report's fields other than the timed shapes."""
        return dict(device=_device_name(), backend=self.backend, rank_config=_cfg_dict(self.cfg),
                    full_layers=self.full.num_layers, tp=self.args.tp, pages=self.pages,
                    init_s=self.init_s, memory=self.mem, moe_impl=self.args.moe_impl,
                    block_stats=self.args.block_stats,
                    impls=self.impls, model=self.model_note(), router_bias="zero")

    def model_note(self) -> dict:
        a = self.args
        return dict(bandwidth=a.bandwidth, flops=a.flops, link_bandwidth=a.link_bandwidth,
                    collective_latency=a.collective_latency,
                    allreduce="2 per layer of [T, hidden] bf16, ring: 2·(tp−1)/tp·bytes / "
                              "link_bandwidth + latency each (a model, not measured)")

    def time_shape(self, kind, n, ctx, parts: bool = True) -> dict:
        import jax  # noqa: PLC0415
        batch, nd = make_batch(self.cfg, kind, n, ctx, self.pages, self.args.seed)
        T = batch["tokens"].shape[0]
        t0 = time.perf_counter()
        step = compile_step(self.params, self.caches, batch, self.cfg, nd,
                            block_stats=self.args.block_stats)
        compile_s = time.perf_counter() - t0
        state = dict(caches=self.caches)

        def call():
            state["caches"], out = step(self.params, state["caches"], batch)
            return out

        times = wall_times(call, self.args.warmup, self.args.repeats)
        out = call()
        jax.block_until_ready(out)
        host = host_bytes(batch, out)
        row = dict(kind=kind, requests=n if kind == "decode" else 1, tokens=T, context=ctx,
                   dense_matmul_rows=self.cfg.dense_matmul_rows,
                   step_ms=1e3 * statistics.median(times), step_ms_min=1e3 * min(times),
                   compile_s=compile_s, host_bytes=host, **self.step_trace(call, kind, T))
        self.caches = state["caches"]            # the calls above donated the caches
        if kind == "decode" and any(m == "sparse" for m in self.cfg.mlp_layer_types):
            row["routing"] = self.step_routing(batch, nd)
        if parts:      # --no-parts: the parts' floors only (their byte and FLOP counts)
            parts = Parts(self, batch, nd, kind, ctx, timed=not self.args.no_parts)
            row["parts"] = parts.run()
            row.update(self.project(row, parts))
        return row

    def step_routing(self, batch, nd) -> dict:
        """The step's own routing (one untimed step that also returns each layer's input and
        attention output, from which each MoE layer's router input is rebuilt): per MoE layer,
        the experts the live tokens route to and the rows of the largest group; min / mean /
        max over the layers, beside what uniform routing would touch. What the step's MoE
        reads depends on it (NaN activations once sent every token to the same 4 experts), and
        the MoE part, timed on random rows, does not show it. Decode shapes only: at prefill
        sizes the collected activations ([L, T, H] fp32) would take gigabytes."""
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from . import model, moe  # noqa: PLC0415
        cfg = self.cfg
        self.caches, out = model.forward_step(self.params, self.caches, batch, cfg=cfg,
                                              num_decode_requests=nd, decode_query_len=1,
                                              collect=("hidden", "attn"), **_step_kwargs(False))
        live = batch["slot_mapping"] >= 0

        @jax.jit
        def one(p, x, attn):
            h = model.mlp_input(p, x, attn, cfg)[1]
            sizes = moe.route(p["mlp"], h, cfg, live).group_sizes
            return jnp.sum(sizes > 0), jnp.max(sizes)

        experts, largest = [], []
        for i, (_, mlp, first, n) in enumerate(cfg.segments()):
            if mlp != "sparse":
                continue
            seg = self.params["segments"][i]
            for j in range(n):   # only the leaves the router input needs (not the experts)
                p = dict(self_attn=dict(o_proj=seg["self_attn"]["o_proj"][j]),
                         post_attention_layernorm=seg["post_attention_layernorm"][j],
                         mlp={k: seg["mlp"][k][j] for k in ("gate", "e_score_correction_bias")})
                e, g = one(p, out["hidden"][first + j], out["attn"][first + j])
                experts.append(int(e))
                largest.append(int(g))
        T, E, k = int(jnp.sum(live)), cfg.num_local_experts, cfg.num_experts_per_tok
        return dict(pairs=T * k, experts_min=min(experts), experts_mean=statistics.mean(experts),
                    experts_max=max(experts), largest_group_mean=statistics.mean(largest),
                    uniform_experts=E * (1 - (1 - k / E) ** T), moe_layers=len(experts))

    def step_trace(self, call, kind, T) -> dict:
        """GPU (``--kernel-times``): the step's kernels from one profiler trace — how many, their
        total, and the GPU's idle time inside the step's span (launch gaps); with
        M3SPARSE_BENCH_TRACE set, the step's top kernels on stderr."""
        ev = gpu_trace(call, f"step {kind} {T}", self.gpu and self.args.kernel_times, top=2)
        if not ev:
            return {}
        from jax_m3sparse.bench import cuda  # noqa: PLC0415
        _, total, span, idle = cuda.split_events(ev, "\0")
        return dict(step_kernels=len(ev), step_kernel_ms=total / 1e3, step_span_ms=span / 1e3,
                    step_idle_ms=idle / 1e3)

    def project(self, row, parts) -> dict:
        """The step at all layers and tp: the measured step, plus the missing layers at their
        parts' per-layer times, plus the modelled all-reduces. The floors take the MoE's over
        the experts the step routes to (its routing report) where there is one. Parts not
        timed (``--no-parts``): the floors and bytes only."""
        a, full, cfg = self.args, self.full, self.cfg
        p = {x["part"]: x for x in row["parts"] if "error" not in x}
        built_sparse = sum(t == "minimax_m3_sparse" for t in cfg.layer_types)
        built_moe = sum(m == "sparse" for m in cfg.mlp_layer_types)
        total_sparse = sum(t == "minimax_m3_sparse" for t in full.layer_types)
        total_moe = sum(m == "sparse" for m in full.mlp_layer_types)
        floor = lambda name: p[name]["floor_us"] if name in p else 0.0
        moe_name = f"moe ({cfg.moe_impl})" if f"moe ({cfg.moe_impl})" in p else next(
            (k for k in p if k.startswith("moe")), "")
        attn_full = "attention (full)"
        if moe_name and "routing" in row and p[moe_name].get("expert_bytes"):
            # the MoE floor over the experts the step itself routes to (its routing report),
            # not the part's random rows
            m = p[moe_name]
            nbytes = (m["floor_bytes"] + (row["routing"]["experts_mean"] - m["routed_experts"])
                      * m["expert_bytes"])
            p[moe_name] = dict(m, floor_bytes=nbytes, floor_us=max(nbytes / a.bandwidth,
                                                                  m["floor_flops"] / a.flops) * 1e6)
        built = (("attention (sparse)", built_sparse), ("selection", built_sparse),
                 (attn_full, cfg.num_layers - built_sparse), (moe_name, built_moe),
                 ("dense MLP", cfg.num_layers - built_moe),
                 ("projections+norms", cfg.num_layers), ("lm_head+sampling", 1))
        floor_built = sum(floor(x) * n for x, n in built)
        floors = dict(step_floor_ms=floor_built / 1e3, step_floor_gb=sum(
            p[x]["floor_bytes"] * n for x, n in built if x in p) / 1e9)
        if not parts.time_parts:
            return floors
        us = lambda name: p[name]["us_per_layer"] if name in p else 0.0
        # per layer: projections/norms/writes in every layer; attention + selection by kind
        missing = dict(sparse=total_sparse - built_sparse, full=(full.num_layers - total_sparse)
                       - (cfg.num_layers - built_sparse), moe=total_moe - built_moe,
                       dense=(full.num_layers - total_moe) - (cfg.num_layers - built_moe))
        add = (missing["sparse"] * (us("attention (sparse)") + us("selection"))
               + missing["full"] * us(attn_full) + missing["moe"] * us(moe_name)
               + missing["dense"] * us("dense MLP")
               + (full.num_layers - cfg.num_layers) * us("projections+norms"))
        step_all = row["step_ms"] * 1e3 + add
        T = row["tokens"]
        ar_bytes = T * full.hidden_size * 2
        tp = a.tp
        ar = (2 * full.num_layers * (2 * (tp - 1) / tp * ar_bytes / a.link_bandwidth
                                     + a.collective_latency) if tp > 1 else 0.0) * 1e6
        floor_all = (total_sparse * (floor("attention (sparse)") + floor("selection"))
                     + (full.num_layers - total_sparse) * floor(attn_full)
                     + total_moe * floor(moe_name) + (full.num_layers - total_moe)
                     * floor("dense MLP") + full.num_layers * floor("projections+norms")
                     + floor("lm_head+sampling"))
        ms = (step_all + ar) / 1e3
        out_tokens = row["requests"] if row["kind"] == "decode" else 1
        return dict(floors, projected_layers=full.num_layers,
                    projected_step_ms=ms, projected_floor_ms=(floor_all + ar) / 1e3,
                    modelled_allreduce_ms=ar / 1e3,
                    projected_tpot_ms=ms if row["kind"] == "decode" else None,
                    projected_tokens_per_s_per_gpu=(out_tokens if row["kind"] == "decode"
                                                    else T) / (ms / 1e3) / tp)


def _device_name() -> str:
    import jax  # noqa: PLC0415
    d = jax.devices()[0]
    return d.device_kind if d.device_kind.lower() != d.platform else d.platform


def _cfg_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    d["layer_types"] = list(cfg.layer_types)
    d["mlp_layer_types"] = list(cfg.mlp_layer_types)
    return d


def balanced_router(params: dict) -> dict:
    """``params`` with every MoE layer's ``e_score_correction_bias`` 0. A trained model's bias
    is what balances its experts' load; a random one (init_params draws N(0, 0.1)) favours the
    same few experts for every token: on the tiny model, 128 tokens of top-4-of-16 put 82 rows
    on the largest expert against 45 with no bias (32 on average), and a real-size step would
    time that skew instead of a served model's routing."""
    import jax.numpy as jnp  # noqa: PLC0415
    segments = []
    for seg in params["segments"]:
        mlp = seg["mlp"]
        if "e_score_correction_bias" in mlp:
            bias = mlp["e_score_correction_bias"]
            seg = dict(seg, mlp=dict(mlp, e_score_correction_bias=jnp.zeros(bias.shape,
                                                                             bias.dtype)))
        segments.append(seg)
    return dict(params, segments=segments)


# ----------------------------------------------------------------------------- caches, batches
def random_caches(cfg, pages: int, seed: int) -> dict:
    """The step's caches with random contents, one layer at a time (donated): FP4 codes
    random, block scales 1.0 (finite), index keys N(0, 1) bf16. Each (page, slot) tile is a
    data plane then a scale plane (SPEC §3.2), not 72-byte token rows: filled row-wise, the
    scale plane got random codes (NaN and huge scales) and every attention output was NaN."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import jax_m3sparse as m3  # noqa: PLC0415
    from . import model  # noqa: PLC0415
    caches = _allocate(cfg, pages)
    key = jax.random.key(seed + 1)
    del model
    D = cfg.head_dim

    def kv_layer(kv, k, l):
        P, S, N, C = kv.shape[1:]
        data = m3.spec.tile_offsets(0, D, N)[1]  # the data plane's bytes; the scale plane follows
        codes = jax.random.bits(k, (P, S, data), jnp.uint8)
        scales = jnp.full((P, S, N * C - data), 0x38, jnp.uint8)      # E4M3 1.0
        return kv.at[l].set(jnp.concatenate([codes, scales], axis=-1).reshape(P, S, N, C))

    def idx_layer(idx, k, l):
        return idx.at[l].set(jax.random.normal(k, idx.shape[1:], idx.dtype))

    kv_layer = jax.jit(kv_layer, donate_argnums=0)
    idx_layer = jax.jit(idx_layer, donate_argnums=0)
    kv, idx = caches["kv"], caches["idx"]
    for l in range(kv.shape[0]):
        kv = kv_layer(kv, jax.random.fold_in(key, l), l)
    for l in range(idx.shape[0]):
        idx = idx_layer(idx, jax.random.fold_in(key, 1000 + l), l)
    return dict(caches, kv=kv, idx=idx)


def _allocate(cfg, pages):
    """model.allocate_caches, served stream only, whichever signature it has."""
    from . import model  # noqa: PLC0415
    if "compare" in inspect.signature(model.allocate_caches).parameters:
        return model.allocate_caches(cfg, pages, compare=False)
    return model.allocate_caches(cfg, pages)


def make_batch(cfg, kind: str, n: int, ctx: int, pages: int, seed: int):
    """(batch, num_decode_requests) for ``n`` decode requests each at ``ctx`` tokens (the new
    token at position ctx − 1), or one prefill chunk of ``n`` tokens ending at ``ctx``.
    Requests get disjoint pages; every row samples (decode) or the chunk's last row does."""
    import numpy as np  # noqa: PLC0415
    N = cfg.block_size
    M = -(-ctx // N)
    R = n if kind == "decode" else 1
    if R * M > pages:
        raise ValueError(f"{R} × {M} pages > the pool's {pages}")
    table = np.arange(R * M, dtype=np.int32).reshape(R, M)
    rng = np.random.default_rng(seed)
    if kind == "decode":
        pos = np.full(R, ctx - 1, np.int32)
        slots = table[:, -1] * N + (ctx - 1) % N
        qlens, ctxl = np.ones(R, np.int32), pos.copy()
        sample = np.arange(R, dtype=np.int32)
        T = R
    else:
        pos = np.arange(ctx - n, ctx, dtype=np.int32)
        slots = table[0, pos // N] * N + pos % N
        qlens, ctxl = np.array([n], np.int32), np.array([ctx - n], np.int32)
        sample = np.array([n - 1], np.int32)
        T = n
    batch = dict(tokens=rng.integers(0, cfg.vocab_size, T).astype(np.int32),
                 slot_mapping=slots.astype(np.int32), query_lens=qlens, context_lens=ctxl,
                 block_table=table)
    return step_batch(batch, sample), (R if kind == "decode" else 0)


# ----------------------------------------------------------------------------- the step call
# The only place that knows forward_step's interface: adapt here when it changes.
def _step_kwargs(block_stats: bool):
    from . import model  # noqa: PLC0415
    params = inspect.signature(model.forward_step).parameters
    kw = dict(compare=False) if "compare" in params else {}
    if "block_stats" in params:
        kw["block_stats"] = block_stats
    return kw


def step_batch(batch: dict, sample_rows) -> dict:
    """``batch`` plus the sampling arrays (greedy) when the step takes them."""
    try:
        from .sampling import batch_arrays  # noqa: PLC0415
    except ImportError:
        return batch
    return dict(batch, **batch_arrays(sample_rows))


def compile_step(params, caches, batch, cfg, num_decode_requests: int, block_stats=False):
    """The compiled ``forward_step`` for this shape (trace + compile timed by the caller);
    called as ``step(params, caches, batch) -> (caches, out)``, caches donated.
    ``block_stats``: the step counts attended blocks (the engine's report), else not."""
    from . import model  # noqa: PLC0415
    return model.forward_step.lower(params, caches, batch, cfg=cfg,
                                    num_decode_requests=num_decode_requests,
                                    decode_query_len=1,
                                    **_step_kwargs(block_stats)).compile()


def host_bytes(batch, out) -> dict:
    """What an engine moves per step: the batch up, everything the step returns down."""
    import jax  # noqa: PLC0415
    up = sum(v.nbytes for v in jax.tree_util.tree_leaves(batch))
    down = sum(v.nbytes for v in jax.tree_util.tree_leaves(out))
    return dict(to_device=int(up), to_host=int(down))


def gpu_trace(call, label: str, enabled: bool, top: int = 1) -> list:
    """The GPU kernels of one ``call()`` from a profiler trace (jax_m3sparse.bench.cuda's
    events), or [] when not ``enabled`` or no trace came (the wall time stands); with
    M3SPARSE_BENCH_TRACE=N set, the ``top`` · N kernels by total time on stderr."""
    if not enabled:
        return []
    try:
        from jax_m3sparse.bench import cuda  # noqa: PLC0415
        ev = cuda.gpu_events(call, ())
    except Exception:  # noqa: BLE001
        return []
    if ev and os.environ.get("M3SPARSE_BENCH_TRACE"):
        cuda.summary(ev, label, top=top * int(os.environ["M3SPARSE_BENCH_TRACE"]))
    return ev


def wall_times(fn, warmup: int, repeats: int) -> list[float]:
    import jax  # noqa: PLC0415
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------- parts
class Parts:
    """Each part of a layer as a jitted ``lax.scan`` over the built layers of its kind (their
    own weights), on the step's shapes; µs per layer = median call time / layers."""

    def __init__(self, bench, batch, nd, kind, ctx, timed: bool = True):
        """``timed`` False: each part's floor (bytes, FLOPs) without compiling or timing it."""
        import jax.numpy as jnp  # noqa: PLC0415
        from . import model  # noqa: PLC0415
        self.b, self.cfg, self.kind, self.ctx, self.time_parts = bench, bench.cfg, kind, ctx, timed
        self.batch = {k: jnp.asarray(v) for k, v in batch.items()}
        self.meta, self.req, self.pos = model.batch_rows(self.batch, nd, 1)
        self.T = batch["tokens"].shape[0]

    def run(self) -> list[dict]:
        cfg = self.cfg
        out = []
        seg = {(a, m): i for i, (a, m, _, _) in enumerate(cfg.segments())}
        sparse_seg = next((i for (a, m), i in seg.items() if a == "minimax_m3_sparse"), None)
        full_seg = next((i for (a, m), i in seg.items() if a != "minimax_m3_sparse"), None)
        moe_seg = next((i for (a, m), i in seg.items() if m == "sparse"), None)
        dense_seg = next((i for (a, m), i in seg.items() if m != "sparse"), None)
        if sparse_seg is not None:
            out.append(self.attention(sparse_seg, True))
            out.append(self.selection(sparse_seg))
        if full_seg is not None:
            out.append(self.attention(full_seg, False))
        if moe_seg is not None:
            routed = self.once("routed", lambda: self.routed_experts(moe_seg))
            timed = set()    # formulations timed: "dense" after "auto = dense" is not re-timed
            for impl in self.b.impls if self.time_parts else self.b.impls[:1]:
                try:
                    formulation = self.moe_formulation(moe_seg, impl)
                    if formulation in timed:
                        continue
                    timed.add(formulation)
                    out.append(self.once(f"moe {impl}",
                                          lambda: self.mlp(moe_seg, True, impl, routed)))
                except Exception as e:  # noqa: BLE001 (an optional formulation may not run here)
                    out.append(dict(part=f"moe ({impl})", error=f"{type(e).__name__}: {e}"[:200]))
        if dense_seg is not None:
            out.append(self.once("dense MLP", lambda: self.mlp(dense_seg, False)))
        out.append(self.once("proj", lambda: self.projections(
            sparse_seg if sparse_seg is not None else full_seg)))
        out.append(self.once("lm_head", self.lm_head))
        return out

    def once(self, name, fn):
        """Parts whose shapes depend on the token count only are timed once per count; a later
        shape's copy says which context it was timed at (``reused_from``)."""
        key = (name, self.kind, self.T, self.time_parts)
        if key not in self.b.part_cache:
            self.b.part_cache[key] = (fn(), self.ctx)
            return self.b.part_cache[key][0]
        value, ctx = self.b.part_cache[key]
        return dict(value, reused_from=ctx) if isinstance(value, dict) else value

    # --- timing
    def timed(self, name, fn, args, layers, floor_bytes, floor_flops, state=None,
              **extra) -> dict:
        """``fn(*args)``, or with ``state`` (a dict of donated arrays) ``fn(state, *args) ->
        (state, out)``, threaded through the calls; the final state is in ``state``."""
        import jax  # noqa: PLC0415
        a = self.b.args
        floor_b, floor_f = floor_bytes / a.bandwidth * 1e6, floor_flops / a.flops * 1e6
        floor = dict(part=name, floor_us=max(floor_b, floor_f),
                     floor_by="bytes" if floor_b >= floor_f else "FLOPs",
                     floor_bytes=floor_bytes, floor_flops=floor_flops, layers=layers, **extra)
        if not self.time_parts:
            return dict(floor, us_per_layer=None, kernel_us_per_layer=None, compile_s=None)
        t0 = time.perf_counter()
        if state is None:
            compiled = jax.jit(fn).lower(*args).compile()
            call = lambda: compiled(*args)
        else:
            compiled = jax.jit(fn, donate_argnums=0).lower(state, *args).compile()

            def call():
                new, out = compiled(dict(state), *args)
                state.update(new)
                return out
        compile_s = time.perf_counter() - t0
        times = wall_times(call, a.warmup, a.repeats)
        us = 1e6 * statistics.median(times) / layers
        kernel_us = self.kernel_time(call, name)
        return dict(floor, us_per_layer=us, kernel_us_per_layer=(kernel_us / layers
                                                                 if kernel_us else None),
                    compile_s=compile_s)

    def kernel_time(self, call, name):
        """GPU kernels' µs of one call from a profiler trace, else None (CPU, or no trace);
        with M3SPARSE_BENCH_TRACE set, each kernel's count and mean µs on stderr."""
        ev = gpu_trace(call, name, self.b.gpu and self.b.args.kernel_times)
        return sum(d for _, _, d in ev) or None

    def seg(self, i):
        return self.b.params["segments"][i]

    def nlayers(self, i):
        return self.cfg.segments()[i][3]

    # --- parts
    def topk(self, sparse: bool):
        """Selections of the step's shape: the last K visible blocks per token (full layers:
        every block)."""
        import jax.numpy as jnp  # noqa: PLC0415
        cfg, M = self.cfg, self.batch["block_table"].shape[1]
        if not sparse:
            K = M
            return jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32),
                                    (cfg.cache_kv_heads, self.T, M)), K
        K = cfg.index_topk_blocks
        last = jnp.maximum(self.pos, 0) // cfg.block_size
        blocks = last[:, None] - jnp.arange(K, dtype=jnp.int32)
        blocks = jnp.where(blocks >= 0, blocks, -1)
        return jnp.broadcast_to(blocks, (cfg.cache_kv_heads, self.T, K)), K

    def visible_blocks(self) -> int:
        """Σ over requests of the distinct blocks the step's tokens may read."""
        N = self.cfg.block_size
        if self.kind == "decode":
            return self.T * -(-self.ctx // N)
        return -(-self.ctx // N)

    def attention(self, i, sparse: bool) -> dict:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        import jax_m3sparse as m3  # noqa: PLC0415
        from . import model  # noqa: PLC0415
        cfg, T = self.cfg, self.T
        topk, K = self.topk(sparse)
        first = cfg.segments()[i][2]
        n = self.nlayers(i)
        q = jax.random.normal(jax.random.key(1), (T, cfg.num_attention_heads, cfg.head_dim),
                              jnp.bfloat16)
        meta, bt, req, pos = self.meta, self.batch["block_table"], self.req, self.pos

        def attend(q, kv, topk, layer):   # as the step: full layers without a top-k list
            kw = dict(scale=cfg.head_dim ** -0.5, layer=layer, layout=model.KV_LAYOUT)
            if sparse:
                return m3.sparse_attention(q, kv, topk, meta, model.K_SCALE, model.V_SCALE, **kw)
            return m3.full_attention(q, kv, bt, req, pos, model.K_SCALE, model.V_SCALE, **kw)

        def fn(q, kv, topk):
            def body(c, l):
                o = attend((q + c).astype(jnp.bfloat16), kv, topk, l)
                return c + jnp.sum(o.astype(jnp.float32)).astype(jnp.bfloat16) * 0, None
            return jax.lax.scan(body, jnp.bfloat16(0), first + jnp.arange(n))[0]

        spec_bytes = 2 * cfg.head_dim * 9 // 16          # K+V bytes per token and head: 2·72
        blocks = (min(K, -(-self.ctx // cfg.block_size)) * T if self.kind == "decode"
                  else self.visible_blocks())
        nbytes = blocks * cfg.cache_kv_heads * cfg.block_size * spec_bytes
        keys = min(K * cfg.block_size, self.ctx)
        flops = 4 * T * keys * cfg.num_attention_heads * cfg.head_dim
        return self.timed(f"attention ({'sparse' if sparse else 'full'})", fn,
                          (q, self.b.caches["kv"], topk), n, nbytes, flops)

    def selection(self, i) -> dict:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from jax_m3sparse.select import select_blocks  # noqa: PLC0415
        cfg, T = self.cfg, self.T
        n = self.nlayers(i)
        # A device selects for its own KV heads only (the step replicates the index queries
        # like the KV heads and select_blocks partitions over them): the rank's index heads.
        Hi = cfg.index_n_heads
        iq = jax.random.normal(jax.random.key(2), (T, Hi, cfg.index_head_dim), jnp.bfloat16)
        layered = "layer" in inspect.signature(select_blocks).parameters
        kw = dict(topk_blocks=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks)
        bt, req, pos = self.batch["block_table"], self.req, self.pos

        def fn(iq, idx):
            def body(c, l):
                if layered:
                    t = select_blocks(iq + c, idx, bt, req, pos, layer=l, **kw)
                else:
                    t = select_blocks(iq + c, idx[l], bt, req, pos, **kw)
                # A use XLA cannot fold away (an integer `x * 0` it does: the call was dropped).
                return c + (t[0, 0, 0] == -7).astype(iq.dtype), None
            return jax.lax.scan(body, jnp.zeros((), iq.dtype), jnp.arange(n))[0]

        # index keys read: each request's context once; scores: every row × its context
        keys = self.T * self.ctx if self.kind == "decode" else self.ctx
        nbytes = keys * cfg.index_head_dim * self.b.caches["idx"].dtype.itemsize
        flops = 2 * T * Hi * cfg.index_head_dim * self.ctx
        return self.timed("selection", fn, (iq, self.b.caches["idx"]), n, nbytes, flops,
                          index_heads=Hi, layer_argument=layered)

    def routed_experts(self, i) -> float:
        """Distinct experts the router picks for this many random tokens (layer 0 of the
        segment), the MoE floor's count."""
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from . import moe  # noqa: PLC0415
        p = jax.tree_util.tree_map(lambda w: w[0], self.seg(i)["mlp"])
        h = jax.random.normal(jax.random.key(3), (self.T, self.cfg.hidden_size), jnp.float32)
        chosen = moe.route(p, h, self.cfg).experts
        return int(jnp.unique(chosen).shape[0])

    def moe_formulation(self, i, impl: str) -> str:
        """The formulation ``impl`` runs at this shape (moe.resolve_impl): "auto" names another."""
        from . import moe  # noqa: PLC0415
        cfg = self.cfg
        return moe.resolve_impl(impl, self.T * cfg.num_experts_per_tok / cfg.num_local_experts,
                                weight_dtype=self.seg(i)["mlp"]["experts"]["gate_up_proj"].dtype)

    def mlp(self, i, is_moe: bool, impl: str = "dense", routed: int = 0) -> dict:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from . import moe  # noqa: PLC0415
        cfg = dataclasses.replace(self.cfg, moe_impl=impl)
        T, H = self.T, cfg.hidden_size
        n = self.nlayers(i)
        x = jax.random.normal(jax.random.key(4), (T, H), jnp.float32)

        def fn(x, p):
            def body(c, pl):
                return c + moe.mlp(pl, c, cfg, is_moe) * 1e-3, None
            return jax.lax.scan(body, x, p)[0]

        if is_moe:
            I, E, k = cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
            per_expert = 3 * I * H * {"bf16": 2, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}.get(
                cfg.expert_format, 1 + 1 / 32)
            shared = 3 * cfg.shared_intermediate_size * H * 2
            nbytes = routed * per_expert + shared + E * H * 2
            flops = 2 * T * (k * 3 * I * H + 3 * cfg.shared_intermediate_size * H + E * H)
            expected = E * (1 - (1 - k / E) ** T)
            return self.timed(f"moe ({impl})", fn, (x, self.seg(i)["mlp"]), n, nbytes, flops,
                              resolved=self.moe_formulation(i, impl),
                              routed_experts=routed, expert_bytes=per_expert,
                              expected_routed_experts=expected)
        D = cfg.dense_intermediate_size
        return self.timed("dense MLP", fn, (x, self.seg(i)["mlp"]), n, 3 * D * H * 2,
                          2 * T * 3 * D * H)

    def projections(self, i) -> dict:
        """Norms, q/k/v/o projections, q/k norms and RoPE, the indexer's projections, the
        K/V cache write (pack_kv_pages) and the index-key write: a layer less attention,
        selection and MLP."""
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        import jax_m3sparse as m3  # noqa: PLC0415
        from . import model  # noqa: PLC0415
        from .attention import project  # noqa: PLC0415
        from .layers import gemma_rms_norm, linear, rotary_cos_sin  # noqa: PLC0415
        cfg, T, H = self.cfg, self.T, self.cfg.hidden_size
        n = self.nlayers(i)
        first = cfg.segments()[i][2]
        slots, pos = self.batch["slot_mapping"], self.pos
        has_idx = "indexer" in self.seg(i)["self_attn"]
        x = jax.random.normal(jax.random.key(5), (T, H), jnp.float32)

        def fn(state, x, p):
            kv, idx = state["kv"], state["idx"]
            cos, sin = rotary_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)

            def body(carry, xs):
                x, kv, idx = carry
                pl, l = xs
                h = gemma_rms_norm(x, pl["input_layernorm"], cfg.rms_norm_eps)
                q, k, v, iq, ik = project(pl["self_attn"], h, cos, sin, cfg)
                kv = m3.pack_kv_pages(kv, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), slots,
                                      model.K_SCALE, model.V_SCALE, layer=l,
                                      layout=model.KV_LAYOUT)
                if has_idx:
                    idx = m3.write_index_keys(idx, ik, slots, layer=jnp.int32(0))   # in place
                    q = q + jnp.sum(iq) * 0
                x = x + linear(q.reshape(T, -1), pl["self_attn"]["o_proj"], cfg)
                x = gemma_rms_norm(x, pl["post_attention_layernorm"], cfg.rms_norm_eps)
                return (x, kv, idx), None
            x, kv, idx = jax.lax.scan(body, (x, kv, idx), (p, first + jnp.arange(n)))[0]
            return dict(kv=kv, idx=idx), x

        # a device's own heads only: the fused qkv_proj holds its query heads, its KV head and
        # its index head (model.layer_shapes)
        sa = self.seg(i)["self_attn"]
        wbytes = sum(v.nbytes for v in jax.tree_util.tree_leaves(sa)) // n
        nbytes = wbytes + T * cfg.cache_kv_heads * 2 * 72 + T * 128 * 2
        flops = T * wbytes
        state = dict(kv=self.b.caches["kv"], idx=self.b.caches["idx"])
        res = self.timed("projections+norms", fn, (x, self.seg(i)), n, nbytes, flops,
                         state=state)
        self.b.caches = dict(self.b.caches, **state)
        return res

    def lm_head(self) -> dict:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from . import model  # noqa: PLC0415
        cfg = self.cfg
        rows = self.batch.get("sample_rows", jnp.arange(1, dtype=jnp.int32))
        S = rows.shape[0]
        x = jax.random.normal(jax.random.key(6), (self.T, cfg.hidden_size), jnp.float32)
        try:
            from . import sampling  # noqa: PLC0415
        except ImportError:
            sampling = None
        batch, pos, params = self.batch, self.pos, self.b.params

        def fn(x):
            logits = model.logits_of(params, x[jnp.clip(rows, 0, x.shape[0] - 1)], cfg)
            if sampling is not None and hasattr(sampling, "sample_rows_out"):
                return sampling.sample_rows_out(logits, batch, pos)
            return jnp.argmax(logits, axis=-1)

        V, H = cfg.vocab_size, cfg.hidden_size
        return self.timed("lm_head+sampling", fn, (x,), 1, V * H * 2, 2 * S * V * H)


# ----------------------------------------------------------------------------- output
def rows_note(row) -> str:
    """", dense_matmul_rows N" where the row's value is not the default."""
    n = row.get("dense_matmul_rows")
    return "" if n is None or n == int(DENSE_ROWS_DEFAULT) else f", dense_matmul_rows {n}"


def format_row(row, tp: int | None = None) -> str:
    ctx_from = " (--prefill-context)" if row["kind"] == "prefill" else ""
    head = (f"{row['kind']} {row['requests']} req × {row['context']} ctx{ctx_from} "
            f"({row['tokens']} tokens{rows_note(row)}): step {row['step_ms']:.2f} ms (median; min {row['step_ms_min']:.2f})"
            + (f", floor {row['step_floor_ms']:.2f} ms ({row['step_floor_gb']:.2f} GB)"
               if "step_floor_ms" in row else "")
            + f", compile {row['compile_s']:.1f} s, host {row['host_bytes']['to_device']:,} B up"
            f" / {row['host_bytes']['to_host']:,} B down")
    lines = [head]
    if "step_kernels" in row:
        lines.append(f"  GPU trace of one step: {row['step_kernels']} kernels, "
                     f"{row['step_kernel_ms']:.2f} ms of kernels in a {row['step_span_ms']:.2f} ms "
                     f"span ({row['step_idle_ms']:.2f} ms idle between them)")
    if "routing" in row:
        r = row["routing"]
        lines.append(f"  the step's routing: {r['experts_mean']:.1f} experts per MoE layer "
                     f"(min–max over its {r['moe_layers']} MoE layers {r['experts_min']}–"
                     f"{r['experts_max']}; uniform routing would touch {r['uniform_experts']:.1f}),"
                     f" largest group {r['largest_group_mean']:.1f} rows (its mean over the "
                     f"layers; {r['pairs'] / max(r['experts_mean'], 1):.1f} rows per routed "
                     f"expert on average)")
    for p in row.get("parts", []):
        if p.get("us_per_layer", 0) is None:      # --no-parts: its floor only (in the step's)
            continue
        if "error" in p:
            lines.append(f"  {p['part']:<26} failed: {p['error']}")
            continue
        k = p.get("kernel_us_per_layer")
        name = p["part"] + (f" = {p['resolved']}" if p.get("resolved") not in (None, p["part"][5:-1])
                            else "")
        lines.append(f"  {name:<26} {p['us_per_layer']:10.1f} µs/layer"
                     + (f" (kernels {k:.1f})" if k else "")
                     + f"   floor {p['floor_us']:8.1f} µs ({p['floor_by']})"
                     + (f"   {p['routed_experts']} experts routed by the part's own random rows,"
                        " not the step's"
                        if "routed_experts" in p else "")
                     + f"   [{p['layers']} layers, compile {p['compile_s']:.1f} s"
                     + (f"; the same shapes as at context {p['reused_from']}: not re-timed"
                        if "reused_from" in p else "") + "]")
    if "projected_step_ms" in row:
        lines.append(
            f"  projected, {row['projected_layers']} layers at TP {tp or '?'}: step "
            f"{row['projected_step_ms']:.2f} ms (floor {row['projected_floor_ms']:.2f}; "
            f"modelled all-reduces {row['modelled_allreduce_ms']:.2f}) → "
            f"{row['projected_tokens_per_s_per_gpu']:.1f} tokens/s per GPU")
    return "\n".join(lines)


def format_report(r) -> str:
    """The built model, the floors' rates and one table row per timed shape."""
    lines = [format_header(r),
             *(["(--no-parts: whole steps timed, the floors from the parts' byte and FLOP counts; "
                "no part timed, so no projection)"]
               if not any("projected_step_ms" in x for x in r["shapes"]) else []),
             "| step | requests | context | step ms | floor ms | GB read (floor) | host B down | "
             "compile s | projected ms (all layers) | tok/s per GPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in r["shapes"]:
        lines.append(f"| {s['kind']}{rows_note(s)} | {s['requests']} | {s['context']} | {s['step_ms']:.2f} | "
                     f"{s.get('step_floor_ms', float('nan')):.2f} | "
                     f"{s.get('step_floor_gb', float('nan')):.2f} | "
                     f"{s['host_bytes']['to_host']:,} | {s['compile_s']:.1f} | "
                     f"{s.get('projected_step_ms', float('nan')):.2f} | "
                     f"{s.get('projected_tokens_per_s_per_gpu', float('nan')):.1f} |")
    return "\n".join(lines)


def format_header(r) -> str:
    """What one rank builds and the rates its floors use (``Bench.summary``'s fields)."""
    cfg = r["rank_config"]
    lines = [
        f"\n{r['backend']}{'' if r['device'] == r['backend'] else ' (' + r['device'] + ')'}: "
        f"one TP-{r['tp']} rank, {cfg['num_hidden_layers']} of "
        f"{r['full_layers']} layers built (hidden {cfg['hidden_size']}, {cfg['num_attention_heads']}"
        f" q / {cfg['num_key_value_heads']} KV heads, {cfg['num_local_experts']} experts of "
        f"{cfg['intermediate_size']}, top {cfg['num_experts_per_tok']}, vocab "
        f"{cfg['vocab_size']}), {r['pages']} pages, weights made in {r['init_s']:.1f} s "
        f"(the router's correction bias 0: balanced_router), "
        f"moe_impl {r['moe_impl']}, experts {cfg.get('expert_format', 'bf16')}"
        f"{' with the SwiGLU in the gate_up kernel' if cfg.get('moe_epilogue') else ''}; the step "
        f"{'with' if r.get('block_stats') else 'without'} the per-layer block counts "
        f"(block_stats={bool(r.get('block_stats'))})",
        f"floors: bytes ÷ {r['model']['bandwidth'] / 1e12:.2f} TB/s or FLOPs ÷ "
        f"{r['model']['flops'] / 1e12:.0f} TFLOP/s; the MoE's counts the routed experts only. "
        f"All-reduces: {r['model']['allreduce']}, {r['model']['link_bandwidth'] / 1e9:.0f} GB/s, "
        f"{r['model']['collective_latency'] * 1e6:.0f} µs."
        + ("" if r["backend"] == "gpu" else
           f" These are an H200's rates (--bandwidth, --flops), not this {r['backend']}'s: on "
           f"it the floors and 'per GPU' say what the shapes would need there.")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
