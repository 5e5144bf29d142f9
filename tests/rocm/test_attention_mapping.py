"""The thread/tile mapping of the gfx950 attention kernels, replayed on the CPU (no GPU here).

attention_core.attend() is a fixed schedule of byte offsets, MFMA operand layouts, LDS staging and
a 4-wave merge. This test replays that schedule step by step in numpy (float64, so only the
mapping is under test, not the rounding), with the documented MFMA 16x16x32 operand layout:
A[m][k] held by lane m + 16·(k // 8) in element k % 8, B[k][n] by lane n + 16·(k // 8) in element
k % 8, C[m][n] by lane n + 16·(m // 4) in element m % 4. Every offset and loop below is transcribed
from attention_core.py; the result must equal a dense softmax computed from SPEC §5 directly.
The split decode (4 partial workgroups + a merge kernel) is replayed the same way.
A mistake in the schedule (a wrong key/row/column mapping, P ordered differently from V^T, a wrong
merge index) makes this test fail; the hardware semantics themselves are checked on a gfx950 by
test_device.py.
"""

from __future__ import annotations

import numpy as np

N, D, G, K = 128, 128, 16, 16
TILE, SCALE_PLANE = 9216, 8192
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
LANE = np.arange(64)
LANE16, QUAD = LANE % 16, LANE // 16


def _e4m3_values(b):
    exp, man = (b >> 3) & 15, b & 7
    v = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    v = np.where((exp == 15) & (man == 7), np.nan, v)
    return np.where(b & 0x80, -v, v)


E4M3 = _e4m3_values(np.arange(256))
E2M1_PAIRS = np.stack([E2M1[np.arange(256) & 15], E2M1[np.arange(256) >> 4]], axis=1)  # [byte] -> (lo, hi)


def e4m3(b):
    return E4M3[np.asarray(b, np.int64)]


_M, _K = np.meshgrid(np.arange(16), np.arange(32), indexing="ij")        # A[m][k]
A_LANE, A_ELEM = _M + 16 * (_K // 8), _K % 8
_KB, _NB = np.meshgrid(np.arange(32), np.arange(16), indexing="ij")      # B[k][n]
B_LANE, B_ELEM = _NB + 16 * (_KB // 8), _KB % 8
C_ROW = 4 * (LANE[:, None] // 16) + np.arange(4)[None, :]                # C[m][n] -> [lane][e]
C_COL = np.broadcast_to(LANE[:, None] % 16, (64, 4))


def mfma(a, b, c):
    """a, b: [64, 8] lane operands, c: [64, 4]; returns the new [64, 4] accumulator."""
    A = a[A_LANE, A_ELEM]
    B = b[B_LANE, B_ELEM]
    return c + (A @ B)[C_ROW, C_COL]


def dequant_dword(word_bytes, scale):
    """4 data bytes -> 8 values (element 2j low nibble of byte j) times the block scale."""
    return E2M1_PAIRS[np.asarray(word_bytes, np.int64)].reshape(-1) * scale


def lse_combine(ms, ls, os_):
    """attention_core.lse_combine: ms, ls [parts], os_ [parts, 8]."""
    m_all = np.max(ms)
    w = np.array([0.0 if m == -np.inf else np.exp2(m - m_all) for m in ms])
    return m_all, np.sum(ls * w), np.sum(os_ * w[:, None], axis=0)


def finish(o, l_all, v_scale):
    return o * (v_scale / l_all) if l_all != 0 else np.zeros_like(o)


def attend_replay(cache, q, topk, table, token, kv_head, req, vis, row_ok, layer, L, P, page_stride, layer_stride,
                  scale, k_scale, v_scale, split=None):
    """attention_core.attend; with `split` (0..3) the split-decode variant: one slot per wave,
    slots split·4 + wave, returning the partial (m[16], l[16], O[16, 128])."""
    slots_per_wave = 4 if split is None else 1
    M = table.shape[1]
    flat_table = table.reshape(-1)
    layer_ok = 0 <= layer < L

    def read(base, nbytes, off, n):
        return cache[base + off: base + off + n] if off + n <= nbytes else np.zeros(n, np.uint8)

    q_ops = [np.stack([q[token, kv_head * G + LANE16[l], 32 * QUAD[l] + 8 * c: 32 * QUAD[l] + 8 * c + 8]
                       for l in range(64)]) for c in range(4)]
    qk_scale = scale * k_scale * np.log2(np.e)
    merge_o = np.zeros((4, G, D)); merge_ml = np.zeros((4, G, 2))
    for wave in range(4):
        m_run = np.full(64, -np.inf); l_run = np.zeros(64); o_acc = [np.zeros((64, 4)) for _ in range(8)]
        for j in range(slots_per_wave):
            k_slot = wave * slots_per_wave + j + (0 if split is None else split * 4 * slots_per_wave)
            b = int(topk[kv_head, token, k_slot])
            b_ok = row_ok and layer_ok and 0 <= b < M and b * N < vis
            idx = req * M + b if b_ok else 0
            page = int(flat_table[idx]) if idx < flat_table.size else 0
            valid = b_ok and 0 <= page < P
            page_base = (layer if layer_ok else 0) * layer_stride + (page if valid else 0) * page_stride
            nbytes = TILE if valid else 0
            k_base, v_base = page_base + 2 * kv_head * TILE, page_base + (2 * kv_head + 1) * TILE
            limit = vis - b * N if valid else 0
            scores, m_blk = [], np.full(64, -np.inf)
            for jt in range(8):
                acc = np.zeros((64, 4))
                data = [read(k_base, nbytes, (16 * jt + LANE16[l]) * 64 + 16 * QUAD[l], 16) for l in range(64)]
                sc = [e4m3(read(k_base, nbytes, SCALE_PLANE + (16 * jt + LANE16[l]) * 8 + 2 * QUAD[l], 2))
                      for l in range(64)]
                for c in range(4):
                    k_op = np.stack([dequant_dword(data[l][4 * c:4 * c + 4], sc[l][c // 2]) for l in range(64)])
                    acc = mfma(k_op, q_ops[c], acc)
                z = np.empty((64, 4))
                for i in range(4):
                    attended = (16 * jt + 4 * QUAD + i) < limit
                    z[:, i] = np.where(attended, acc[:, i] * qk_scale, -np.inf)
                    m_blk = np.fmax(m_blk, z[:, i])
                scores.append(z)
            m_blk = np.array([np.max(m_blk[LANE16 == LANE16[l]]) for l in range(64)])   # xor 16, 32
            m_new = np.fmax(m_run, m_blk)
            m_safe = np.where(m_new == -np.inf, 0.0, m_new)
            alpha = np.exp2(m_run - m_safe)
            p_ops, l_blk = [], np.zeros(64)
            for st in range(4):
                vals = []
                for half_tile in range(2):
                    for i in range(4):
                        p = np.exp2(scores[2 * st + half_tile][:, i] - m_safe)
                        l_blk += p
                        vals.append(p)
                p_ops.append(np.stack(vals, axis=1))
            l_run = l_run * alpha + l_blk
            m_run = m_new
            o_acc = [o * alpha[:, None] for o in o_acc]
            for hb in range(2):
                vt = np.full((128, 64), np.nan)          # Vt[d][token of the half]; unwritten = NaN
                for l in range(64):
                    for u in range(4):
                        tok = 64 * hb + 4 * LANE16[l] + u
                        attended = tok < limit
                        data = read(v_base, nbytes, tok * 64 + 16 * QUAD[l], 16)
                        sw = read(v_base, nbytes, SCALE_PLANE + tok * 8 + 2 * QUAD[l], 2)
                        if not attended:
                            data, sw = np.zeros(16, np.uint8), np.zeros(2, np.uint8)
                        sc = e4m3(sw)
                        for c in range(4):
                            d = 32 * QUAD[l] + 8 * c                 # d = 32·quad + 8·c + i, i = 0..7
                            vt[d:d + 8, 4 * LANE16[l] + u] = dequant_dword(data[4 * c:4 * c + 4], sc[c // 2])
                for s in range(2):
                    for dt in range(8):
                        v_op = np.stack([np.concatenate([
                            vt[16 * dt + LANE16[l], 32 * s + 4 * QUAD[l]: 32 * s + 4 * QUAD[l] + 4],
                            vt[16 * dt + LANE16[l], 32 * s + 16 + 4 * QUAD[l]: 32 * s + 16 + 4 * QUAD[l] + 4]])
                            for l in range(64)])
                        o_acc[dt] = mfma(v_op, p_ops[2 * hb + s], o_acc[dt])
        l_run = np.array([np.sum(l_run[LANE16 == LANE16[l]]) for l in range(64)])   # xor 16, 32
        for dt in range(8):
            for l in range(64):
                merge_o[wave, LANE16[l], 16 * dt + 4 * QUAD[l]: 16 * dt + 4 * QUAD[l] + 4] = o_acc[dt][l]
        for l in range(64):
            merge_ml[wave, LANE16[l]] = (m_run[l], l_run[l])
    out = np.zeros((G, D))
    part_m, part_l = np.zeros(G), np.zeros(G)
    for wave in range(4):
        for l in range(64):
            head, d0 = wave * 4 + QUAD[l], LANE16[l] * 8
            m_all, l_all, o = lse_combine(merge_ml[:, head, 0], merge_ml[:, head, 1], merge_o[:, head, d0:d0 + 8])
            if split is None:
                out[head, d0:d0 + 8] = finish(o, l_all, v_scale)
            else:
                out[head, d0:d0 + 8] = o
                part_m[head], part_l[head] = m_all, l_all
    return out if split is None else (part_m, part_l, out)


def split_decode_replay(**args):
    """sparse_decode.compile_sparse_decode_split: 4 partial workgroups, then the merge kernel."""
    parts = [attend_replay(**args, split=s) for s in range(4)]
    out = np.zeros((G, D))
    for tid in range(256):
        head, d0 = tid // 16, (tid % 16) * 8
        _, l_all, o = lse_combine(np.array([p[0][head] for p in parts]), np.array([p[1][head] for p in parts]),
                                  np.stack([p[2][head, d0:d0 + 8] for p in parts]))
        out[head, d0:d0 + 8] = finish(o, l_all, args["v_scale"])
    return out


def dense_oracle(cache, q, topk, table, token, kv_head, req, vis, row_ok, layer, L, P, page_stride, layer_stride,
                 scale, k_scale, v_scale):
    """SPEC §5.2/§5.5 directly: gather the attended keys, dequantize, softmax in float64."""
    M = table.shape[1]
    keys, vals = [], []
    if row_ok and 0 <= layer < L:
        for k in range(K):
            b = int(topk[kv_head, token, k])
            if not (0 <= b < M and b * N < vis):
                continue
            page = int(table[req, b])
            if not 0 <= page < P:
                continue
            base = layer * layer_stride + page * page_stride
            for o in range(N):
                if b * N + o >= vis:
                    break
                for slot, dst in ((2 * kv_head, keys), (2 * kv_head + 1, vals)):
                    t = base + slot * TILE
                    data = cache[t + o * 64: t + o * 64 + 64]
                    sc = e4m3(cache[t + SCALE_PLANE + o * 8: t + SCALE_PLANE + o * 8 + 8])
                    codes = np.stack([data & 15, data >> 4], axis=1).reshape(-1)
                    dst.append(E2M1[codes] * np.repeat(sc, 16))
    if not keys:
        return np.zeros((G, D))
    kk = np.stack(keys) * k_scale
    vv = np.stack(vals) * v_scale
    z = q[token, kv_head * G:(kv_head + 1) * G] @ kk.T * scale
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ vv


def make_problem(rng, layout):
    Hkv, P, L, R, M = 2, 7, 2, 3, 9
    layer = 1
    page_bytes = 2 * Hkv * TILE
    page_stride, layer_stride = (page_bytes, P * page_bytes) if layout == "LBHNC" else (L * page_bytes, page_bytes)
    cache = np.empty(L * P * page_bytes, np.uint8)
    cache[:] = rng.integers(0, 256, cache.size)
    # sane scales everywhere (no NaN bytes); pages 5 and 6 hold the requests' last blocks and get
    # NaN scales from token 100 on, past every row's visible end (SPEC §5.2: must not leak)
    for p in range(P):
        for lay in range(L):
            for slot in range(2 * Hkv):
                t = lay * layer_stride + p * page_stride + slot * TILE
                cache[t + SCALE_PLANE: t + TILE] = rng.integers(0x30, 0x48, N * 8)
                if p >= 5:
                    cache[t + SCALE_PLANE + 100 * 8: t + TILE] = 0x7F
    table = rng.integers(0, 5, (R, M)).astype(np.int32)
    table[0, 2], table[1, 0], table[2, 7] = 5, 5, 6          # last visible blocks (see the cases)
    table[2, 3], table[2, 4] = -1, P + 3                     # invalid pages of visible blocks
    q = rng.standard_normal((4, Hkv * G, D))
    topk = np.full((Hkv, 4, K), -1, np.int32)
    for g in range(Hkv):
        for t in range(4):
            topk[g, t] = rng.permutation(np.r_[np.arange(M), [-1, -5, M, 10**6] * 2])[:K]
    return dict(cache=cache, q=q, topk=topk, table=table, layer=layer, L=L, P=P, page_stride=page_stride,
                layer_stride=layer_stride, scale=D ** -0.5, k_scale=0.7, v_scale=1.3)


def test_attend_schedule_matches_dense_softmax():
    rng = np.random.default_rng(0)
    for layout in ("LBHNC", "BLHNC"):
        prob = make_problem(rng, layout)
        # (token, request, vis, row_ok): tails at 100 tokens keep the poisoned rows unattended
        cases = [(0, 0, 2 * N + 100, True), (1, 2, 7 * N + 37, True), (2, 1, 100, True), (3, 0, 0, True),
                 (3, 1, 5 * N, False)]
        for token, req, vis, ok in cases:
            for kv_head in range(2):
                args = dict(prob, token=token, kv_head=kv_head, req=req, vis=vis, row_ok=ok)
                want = dense_oracle(**args)
                for got in (attend_replay(**args), split_decode_replay(**args)):
                    assert not np.isnan(got).any(), (layout, token, kv_head)
                    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"{layout} {token} {kv_head}")
                    if vis <= 0 or not ok:
                        assert np.all(got == 0)
