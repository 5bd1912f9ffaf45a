#!/usr/bin/env python3
"""Lane-by-lane emulation of `gated_mul_bwd_lora_grads` (src/tensor/cuda/kernels/mlp_grads.cu).

The kernel keeps every value in mma fragments: its loads, the adapter's term, the transposes
(`movmatrix`) into B fragments and the sums it writes are index bookkeeping that a wrong lane or
column map breaks without any crash. This script runs that bookkeeping as the kernel does, warp by
warp and lane by lane, with `mma.m16n8k16` and `movmatrix.m8n8.trans` modelled on the PTX
manual's fragment layouts (A: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..);
B: b0 (k 2q.., n g), b1 (k 2q+8.., n g); C: (g, 2q..), (g+8, 2q..)), and then the finishing
kernel. The data are small integers and the activation is act(g) = g with grad(d, g, u) = (d u,
d g), so every sum is exact and the results must equal, bit for bit, the products the kernel
replaces: d gate, d up, dA_down += dxa^T h, dB_gate += s_g (d gate)^T xa_gate, dB_up likewise.

    python3 scripts/mlp_grads_fragments.py     (needs numpy; a few seconds)

Keep it in step with the kernel: a change of the kernel's maps belongs here too.
"""
import numpy as np
rng = np.random.default_rng(0)
LANES = range(32)
def gq(l): return l >> 2
def qq(l): return l & 3

def mma(c, a, b0, b1):
    # c[lane] = [4], a[lane] = 4 pairs, b0/b1[lane] = pair. Gather A (16x16), B (16x8).
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for l in LANES:
        g, t = gq(l), qq(l)
        for i, (r, k) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
            A[r, k], A[r, k+1] = a[l][i]
        B[2*t, g], B[2*t+1, g] = b0[l]
        B[2*t+8, g], B[2*t+9, g] = b1[l]
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = c[l]
    C = A @ B + C
    for l in LANES:
        g, t = gq(l), qq(l)
        c[l] = [C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1]]

def transpose8x8(v):
    M = np.zeros((8, 8))
    for l in LANES:
        g, t = gq(l), qq(l)
        M[g, 2*t], M[g, 2*t+1] = v[l]
    out = {}
    for l in LANES:
        g, t = gq(l), qq(l)
        out[l] = (M.T[g, 2*t], M.T[g, 2*t+1])
    return out

def rank_rows_fragment(v, ld, r, row0, t_rows):
    f = {}
    for l in LANES:
        g, q = gq(l), qq(l)
        regs = []
        for i in range(4):
            row = row0 + g + (i & 1) * 8
            k = 2*q + (i >> 1) * 8
            if row < t_rows and k < r:
                regs.append((v[row*ld + k], v[row*ld + k + 1]))
            else:
                regs.append((0.0, 0.0))
        f[l] = regs
    return f

def kernel(d, dxa, ldx, rd, a, g, u, xg, ldg, rg, xu, ldu, ru, t, n, spg, groups, col_blocks):
    part = np.zeros(groups * 3 * 16 * n)
    g = g.copy(); u = u.copy()
    for by in range(groups):
        for bx in range(col_blocks):
            for warp in range(4):
                col0 = (bx * 4 + warp) * 32
                if col0 >= n: continue
                bl = {}
                for l in LANES:
                    gg, q = gq(l), qq(l)
                    per = []
                    for j in range(4):
                        c = col0 + 8 * (gg >> 1) + 2 * j + (gg & 1)
                        hs = []
                        for h in range(2):
                            k = 2*q + 8*h
                            lo = a[k*n + c] if k < rd else 0.0
                            hi = a[(k+1)*n + c] if k + 1 < rd else 0.0
                            hs.append((lo, hi))
                        per.append(hs)
                    bl[l] = per
                acc = [[{l: [0.0]*4 for l in LANES} for j in range(4)] for x in range(3)]
                steps = (t + 15) // 16
                s0 = by * spg; s1 = min(steps, s0 + spg)
                for s in range(s0, s1):
                    row0 = s * 16
                    vals = {}
                    for l in LANES:
                        gg, q = gq(l), qq(l); mycol = col0 + 8*q
                        vals[l] = []
                        for side in range(2):
                            row = row0 + gg + 8*side
                            if row < t:
                                at = row*n + mycol
                                vals[l].append((d[at:at+8].copy(), g[at:at+8].copy(), u[at:at+8].copy()))
                            else:
                                vals[l].append((np.zeros(8), np.zeros(8), np.zeros(8)))
                    fx = rank_rows_fragment(dxa, ldx, rd, row0, t)
                    fg = rank_rows_fragment(xg, ldg, rg, row0, t)
                    fu = rank_rows_fragment(xu, ldu, ru, row0, t)
                    lora = []
                    for j in range(4):
                        c = {l: [0.0]*4 for l in LANES}
                        mma(c, fx, {l: bl[l][j][0] for l in LANES}, {l: bl[l][j][1] for l in LANES})
                        lora.append(c)
                    hp = {l: [[None]*4 for _ in range(2)] for l in LANES}
                    dgp = {l: [[None]*4 for _ in range(2)] for l in LANES}
                    dup = {l: [[None]*4 for _ in range(2)] for l in LANES}
                    for l in LANES:
                        gg, q = gq(l), qq(l); mycol = col0 + 8*q
                        for side in range(2):
                            dv, gv, uv = vals[l][side]
                            outg = np.zeros(8); outu = np.zeros(8)
                            for j in range(4):
                                e = []
                                for ee in range(2):
                                    dd = dv[2*j+ee] + lora[j][l][2*side + ee]
                                    e.append((dd * uv[2*j+ee], dd * gv[2*j+ee]))
                                dgp[l][side][j] = (e[0][0], e[1][0])
                                dup[l][side][j] = (e[0][1], e[1][1])
                                hp[l][side][j] = (gv[2*j] * uv[2*j], gv[2*j+1] * uv[2*j+1])
                                outg[2*j], outg[2*j+1] = e[0][0], e[1][0]
                                outu[2*j], outu[2*j+1] = e[0][1], e[1][1]
                            row = row0 + gg + 8*side
                            if row < t:
                                at = row*n + mycol
                                g[at:at+8] = outg; u[at:at+8] = outu
                    def tr4(f):
                        T = [transpose8x8({l: f[l][i] for l in LANES}) for i in range(4)]
                        return {l: [T[0][l], T[2][l], T[1][l], T[3][l]] for l in LANES}
                    tx, tg, tu = tr4(fx), tr4(fg), tr4(fu)
                    for j in range(4):
                        for x, (tv, src) in enumerate([(tx, hp), (tg, dgp), (tu, dup)]):
                            b0 = transpose8x8({l: src[l][0][j] for l in LANES})
                            b1 = transpose8x8({l: src[l][1][j] for l in LANES})
                            mma(acc[x][j], tv, b0, b1)
                for x in range(3):
                    base = (by*3 + x) * 16 * n
                    for l in LANES:
                        gg, q = gq(l), qq(l)
                        for j in range(4):
                            c = col0 + 8*q + 2*j
                            part[base + gg*n + c], part[base + gg*n + c + 1] = acc[x][j][l][0], acc[x][j][l][1]
                            part[base + (gg+8)*n + c], part[base + (gg+8)*n + c + 1] = acc[x][j][l][2], acc[x][j][l][3]
    return g, u, part

def finish(part, groups, n, dad, rd, dbg, rg, sg, dbu, ru, su):
    for i in range(3*16*n):
        x = i // (16*n); k = (i // n) % 16; c = i % n
        r = [rd, rg, ru][x]
        if k >= r: continue
        ssum = sum(part[((grp*3 + x)*16 + k)*n + c] for grp in range(groups))
        if x == 0: dad[k*n + c] += ssum
        elif x == 1: dbg[c*rg + k] += sg*ssum
        else: dbu[c*ru + k] += su*ssum

def check(t, n, rd, rg, ru, groups_want):
    ri = lambda *s: rng.integers(-3, 4, size=s).astype(float)
    d, g, u = ri(t, n), ri(t, n), ri(t, n)
    dxa, a = ri(t, rd), ri(rd, n)
    xa = ri(t, rg + ru)
    dad0, dbg0, dbu0 = ri(rd, n), ri(n, rg), ri(n, ru)
    col_blocks = -(-n // 128); steps = -(-t // 16)
    groups = min(max(groups_want, 1), steps); spg = -(-steps // groups); groups = -(-steps // spg)
    xaf = xa.ravel()
    G, U, part = kernel(d.ravel(), dxa.ravel(), rd, rd, a.ravel(), g.ravel(), u.ravel(),
                        xaf, rg + ru, rg, xaf[rg:], rg + ru, ru, t, n, spg, groups, col_blocks)
    dad, dbg, dbu = dad0.ravel().copy(), dbg0.ravel().copy(), dbu0.ravel().copy()
    finish(part, groups, n, dad, rd, dbg, rg, 2.0, dbu, ru, 0.5)
    # reference
    dh = d + dxa @ a
    rdg, rdu = dh * u, dh * g
    h = g * u
    ok = [np.array_equal(G.reshape(t, n), rdg), np.array_equal(U.reshape(t, n), rdu),
          np.array_equal(dad.reshape(rd, n), dad0 + dxa.T @ h),
          np.array_equal(dbg.reshape(n, rg), dbg0 + 2.0 * rdg.T @ xa[:, :rg]),
          np.array_equal(dbu.reshape(n, ru), dbu0 + 0.5 * rdu.T @ xa[:, rg:])]
    print(f"t={t} n={n} r={rd}/{rg}/{ru} groups={groups}: dgate dup dA_down dB_gate dB_up", ok)
    return all(ok)

# (T, I, ranks down/gate/up, row groups asked for): rows past a 16-row step, a last column block
# past I, three different ranks, more groups than steps, one row, one warp's columns.
assert check(37, 160, 16, 16, 16, 2)
assert check(20, 96, 4, 8, 16, 3)
assert check(16, 64, 2, 14, 6, 1)
assert check(50, 416, 8, 16, 2, 9)
assert check(1, 32, 16, 16, 16, 1)
print("all exact")
