"""Independent float64/numpy oracles written from SPEC.md (they never call jax_m3sparse).

* NVFP4 (SPEC §2.2): fp32 numpy arithmetic, ml_dtypes for the E4M3 rounding, and E2M1
  rounding by nearest grid point with ties to the even code (not by thresholds).
* Page map (SPEC §3): byte-by-byte writes with Python offsets.
* Attention (SPEC §5): float64 dense softmax over the keys a row attends, read from the
  stored bytes.
* grouped_matmul (SPEC §9): a float64 matmul per group of rows.
* route_experts (SPEC §10): Python sorts one token and one pair at a time, float32 weights.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def e2m1_code(y: float) -> int:
    """Nearest magnitude on the grid (ties to the even code), saturating; sign bit unless +0."""
    a = abs(float(y))
    dist = np.abs(E2M1_GRID - min(a, 6.0))
    best = np.flatnonzero(dist == dist.min())
    m = int(best[0]) if len(best) == 1 else int(best[best % 2 == 0][0])
    return m | 8 if (m and np.signbit(y)) else m


def quantize(x, g):
    """(data uint8[..., D/2], scale bytes uint8[..., D/16]) of x (any float dtype), SPEC §2.2."""
    x = np.asarray(x).astype(np.float32)
    g = np.float32(g)
    with np.errstate(all="ignore"):
        r = np.float32(1) / g
    bad_g = not (2.0 ** -126 <= g <= 2.0 ** 126)     # docs/spec_decisions.md
    D = x.shape[-1]
    flat = x.reshape(-1, D)
    data = np.zeros((flat.shape[0], D // 2), np.uint8)
    scales = np.zeros((flat.shape[0], D // 16), np.uint8)
    with np.errstate(all="ignore"):
        for i, row in enumerate(flat):
            for s in range(D // 16):
                grp = row[16 * s:16 * s + 16]
                if bad_g or np.isnan(grp).any():
                    scales[i, s] = 0x7F
                    continue
                amax = np.float32(np.max(np.abs(grp)))
                sv = np.float32(np.float32(amax / np.float32(6)) * r)
                sf = np.array(min(max(sv, np.float32(2.0 ** -9)), np.float32(448)),
                              np.float32).astype(ml_dtypes.float8_e4m3fn)
                scales[i, s] = sf.view(np.uint8)
                codes = [e2m1_code(np.float32(np.float32(v * r) / np.float32(sf.astype(np.float32))))
                         for v in grp]
                for j in range(8):
                    data[i, 8 * s + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return data.reshape(*x.shape[:-1], D // 2), scales.reshape(*x.shape[:-1], D // 16)


def dequantize(data, scale_bytes, g):
    """float64 values of stored NVFP4 bytes (SPEC §2.1)."""
    data = np.asarray(data)
    vals = np.concatenate([E2M1_GRID, -E2M1_GRID])
    v = np.stack([vals[data & 15], vals[data >> 4]], -1).reshape(*data.shape[:-1], -1)
    s = np.asarray(scale_bytes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return v * np.repeat(s, 16, axis=-1) * np.float64(np.float32(g))


def page_index(layer, page, num_layers, num_pages, layout):
    """Index of (layer, page) in the first two axes of a 5-D cache (SPEC §3.3)."""
    return (layer, page) if layout == "LBHNC" else (page, layer)


def tile(cache, layer, page, slot, layout="LBHNC"):
    """Bytes [N·C] of one (page, slot) tile of a 4-D or 5-D numpy cache."""
    if cache.ndim == 4:
        return cache[page, slot].reshape(-1)
    return cache[page_index(layer, page, 0, 0, layout)][slot].reshape(-1)


def pack(cache, key, value, slots, gk, gv, layer=0, layout="LBHNC"):
    """Numpy cache after writing key/value [T, Hkv, D] at slots (SPEC §3.2–3.4)."""
    cache = np.array(cache, copy=True)
    N, C = cache.shape[-2:]
    D = key.shape[-1]
    P = cache.shape[0] if cache.ndim == 4 or layout == "BLHNC" else cache.shape[1]
    L = 1 if cache.ndim == 4 else (cache.shape[0] if layout == "LBHNC" else cache.shape[1])
    if not 0 <= layer < L:
        return cache
    kd, ks = quantize(key, gk)
    vd, vs = quantize(value, gv)
    for t, slot in enumerate(np.asarray(slots)):
        if slot < 0 or slot >= P * N:
            continue
        page, off = divmod(int(slot), N)
        for h in range(key.shape[1]):
            for side, (d, s) in enumerate(((kd, ks), (vd, vs))):
                view = (cache[page, 2 * h + side] if cache.ndim == 4
                        else cache[page_index(layer, page, L, P, layout)][2 * h + side])
                flat = view.reshape(-1)
                flat[off * (D // 2):(off + 1) * (D // 2)] = d[t, h]
                base = N * (D // 2) + off * (D // 16)
                flat[base:base + D // 16] = s[t, h]
    return cache


def attention(q, cache, topk, block_table, req, pos, gk, gv, scale=None, layer=0, layout="LBHNC"):
    """float64 [T, Hq, D]: SPEC §5.2/§5.5 for rows with known (request, position)."""
    q = np.asarray(q, np.float64)
    cache = np.asarray(cache)
    T, Hq, D = q.shape
    Hkv, _, K = topk.shape
    G = Hq // Hkv
    N = cache.shape[-2]
    R, M = block_table.shape
    P = cache.shape[0] if cache.ndim == 4 or layout == "BLHNC" else cache.shape[1]
    L = 1 if cache.ndim == 4 else (cache.shape[0] if layout == "LBHNC" else cache.shape[1])
    scale = D ** -0.5 if scale is None else scale
    out = np.zeros((T, Hq, D))
    for t in range(T):
        r, vis = int(req[t]), int(pos[t]) + 1
        if r < 0 or r >= R or vis <= 0 or not 0 <= layer < L:
            continue
        for g in range(Hkv):
            keys, vals = [], []
            for b in topk[g, t]:
                b = int(b)
                if not (0 <= b < M and 128 * b < vis):
                    continue
                page = int(block_table[r, b])
                if not 0 <= page < P:
                    continue
                n = min(N, vis - N * b)
                for side, acc in ((0, keys), (1, vals)):
                    tb = tile(cache, layer, page, 2 * g + side, layout)
                    data = tb[:N * D // 2].reshape(N, D // 2)[:n]
                    sc = tb[N * D // 2:].reshape(N, D // 16)[:n]
                    acc.append(dequantize(data, sc, gk if side == 0 else gv))
            if not keys:
                continue
            k, v = np.concatenate(keys), np.concatenate(vals)
            for i in range(G):
                h = g * G + i
                z = k @ q[t, h] * scale
                p = np.exp(z - z.max())
                out[t, h] = (p / p.sum()) @ v
    return out


def decode_rows(seq_lens, dql):
    """(req, pos) per decode row, SPEC §5.3."""
    req = np.repeat(np.arange(len(seq_lens)), dql)
    # int64 first: an int32 seq_len near INT32_MIN would wrap to a large position
    pos = np.asarray(seq_lens, np.int64)[req] - dql + np.tile(np.arange(dql), len(seq_lens))
    return req, pos


def positions(cu, ctx, num_tokens):
    """SPEC §4 by a direct scan over requests."""
    req = -np.ones(num_tokens, np.int64)
    pos = -np.ones(num_tokens, np.int64)
    for r in range(len(ctx)):
        for j in range(cu[r], min(cu[r + 1], num_tokens)):
            req[j], pos[j] = r, ctx[r] + j - cu[r]
    return req, pos


def metrics(out, ref):
    """(cosine, relative Frobenius error) of out against ref (SPEC §6)."""
    a = np.asarray(out, np.float64).ravel()
    b = np.asarray(ref, np.float64).ravel()
    nb = np.linalg.norm(b)
    cos = float(a @ b / (np.linalg.norm(a) * nb)) if nb else float(np.linalg.norm(a) == 0)
    return cos, float(np.linalg.norm(a - b) / nb) if nb else float(np.linalg.norm(a))


def e4m3_values(data):
    """float8_e4m3fn values in float64, decoded from their bits (not by a dtype conversion)."""
    bits = np.asarray(data).view(np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 15, bits & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    return sign * np.where((exp == 15) & (man == 7), np.nan, mag)


def mxfp8_weights(data, scales):
    """MXFP8 (SPEC §9.1) in float64: the fp8 byte's value (its bits decoded here, not by a
    dtype conversion) · 2^(e − 127), e = 255 NaN, values below 2^-126 in magnitude ±0, then
    rounded to bf16 (every normal product has 4 significant bits: exact)."""
    v = e4m3_values(data)
    sign = np.where(np.signbit(v), -1.0, 1.0)
    e = np.repeat(np.asarray(scales).astype(np.int64), 32, axis=-1)
    w = v * np.where(e == 255, np.nan, 2.0 ** (e - 127.0))
    w = np.where(np.abs(w) < 2.0 ** -126, 0.0 * sign, w)
    with np.errstate(over="ignore"):   # beyond bf16's range: inf, as the kernels round
        return np.asarray(w.astype(ml_dtypes.bfloat16), np.float64)


def fp4_weights(data, scales):
    """Packed FP4 weights (SPEC §9.3) in float64: each byte's low nibble then high nibble
    decoded from its bits (sign bit 3; exponent bits 2-1, a subnormal 0.5 · mantissa when 0;
    mantissa bit 0), times 2^(e − 127) per 32 (uint8 E8M0 scales: MXFP4; e = 255 NaN; values
    below 2^-126 ±0) or the E4M3 scale's value per 16 (NVFP4; scale bytes decoded as
    mxfp8_weights decodes fp8), then rounded to bf16."""
    b = np.asarray(data).astype(np.int64)
    codes = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    sign = np.where(codes & 8, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, codes & 1
    mag = np.where(exp == 0, 0.5 * man, (1 + 0.5 * man) * 2.0 ** (exp - 1.0))
    scales = np.asarray(scales)
    if scales.dtype == np.uint8:          # MXFP4
        e = np.repeat(scales.astype(np.int64), 32, axis=-1)
        w = sign * mag * np.where(e == 255, np.nan, 2.0 ** (e - 127.0))
        w = np.where(np.abs(w) < 2.0 ** -126, 0.0 * sign, w)
    else:                                 # NVFP4: the E4M3 scale, one per 16
        w = sign * mag * np.repeat(e4m3_values(scales), 16, axis=-1)
    with np.errstate(over="ignore"):
        return np.asarray(w.astype(ml_dtypes.bfloat16), np.float64)


def _weights(rhs, rhs_scale):
    if rhs_scale is None:
        return np.asarray(rhs, np.float64)
    return (fp4_weights if np.asarray(rhs).dtype == np.uint8 else mxfp8_weights)(rhs, rhs_scale)


def _sigmoid(x):
    return x if math.isnan(x) else 0.0 if x < -700 else 1.0 / (1.0 + math.exp(-x))


def grouped_epilogue(out, sizes, activation=None, row_scale=None, group_scale=None,
                     alpha=1.702, limit=7.0):
    """SPEC §9 item 6 on a [M, N] product in float64, written out per element: each covered
    row times its group's scale, gate column j and up column N/2 + j joined, times the row's
    scale; uncovered rows 0."""
    out = np.asarray(out, np.float64)
    M, N = out.shape
    group = np.full(M, -1)
    for g, (start, end) in enumerate(_group_rows(sizes, M)):
        group[start:end] = g
    width = N // 2 if activation else N
    res = np.zeros((M, width))
    for i in range(M):
        if group[i] < 0:
            continue
        f = 1.0 if group_scale is None else float(np.asarray(group_scale)[group[i]])
        r = 1.0 if row_scale is None else float(np.asarray(row_scale)[i])
        for j in range(width):
            gate = out[i, j] * f
            if activation is None:
                v = gate
            else:
                up = out[i, N // 2 + j] * f
                if activation == "swiglu":
                    v = gate * _sigmoid(gate) * up
                else:
                    g = gate if gate <= limit or math.isnan(gate) else limit
                    u = up if math.isnan(up) else min(max(up, -limit), limit)
                    v = (u + 1.0) * g * _sigmoid(alpha * g)
            res[i, j] = v * r
    return res


def grouped_matmul(lhs, rhs, sizes, rhs_scale=None, lhs_rows=None, lhs_scale=None):
    """grouped_matmul (SPEC §9) in float64, per group; negative sizes count 0, rows past M
    dropped, uncovered rows 0; MXFP8 rhs (with rhs_scale) and lhs (with lhs_scale, §9.2)
    decoded by mxfp8_weights, packed FP4 rhs (uint8, §9.3) by fp4_weights; ``lhs_rows``: row i is lhs row lhs_rows[i], a zero row for ids
    outside [0, T)."""
    a = np.asarray(lhs, np.float64) if lhs_scale is None else mxfp8_weights(lhs, lhs_scale)
    if lhs_rows is not None:
        ids = np.asarray(lhs_rows)
        a = np.array([a[i] if 0 <= i < len(a) else np.zeros(a.shape[1]) for i in ids]
                     ).reshape(len(ids), a.shape[1])
    w = _weights(rhs, rhs_scale)
    out = np.zeros((a.shape[0], w.shape[1]))
    for g, (start, end) in enumerate(_group_rows(sizes, a.shape[0])):
        out[start:end] = a[start:end] @ w[g].T
    return out


def _group_rows(sizes, M):
    """Each group's rows [start, end) (SPEC §9 item 1: negative sizes 0, rows past M dropped)."""
    start = 0
    for s in np.asarray(sizes):
        end = min(start + max(int(s), 0), M)
        yield start, end
        start = end


def route_experts(scores, bias, live, k, renormalize=True):
    """SPEC §10 one token and one pair at a time, in Python / NumPy float32."""
    scores = np.asarray(scores, np.float32)
    T, E = scores.shape
    weights = np.zeros((T, k), np.float32)
    experts = np.zeros((T, k), np.int32)
    for t in range(T):
        keys = [float(np.float32(scores[t, e]) + np.float32(bias[e])) for e in range(E)]
        keys = [-np.inf if np.isnan(x) else x for x in keys]
        ranked = sorted(range(E), key=lambda e: (-keys[e], e))      # -0.0 == 0.0: the id decides
        experts[t] = ranked[:k]
        w = scores[t, ranked[:k]].astype(np.float32)
        if renormalize:
            total = w[0]
            for j in range(1, k):
                total = np.float32(total + w[j])
            with np.errstate(invalid="ignore", divide="ignore"):
                w = (w / total).astype(np.float32)
        weights[t] = w
    pairs = [(int(experts[t, j]) if live[t] else E, t * k + j) for t in range(T) for j in range(k)]
    ordered = sorted(pairs)                                         # bucket, then pair index
    inverse = np.zeros(T * k, np.int32)
    for pos, (_, q) in enumerate(ordered):
        inverse[q] = pos
    sizes = np.bincount([b for b, _ in pairs if b < E], minlength=E).astype(np.int32)
    tokens = np.array([q // k for _, q in ordered], np.int32)
    sorted_w = np.array([weights.reshape(-1)[q] for _, q in ordered], np.float32)
    return weights, experts, sizes, tokens, sorted_w, inverse.reshape(T, k)


def route_scores(rng, T, E, ties=False):
    """Sigmoid-like scores in (0, 1); ``ties``: few distinct values, plus NaN, ±0, ±inf."""
    s = rng.uniform(0, 1, (T, E)).astype(np.float32)
    if ties:
        s = np.round(s * 4) / 4
        flat = s.reshape(-1)
        idx = rng.choice(flat.size, min(flat.size, 12), replace=False)
        flat[idx] = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, np.nan] * 2, np.float32)[
            :len(idx)]
    return s


def dense_matmul(lhs, rhs):
    """dense_matmul (SPEC §11) in float64 over the bf16 operands' exact values, with the bound
    an fp32 sum of K products may stray from it: ``(exact [M, N], bound [M, N])``."""
    a = np.asarray(lhs, np.float32).astype(np.float64)
    b = np.asarray(rhs, np.float32).astype(np.float64)
    K = a.shape[1]
    # 8·K·u: generous for tensor-core sums (their partial sums are not IEEE-rounded); a wrong
    # index or a lost chunk is off by O(|a||b|), far beyond it
    return a @ b.T, 8 * K * 2.0 ** -24 * (np.abs(a) @ np.abs(b).T) + 1e-30
