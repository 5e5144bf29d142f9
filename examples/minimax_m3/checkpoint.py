"""Loads MiniMax M3 checkpoint directories as they are published, lazily, onto their devices.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Two naming layouts are read (detected from the names):

* **transformers'** (``MiniMaxM3VLForCausalLM.save_pretrained``): ``model.layers.{i}.…``,
  ``mlp.gate_up_proj.weight [2I, H]`` (dense), ``mlp.experts.gate_up_proj [E, 2I, H]`` and
  ``mlp.experts.down_proj [E, H, I]``, ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
  ``mlp.shared_experts.{gate_up,down}_proj.weight``, ``self_attn.indexer.{q,k}_{proj,norm}``;
* **upstream** (the published MiniMax names, which transformers renames on load):
  ``language_model.model.layers.{i}.…``, ``block_sparse_moe.experts.{j}.w1/w3/w2.weight``
  (gate, up, down), ``block_sparse_moe.gate.weight``, ``block_sparse_moe.e_score_correction_bias``,
  ``block_sparse_moe.shared_experts.{gate,up,down}_proj.weight``, dense
  ``mlp.{gate,up,down}_proj.weight``, ``self_attn.index_{q,k}_{proj,norm}.weight``,
  ``language_model.lm_head.weight``. ``mtp.*`` and the vision tower are skipped.

Tied embeddings (``tie_word_embeddings``) need no ``lm_head.weight``. Quantized weights are
recognised by the scale tensors stored beside them (never by name) and dequantized on load, to
bf16 (or the ``dtype`` asked for), each format as its ``quantization_config.quant_method`` says:

* ``"fp8"``: ``float8_e4m3fn`` + ``weight_scale_inv`` (float) per 128 × 128 block: ``w · s``;
* ``"mxfp8"`` (``MiniMaxAI/MiniMax-M3-MXFP8``): ``float8_e4m3fn`` + ``weight_scale_inv`` **U8**,
  an E8M0 exponent per 32 inputs (not an inverse, despite the name): ``w · 2^(e − 127)``;
* ``"modelopt"`` (``nvidia/MiniMax-M3-NVFP4``): the routed experts NVFP4 — ``weight`` U8
  ``[out, in/2]`` (element 2i in the low nibble, E2M1), ``weight_scale`` E4M3 per 16 inputs,
  ``weight_scale_2`` fp32: ``e2m1 · scale · scale_2`` — and the other linears MXFP8;
* ``"quark"`` (``amd/MiniMax-M3-MXFP4``): the experts MXFP4 — ``weight`` U8 ``[out, in/2]``,
  ``weight_scale`` U8 E8M0 per 32 inputs: ``e2m1 · 2^(e − 127)`` — the rest bf16.

A format the ``quant_method`` does not name, a scale of the wrong shape or an unknown
``quant_method`` is an error naming it before anything is read. Real M3 in bf16 fits TP 8 on
H200s (141 GB; ``--dry-run``, ``plan.py``). ``--expert-format mxfp8`` (``ModelConfig.expert_format``) then
makes the routed experts MXFP8 on the device (``moe.quantize_experts``: lossless for an MXFP8
checkpoint), which jax_m3sparse.grouped_matmul reads as they are.

Lazy: every parameter is built with ``jax.make_array_from_callback`` for its
``NamedSharding`` on its devices and filled there from pieces of at most ``PIECE_BYTES`` (cut
along an unsharded axis), so each device reads only its slice. Reads go through safetensors'
``safe_open`` in row chunks of at most ``CHUNK_BYTES``, a file opened per chunk, so the
memory-mapped pages a read touches are released before the next: host memory above the loaded
weights stays within one layer-slice of one parameter plus a chunk. Tensors keep the
checkpoint's dtype (fp32 or bf16; never an fp32 copy of a bf16 checkpoint) unless ``dtype``
says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open

from .config import MOE, SPARSE, ModelConfig, quantization_config
from .moe import expert_leaf_names
from .parallel import is_shape

CHUNK_BYTES = 16 << 20      # rows read per safe_open
PIECE_BYTES = 64 << 20      # per-layer slice placed per device transfer (> glibc's 32 MiB
                            # mmap threshold, so a freed piece returns to the OS)
_SKIP = re.compile(r"(^|\.)mtp\.|^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.")
_FP8_BLOCK = 128
# E2M1 codes (bit 3 the sign) -> values
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# quant_method -> the stored weight formats it may hold (besides plain tensors)
QUANT_FORMATS = {"fp8": ("fp8_block",), "mxfp8": ("mxfp8",), "modelopt": ("mxfp8", "nvfp4"),
                 "quark": ("mxfp4",)}


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one quantized weight is stored: ``kind`` (fp8_block, mxfp8, nvfp4, mxfp4), inputs per
    scale along the last axis (``group``; 128 × 128 blocks for fp8_block), the scale tensors."""

    kind: str
    group: int
    scale: str
    scale_2: str | None = None
    extra: tuple[str, ...] = ()        # stored beside it and not needed (input_scale)

    def companions(self) -> tuple[str, ...]:
        return (self.scale, *((self.scale_2,) if self.scale_2 else ()), *self.extra)


# ----------------------------------------------------------------------------- files
class CheckpointFiles:
    """The tensors of a checkpoint directory (or one ``.safetensors`` file): name -> file,
    stored shape and dtype, read by slices."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            else:
                files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{path}: no model.safetensors, no index, no *.safetensors")
            files = [os.path.join(path, f) for f in files]
        else:
            files = [path]
        self.file, self.shape, self.dtype = {}, {}, {}
        self.fp8_offset = {}        # FP8 tensors: byte offset of their data in their file
        for fn in files:
            with safe_open(fn, framework="numpy") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    self.file[name], self.shape[name] = fn, tuple(s.get_shape())
                    self.dtype[name] = s.get_dtype()
            if any(self.dtype[n] == "F8_E4M3" for n in self.file if self.file[n] == fn):
                self.fp8_offset.update(_fp8_offsets(fn))
        self.format = {n: f for n in self.file if (f := self._detect(n)) is not None}
        self.stored_shape = dict(self.shape)
        for n, f in self.format.items():      # packed FP4: two inputs per byte
            if f.kind in ("nvfp4", "mxfp4"):
                self.shape[n] = (*self.shape[n][:-1], 2 * self.shape[n][-1])

    def _detect(self, name) -> WeightFormat | None:
        """The quantized format of ``name`` from the scale tensors beside it, or None."""
        dt = self.dtype[name]
        if dt == "F8_E4M3" and name + "_scale_inv" in self.file:
            mx = self.dtype[name + "_scale_inv"] == "U8"
            return WeightFormat("mxfp8" if mx else "fp8_block", 32 if mx else _FP8_BLOCK,
                                name + "_scale_inv", extra=self._input_scale(name))
        base = name[:-len("weight")] if name.endswith(".weight") else None
        if dt == "U8" and base and base + "weight_scale" in self.file:
            if self.dtype[base + "weight_scale"] == "F8_E4M3" and base + "weight_scale_2" in self.file:
                return WeightFormat("nvfp4", 16, base + "weight_scale", base + "weight_scale_2",
                                    self._input_scale(name))
            if self.dtype[base + "weight_scale"] == "U8":
                return WeightFormat("mxfp4", 32, base + "weight_scale",
                                    extra=self._input_scale(name))
        return None

    def _input_scale(self, name):
        n = name[:-len("weight")] + "input_scale" if name.endswith(".weight") else None
        return (n,) if n in self.file else ()

    def names(self) -> set[str]:
        return set(self.file)

    def read_part(self, name: str, part: str, index: tuple[slice, ...], out: np.ndarray) -> None:
        """``out[...] = `` the stored bytes of packed FP4 ``name`` (``part`` "data"; ``index``
        in bytes along the last axis) or of its block scales ("scale"), as they are."""
        out[...] = self._read_chunk(name if part == "data" else self.format[name].scale, index)

    def scale_2(self, name: str) -> np.float32:
        """The fp32 per-tensor ``weight_scale_2`` of NVFP4 ``name``."""
        with safe_open(self.file[self.format[name].scale_2], framework="numpy") as f:
            return np.float32(f.get_tensor(self.format[name].scale_2).reshape(-1)[0])

    def read_into(self, name: str, index: tuple[slice, ...], out: np.ndarray) -> None:
        """``out[...] = tensor[index]`` (one slice per axis), cast to ``out``'s dtype, in row
        chunks of at most CHUNK_BYTES; FP8 weights times their ``weight_scale_inv`` blocks."""
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape[name]))
        # quantized weights are widened to fp32 per chunk: size the chunk by that
        unit = 4 if name in self.format else self._itemsize(name)
        row_bytes = max(int(np.prod(out.shape[1:], dtype=np.int64)), 1) * unit
        step = max(1, CHUNK_BYTES // row_bytes)
        first = index[0].start
        fmt = self.format.get(name)
        for r0 in range(first, index[0].stop, step):
            rows = (slice(r0, min(r0 + step, index[0].stop)), *index[1:])
            if fmt is None:
                chunk = self._read_chunk(name, rows)
            elif fmt.kind == "fp8_block":
                chunk = self._dequantize(name, rows, self._read_chunk(name, rows))
            else:
                chunk = self._read_grouped(name, fmt, rows)
            out[r0 - first:rows[0].stop - first] = chunk

    def _read_grouped(self, name, fmt: WeightFormat, index):
        """``tensor[index]`` in fp32 for a per-group-scaled weight: the groups covering the
        last axis' slice are read, widened, scaled, and cut to the slice."""
        *lead, c = index
        g = fmt.group
        a0, a1 = c.start // g * g, min(-(-c.stop // g) * g, self.shape[name][-1])
        if fmt.kind == "mxfp8":
            values = self._read_chunk(name, (*lead, slice(a0, a1))).astype(np.float32)
        else:                                  # packed E2M1, element 2i in the low nibble
            packed = self._read_chunk(name, (*lead, slice(a0 // 2, a1 // 2)))
            values = np.stack([_E2M1[packed & 15], _E2M1[packed >> 4]], -1).reshape(
                *packed.shape[:-1], a1 - a0)
        scale = self._read_chunk(fmt.scale, (*lead, slice(a0 // g, a1 // g)))
        if fmt.kind == "nvfp4":
            scale = scale.astype(np.float32) * self.scale_2(name)
        else:                                  # E8M0: 2^(e - 127); 255 is NaN
            e = scale.astype(np.int32)
            scale = np.where(e == 255, np.float32(np.nan),
                             np.ldexp(np.float32(1), e - 127).astype(np.float32))
        values = values * np.repeat(scale, g, axis=-1)
        return values[..., c.start - a0:c.stop - a0]

    def _dequantize(self, name, index, values):
        """FP8 ``values`` (``tensor[index]``) times their 128 × 128 blocks' scales (fp32)."""
        r, c = index[-2], index[-1]
        b = _FP8_BLOCK
        blocks = tuple(slice(s.start // b, -(-s.stop // b)) for s in (r, c))
        with safe_open(self.file[name + "_scale_inv"], framework="numpy") as f:
            scale = f.get_slice(name + "_scale_inv")[(*index[:-2], *blocks)].astype(np.float32)
        scale = np.repeat(np.repeat(scale, b, axis=-2), b, axis=-1)
        r0, c0 = blocks[0].start * b, blocks[1].start * b
        return values.astype(np.float32) * scale[..., r.start - r0:r.stop - r0, c.start - c0:c.stop - c0]

    def _itemsize(self, name):
        return {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}.get(self.dtype[name], 4)

    def _read_chunk(self, name, index):
        if self.dtype[name] == "F8_E4M3":   # safetensors' numpy reader has no fp8 dtype
            return self._read_fp8(name, index)
        with safe_open(self.file[name], framework="numpy") as f:   # closed: pages unmapped
            return f.get_slice(name)[index]

    def _read_fp8(self, name, index):
        """FP8 bytes through a memory map of the tensor's data, viewed as ``float8_e4m3fn``."""
        data = np.memmap(self.file[name], np.uint8, "r", offset=self.fp8_offset[name],
                         shape=self.stored_shape[name])
        out = np.array(data[index]).view(ml_dtypes.float8_e4m3fn)
        del data
        return out


def _fp8_offsets(fn: str) -> dict[str, int]:
    """{FP8 tensor: absolute byte offset of its data} from a safetensors file's header (8-byte
    length, JSON), read once per file: safetensors' numpy reader has no fp8 dtype."""
    with open(fn, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items()
            if k != "__metadata__" and v["dtype"] == "F8_E4M3"}


# ----------------------------------------------------------------------------- names
@dataclasses.dataclass(frozen=True)
class Source:
    """Where one layer's (or the model's) parameter comes from: ``kind`` says how the stored
    tensors ``names`` (stored shapes ``stored``) assemble into our layout."""

    kind: str          # plain | gate_up (packed [2I, H]) | gate_up_pair | experts_* (see _read)
    names: tuple[str, ...]
    stored: tuple[tuple[int, ...], ...]
    # what of the named tensors: "value" (dequantized, the default), or for FP4 experts kept as
    # stored (cfg.fp4_experts): "data" (the packed bytes), "scale", "scale_2" (their scales')
    part: str = "value"


def _sources(cfg: ModelConfig, layout: str) -> tuple[dict, list]:
    """``(top, segments)``: ``{key: Source}`` for the top-level parameters, and per segment
    (ModelConfig.segments) a list with one Source pytree per layer, shaped like
    model.layer_shapes."""
    up = layout == "upstream"
    root = "language_model.model." if up else "model."
    H, D, E = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts
    Hq, Hkv, Di = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_head_dim

    def plain(name, shape):
        return Source("plain", (name,), (tuple(shape),))

    def swiglu(pre, inter, shapes):   # dense MLP or shared expert, our keys gate_up/down
        if up:
            shapes["gate_up_proj"] = Source("gate_up_pair", (pre + "gate_proj.weight",
                                                            pre + "up_proj.weight"),
                                            ((inter, H), (inter, H)))
        else:
            shapes["gate_up_proj"] = Source("gate_up", (pre + "gate_up_proj.weight",),
                                            ((2 * inter, H),))
        shapes["down_proj"] = plain(pre + "down_proj.weight", (H, inter))
        return shapes

    def layer(i, attn, mlp):
        pre = f"{root}layers.{i}."
        sa = pre + "self_attn."
        src = {"input_layernorm": plain(pre + "input_layernorm.weight", (H,)),
               "post_attention_layernorm": plain(pre + "post_attention_layernorm.weight", (H,)),
               "self_attn": dict(q_proj=plain(sa + "q_proj.weight", (Hq * D, H)),
                                 k_proj=plain(sa + "k_proj.weight", (Hkv * D, H)),
                                 v_proj=plain(sa + "v_proj.weight", (Hkv * D, H)),
                                 o_proj=plain(sa + "o_proj.weight", (H, Hq * D)),
                                 q_norm=plain(sa + "q_norm.weight", (D,)),
                                 k_norm=plain(sa + "k_norm.weight", (D,)))}
        if attn == SPARSE:
            ix = (lambda n: f"{sa}index_{n}.weight") if up else (lambda n: f"{sa}indexer.{n}.weight")
            src["self_attn"]["indexer"] = dict(
                q_proj=plain(ix("q_proj"), (cfg.index_n_heads * Di, H)),
                k_proj=plain(ix("k_proj"), (Di, H)), q_norm=plain(ix("q_norm"), (Di,)),
                k_norm=plain(ix("k_norm"), (Di,)))
        if mlp != MOE:
            src["mlp"] = swiglu(pre + "mlp.", cfg.dense_intermediate_size, {})
            return src
        I = cfg.intermediate_size
        if up:
            m = pre + "block_sparse_moe."
            ex = [f"{m}experts.{j}." for j in range(E)]
            experts = dict(
                gate_up_proj=Source("experts_gate_up_split",
                                    tuple(e + w for e in ex for w in ("w1.weight", "w3.weight")),
                                    ((I, H),) * (2 * E)),
                down_proj=Source("experts_down_split", tuple(e + "w2.weight" for e in ex),
                                 ((H, I),) * E))
            if cfg.fp4_experts:        # the checkpoint's bytes and scales, as they are
                experts = {leaf: dataclasses.replace(
                    src, part=leaf[len(name) + 1:] or "data",
                    kind="experts_scale_2" if leaf.endswith("_scale_2") else src.kind)
                    for name, src in experts.items()
                    for leaf in expert_leaf_names(cfg.expert_format, name)}
            gate, bias = plain(m + "gate.weight", (E, H)), plain(m + "e_score_correction_bias", (E,))
        else:
            m = pre + "mlp."
            experts = dict(gate_up_proj=Source("experts_gate_up", (m + "experts.gate_up_proj",),
                                               ((E, 2 * I, H),)),
                           down_proj=plain(m + "experts.down_proj", (E, H, I)))
            gate = plain(m + "gate.weight", (E, H))
            bias = plain(m + "gate.e_score_correction_bias", (E,))
        src["mlp"] = dict(gate=gate, e_score_correction_bias=bias, experts=experts,
                          shared_experts=swiglu(m + "shared_experts.",
                                                cfg.shared_intermediate_size, {}))
        return src

    top = {"embed_tokens": plain(root + "embed_tokens.weight", (cfg.vocab_size, H)),
           "norm": plain(root + "norm.weight", (H,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = plain(("language_model." if up else "") + "lm_head.weight",
                               (cfg.vocab_size, H))
    segments = [[layer(i, a, m) for i in range(first, first + n)]
                for a, m, first, n in cfg.segments()]
    return top, segments


def _read(files: CheckpointFiles, src: Source, index: tuple[slice, ...], shape,
          dtype) -> np.ndarray:
    """Our-layout slice ``index`` of the parameter that ``src`` describes, as ``dtype``: each
    stored piece is read straight into its place in one output array."""
    idx = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    out = np.empty(tuple(s.stop - s.start for s in idx), dtype)
    put = files.read_into
    if src.part != "value":
        def put(name, index, out):        # noqa: F811 (the FP4 experts' bytes as stored)
            files.read_part(name, src.part, index, out)
    if src.kind == "plain":
        put(src.names[0], idx, out)
    elif src.kind in ("gate_up", "gate_up_pair"):         # ours [2, I, H]
        g, i, h = idx
        for n, k in enumerate(range(g.start, g.stop)):
            if src.kind == "gate_up":                     # stored [2I, H]: gate rows first
                put(src.names[0], (slice(k * shape[1] + i.start, k * shape[1] + i.stop), h), out[n])
            else:                                         # stored gate_proj, up_proj
                put(src.names[k], (i, h), out[n])
    elif src.kind == "experts_gate_up":                   # ours [E, 2, I, H], stored [E, 2I, H]
        e, g, i, h = idx
        for n, k in enumerate(range(g.start, g.stop)):
            rows = slice(k * shape[2] + i.start, k * shape[2] + i.stop)
            for m, j in enumerate(range(e.start, e.stop)):
                put(src.names[0], (slice(j, j + 1), rows, h), out[m:m + 1, n])
    elif src.kind == "experts_gate_up_split":             # per expert w1 (gate), w3 (up)
        e, g, i, h = idx
        for m, j in enumerate(range(e.start, e.stop)):
            for n, k in enumerate(range(g.start, g.stop)):
                put(src.names[2 * j + k], (i, h), out[m, n])
    elif src.kind == "experts_down_split":                # ours [E, H, I]; per expert w2
        e, h, i = idx
        for m, j in enumerate(range(e.start, e.stop)):
            put(src.names[j], (h, i), out[m])
    elif src.kind == "experts_scale_2":                   # ours [E]: NVFP4's per expert
        (e,) = idx
        per = len(src.names) // shape[0]                  # w1, w3 share one (gate_up) or w2
        for m, j in enumerate(range(e.start, e.stop)):
            names = src.names[per * j:per * (j + 1)]
            values = {float(files.scale_2(n)) for n in names}
            if len(values) != 1:
                raise ValueError(f"{', '.join(names)}: weight_scale_2 differ ({sorted(values)}); "
                                 f"--expert-format nvfp4 keeps one per expert for gate and up "
                                 f"(load with --expert-format bf16 or mxfp8 instead)")
            out[m] = values.pop()
    else:
        raise AssertionError(src.kind)
    return out


# ----------------------------------------------------------------------------- checks
def detect_layout(names) -> str:
    return "upstream" if any(n.startswith("language_model.") for n in names) else "transformers"


def _check(files: CheckpointFiles, top, segments, method: str | None) -> None:
    """Raises ValueError naming every missing, unexpected or mis-shaped tensor, and every
    quantized weight whose format or scales ``method`` (the quant_method) does not allow."""
    leaves = jax.tree_util.tree_leaves((top, segments), is_leaf=lambda x: isinstance(x, Source))
    want = {n: s for src in leaves for n, s in zip(src.names, src.stored)}
    have = files.names()
    problems = [f"missing {n}" for n in sorted(set(want) - have)]
    problems += [f"{n}: expected shape {want[n]}, got {files.shape[n]}"
                 for n in sorted(set(want) & have) if files.shape[n] != want[n]]
    used = set(want)
    allowed = QUANT_FORMATS.get(method, ())
    for n in sorted(set(want) & have):
        fmt = files.format.get(n)
        if fmt is None:
            if files.dtype[n] in ("F8_E4M3", "U8"):
                problems.append(f"{n}: stored as {files.dtype[n]} without the scale tensors of a "
                                f"format we read")
            continue
        used |= set(fmt.companions())
        if fmt.kind not in allowed:
            problems.append(f"{n}: stored as {fmt.kind}, which quantization_config "
                            f"(quant_method {method!r}) does not name")
            continue
        if fmt.kind != "fp8_block":
            expect = (*files.shape[n][:-1], files.shape[n][-1] // fmt.group)
            if files.shape[n][-1] % fmt.group or files.shape[fmt.scale] != expect:
                problems.append(f"{fmt.scale}: expected shape {expect} (one scale per "
                                f"{fmt.group} inputs of {n} {files.shape[n]}), got "
                                f"{files.shape[fmt.scale]}")
        if fmt.scale_2 and math.prod(files.shape[fmt.scale_2]) != 1:
            problems.append(f"{fmt.scale_2}: expected one fp32 scale, got shape "
                            f"{files.shape[fmt.scale_2]}")
    extra = sorted(n for n in have - used if not _SKIP.search(n)
                   and not n.endswith("lm_head.weight"))        # a tied model may carry one
    problems += [f"unexpected {n}" for n in extra]
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise ValueError(f"checkpoint {files.path} does not fit its config.json "
                         f"({len(problems)} problems):\n  " + "\n  ".join(shown))


def quant_method(qc: dict | None) -> str | None:
    """The checkpoint's ``quant_method`` after checking every ``quantization_config`` key we
    read (None: unquantized). Raises ValueError naming a method, algorithm, block or group
    size that this loader does not read."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in QUANT_FORMATS:
        raise ValueError(f"quantization_config.quant_method {method!r}: this loader reads "
                         f"{sorted(QUANT_FORMATS)}")

    def need(what, value, ok):
        if value is not None and value not in ok:
            raise ValueError(f"quantization_config.{what} {value!r}: only {ok} is read "
                             f"(quant_method {method!r})")

    if method == "fp8":
        need("weight_block_size", qc.get("weight_block_size"), ([128, 128],))
        need("fmt", qc.get("fmt"), ("e4m3",))
    elif method == "mxfp8":
        need("weight_block_size", qc.get("weight_block_size"), ([1, 32],))
        # "dynamic": activations quantized per 32 at run time (--expert-format mxfp8_w8a8 does
        # so for the experts; the default keeps them bf16); a static scheme would ship scales
        need("activation_scheme", qc.get("activation_scheme"), ("dynamic",))
    elif method == "modelopt":
        need("quant_algo", qc.get("quant_algo"), ("MIXED_PRECISION", "NVFP4", "MXFP8"))
        if qc.get("quant_algo") == "NVFP4":
            need("group_size", qc.get("group_size"), (16,))
        for name, layer in (qc.get("quantized_layers") or {}).items():
            need(f"quantized_layers[{name!r}].quant_algo", layer.get("quant_algo"),
                 ("MXFP8", "NVFP4"))
            if layer.get("quant_algo") == "NVFP4":
                need(f"quantized_layers[{name!r}].group_size", layer.get("group_size"), (16,))
    else:                                                   # quark
        weight = (qc.get("global_quant_config") or {}).get("weight") or {}
        need("global_quant_config.weight.dtype", weight.get("dtype"), ("fp4",))
        need("global_quant_config.weight.group_size", weight.get("group_size"), (32,))
        need("global_quant_config.weight.scale_format", weight.get("scale_format"), ("e8m0",))
    return method


# ----------------------------------------------------------------------------- placing
def _out_dtype(files, src: Source, dtype):
    if src.part != "value":           # FP4 experts as stored: packed bytes, E8M0 / E4M3, fp32
        scale = files.dtype[files.format[src.names[0]].scale]
        return jnp.dtype({"data": jnp.uint8, "scale_2": jnp.float32}.get(
            src.part, jnp.float8_e4m3fn if scale == "F8_E4M3" else jnp.uint8))
    if dtype is not None:
        return jnp.dtype(dtype)
    stored = files.dtype[src.names[0]]
    return jnp.dtype({"F32": jnp.float32, "F16": jnp.float16}.get(stored, jnp.bfloat16))


def _place(files, src, shape, sharding, dtype, axis=0, start=0, size=None):
    """One array of the parameter's rows ``[start, start + size)`` along ``axis`` (all of it
    by default), made from its devices' slices, each read, moved to its device and released
    before the next (``make_array_from_callback`` would read every local slice first)."""
    size = shape[axis] if size is None else size
    piece = (*shape[:axis], size, *shape[axis + 1:])
    shards = []
    for device, index in sharding.addressable_devices_indices_map(piece).items():
        index = list(index)
        lo, hi, _ = index[axis].indices(size)
        index[axis] = slice(start + lo, start + hi)
        host = _read(files, src, tuple(index), shape, dtype)
        shards.append(jax.device_put(host, device, may_alias=True))
        shards[-1].block_until_ready()
        del host
    return jax.make_array_from_single_device_arrays(piece, sharding, shards)


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _setter(sharding):
    """``jax.lax.dynamic_update_slice``, in place (the buffer is donated)."""
    return jax.jit(lambda buf, x, starts: jax.lax.dynamic_update_slice(buf, x, starts),
                   donate_argnums=0, out_shardings=sharding)


def _fill(files, srcs, shape, sharding, dtype, tick):
    """A parameter of ``shape`` built in its device buffer from pieces of at most PIECE_BYTES,
    cut along the (layer) slice's largest unsharded axis: each piece lands in its own devices'
    shards, so the host and the devices hold at most one piece beside the buffer, whatever the
    tensor's size. ``srcs``: one Source (a top-level parameter) or a list of one per layer
    (stacked on the leading axis)."""
    stacked = isinstance(srcs, list)
    layer_shape = shape[1:] if stacked else shape
    spec = tuple(sharding.spec)[1:] if stacked else tuple(sharding.spec)
    spec = (*spec, *(None,) * (len(layer_shape) - len(spec)))
    layer_sharding = NamedSharding(sharding.mesh, P(*spec))
    free = [d for d in range(len(layer_shape)) if spec[d] is None] or [0]
    axis = max(free, key=lambda d: layer_shape[d])
    unit = jnp.dtype(dtype).itemsize * math.prod(layer_shape) // max(layer_shape[axis], 1)
    step = max(1, PIECE_BYTES // max(unit, 1))
    buf = _zeros(tuple(shape), dtype, sharding)()
    for i, src in enumerate(srcs if stacked else [srcs]):
        for start in range(0, layer_shape[axis], step):
            size = min(step, layer_shape[axis] - start)
            piece = _place(files, src, layer_shape, layer_sharding, dtype, axis, start, size)
            starts = [0] * len(layer_shape)
            starts[axis] = start
            if stacked:
                piece, starts = piece[None], [i, *starts]
            buf = _setter(sharding)(buf, piece, tuple(np.int32(s) for s in starts))
            buf.block_until_ready()           # one piece in flight at a time
            del piece
        tick(1)
    return buf


def load_params(path: str, cfg: ModelConfig, shardings, dtype=None, progress=None) -> dict:
    """Reads a checkpoint directory into the param pytree of :func:`model.param_shapes` (the
    served layout: the attention input projections fused once loaded, model.fuse_projections).

    Args:
      path: a checkpoint directory (or one ``.safetensors`` file).
      cfg: the model config (``config.from_hf_config(path)`` for a directory).
      shardings: a pytree of ``NamedSharding`` like ``param_shapes(cfg)``
        (``parallel.param_shardings``).
      dtype: None keeps each tensor's stored dtype (quantized weights become bf16); else cast
        to it.
      progress: optional callable(n) told after each stored tensor group is placed (tqdm).

    Returns:
      The params, each leaf on its devices with its sharding.

    Raises:
      ValueError naming every missing, unexpected or mis-shaped tensor, an unknown or
      unsupported ``quantization_config``, a quantized format its ``quant_method`` does not
      name, or a scale of the wrong shape — before reading any weight.
    """
    from .model import (checkpoint_shardings, fuse_projections,  # noqa: PLC0415 (model ->
                        param_shapes)                              # parallel; imports one way)
    files = CheckpointFiles(path)
    layout = detect_layout(files.names())
    top, segments = _sources(cfg, layout)
    method = quant_method(quantization_config(path) if os.path.isdir(path) else None)
    _check(files, top, segments, method)
    if cfg.fp4_experts:
        _check_fp4_experts(files, segments, cfg.expert_format, layout)
    served, shardings = shardings, checkpoint_shardings(shardings, cfg)
    shapes = param_shapes(cfg, fused=False)
    tick = progress or (lambda n: None)
    out = {key: _fill(files, src, shapes[key], shardings[key], _out_dtype(files, src, dtype), tick)
           for key, src in top.items()}
    out["segments"] = [
        jax.tree_util.tree_map(
            lambda shape, sharding, *srcs: _fill(files, list(srcs), shape, sharding,
                                                 _out_dtype(files, srcs[0], dtype), tick),
            seg_shapes, seg_shard, *seg_src, is_leaf=is_shape)
        for seg_src, seg_shapes, seg_shard in zip(segments, shapes["segments"],
                                                  shardings["segments"])]
    return fuse_projections(out, cfg, served)


def _check_fp4_experts(files, segments, fmt: str, layout: str) -> None:
    """Raises ValueError unless every routed expert weight is stored as ``fmt`` (what
    ``--expert-format`` mxfp4 / nvfp4 keeps as it is), in the published layout."""
    if layout != "upstream":
        raise ValueError(f"--expert-format {fmt} keeps a published checkpoint's FP4 experts as "
                         f"they are; {files.path} is in transformers' layout (load it with "
                         f"--expert-format bf16 or mxfp8)")
    names = {n for seg in segments for layer in seg
             for src in layer.get("mlp", {}).get("experts", {}).values() for n in src.names}
    wrong = sorted(n for n in names if getattr(files.format.get(n), "kind", None) != fmt)
    if wrong:
        kind = getattr(files.format.get(wrong[0]), "kind", None) or files.dtype[wrong[0]]
        raise ValueError(f"--expert-format {fmt} keeps the checkpoint's routed experts as they "
                         f"are, but {len(wrong)} are not {fmt} (e.g. {wrong[0]}: {kind}); use "
                         f"--expert-format {expert_storage(files) or 'bf16'}, or bf16 / mxfp8 "
                         f"(quantized on the device)")


def expert_storage(files) -> str | None:
    """How a checkpoint (a path or CheckpointFiles) stores its routed experts: "mxfp8",
    "nvfp4", "mxfp4", "fp8_block", or None (unquantized, or no experts)."""
    files = files if isinstance(files, CheckpointFiles) else CheckpointFiles(files)
    for name in sorted(files.names()):
        if re.search(r"experts\.(\d+\.w1\.weight|gate_up_proj)$", name):
            return getattr(files.format.get(name), "kind", None)
    return None


def count_tensors(cfg: ModelConfig) -> int:
    """Parameter groups load_params reports to ``progress`` (for a progress bar's total)."""
    top, segments = _sources(cfg, "upstream" if cfg.fp4_experts else "transformers")
    return len(top) + sum(len(jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, Source)))
                          for s in segments)


# ----------------------------------------------------------------------------- writing
def to_hf_config(cfg: ModelConfig) -> dict:
    """A transformers ``config.json`` (``model_type`` minimax_m3_vl_text) for ``cfg``."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for serving in ("kv_replicas", "baseline_dtype", "baseline_selection", "moe_impl",
                    "index_cache_dtype", "expert_format",
                    "rope_theta"):
        fields.pop(serving)
    fields.update(model_type="minimax_m3_vl_text", architectures=["MiniMaxM3VLForCausalLM"],
                  layer_types=list(cfg.layer_types), mlp_layer_types=list(cfg.mlp_layer_types),
                  rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                                       partial_rotary_factor=cfg.rotary_dim / cfg.head_dim))
    return fields


def _stored(src: Source, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Our-layout value -> the transformers-layout tensors of ``src`` (the inverse of _read)."""
    if src.kind == "plain":
        return [(src.names[0], value)]
    if src.kind == "gate_up":                     # [2, I, H] -> [2I, H]
        return [(src.names[0], value.reshape(-1, value.shape[-1]))]
    if src.kind == "experts_gate_up":             # [E, 2, I, H] -> [E, 2I, H]
        return [(src.names[0], value.reshape(value.shape[0], -1, value.shape[-1]))]
    raise ValueError(f"save_checkpoint writes transformers' layout, not {src.kind}")


def save_checkpoint(path: str, params: dict, cfg: ModelConfig, max_shard_bytes: int | None = None,
                    dtype=None) -> None:
    """Writes ``params`` as a transformers-layout checkpoint directory (config.json and
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``), one shard in host memory at a time."""
    from safetensors.numpy import save_file  # noqa: PLC0415
    from .model import unfuse_projections  # noqa: PLC0415
    params = unfuse_projections(params, cfg)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f, indent=1)
    top, segments = _sources(cfg, "transformers")

    def tensors():
        for key, src in top.items():
            yield from _stored(src, np.asarray(params[key]))
        for seg_src, seg_params in zip(segments, params["segments"]):
            for i, layer_src in enumerate(seg_src):
                yield from (t for src, value in zip(
                    jax.tree_util.tree_leaves(layer_src, is_leaf=lambda x: isinstance(x, Source)),
                    jax.tree_util.tree_leaves(seg_params)) for t in _stored(src, np.asarray(value[i])))

    if not max_shard_bytes:
        save_file({n: _contiguous(a, dtype) for n, a in tensors()},
                  os.path.join(path, "model.safetensors"))
        return
    shard, size, count = {}, 0, 0
    for name, a in tensors():
        a = _contiguous(a, dtype)
        if shard and size + a.nbytes > max_shard_bytes:
            count += 1
            save_file(shard, os.path.join(path, f"model-{count:05d}.safetensors"))
            shard, size = {}, 0
        shard[name], size = a, size + a.nbytes
    save_file(shard, os.path.join(path, f"model-{count + 1:05d}.safetensors"))
    _write_index(path)


def _contiguous(a, dtype):
    return np.ascontiguousarray(a if dtype is None else a.astype(dtype))


def _write_index(path):
    weight_map = {}
    for fn in sorted(f for f in os.listdir(path) if f.startswith("model-")):
        with safe_open(os.path.join(path, fn), framework="numpy") as f:
            weight_map.update({k: fn for k in f.keys()})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
