/* Exact attention forward (with the row shift m and sum l its backward needs) and backward, for
 * one element type: included by flash.c with T, SUFFIX and EXP2 defined, after the row helpers
 * row_max_SUFFIX, row_exp_SUFFIX, row_ds_SUFFIX, row_score_SUFFIX, row_dscore_SUFFIX and their
 * one-pass pairs row_score_max_SUFFIX, row_score_exp_SUFFIX and row_ds_dscore_SUFFIX. */
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)

#include "parallel.h"
#include "tile_impl.h"

/* p[0 .. n) = 0; nothing, not even a look at p, when n is 0 (an empty tensor's pointer may be NULL). */
static inline void FN(zero_)(T *p, int64_t n) {
    if (n > 0) memset(p, 0, sizeof(T) * (size_t)n);
}

/* The per-thread tile buffers of a kernel; NULL (and *failed set) when memory ran out. */
static inline T *FN(buffers_)(int64_t count, int *failed) {
    T *t = (T *)malloc(sizeof(T) * (count > 0 ? count : 1));
    if (!t) {
OMP(atomic write)
        *failed = 1;
    }
    return t;
}

/* Row i of a tile (query row q0 + i, keys [k0, k0 + w)) as the masks and a score function leave
 * it, in place: with a built-in score function (scored; qkv.score_mods.base.KernelForm) first
 * s = scale·q·kᵀ, then cap·tanh(s/cap) when cap > 0 (deriv: NULL or the row's 1 − tanh²), then
 * s + relh[k − (q0 + i) + nq − 1] when relh (the query head's row of rel) is not NULL, whose index
 * lies in [0, nq + nk − 1); then the masks of tile_masks_ (`masks`). Row by row, so that the row
 * is still in cache for what follows. */
static inline void FN(prepare_row_)(T *row, T *deriv, int64_t i, int64_t w, int64_t q0, int64_t k0, int64_t nq,
                                    int scored, T scale, T cap, const T *relh, const band_t *bd, const uint8_t *pad,
                                    int masks) {
    if (scored) FN(row_score_)(row, deriv, relh ? relh + (k0 - q0 - i + nq - 1) : NULL, w, scale, cap);
    if (masks) FN(mask_row_)(row, w, q0 + i, k0, bd, pad, masks);
}

/* Forward. q: (J, G, nq, d); k: (J, nk, d); v: (J, nk, dv): query head (j, g) attends with
 * key/value head j, whose matrices start at k + koff[j] and v + voff[j] (koff/voff NULL: at
 * j·nk·d and j·nk·dv; shared heads may share one matrix); scores are q·kᵀ, and
 * c = scale·log2 e turns their differences into log2 units. Masks as in qkv_attention_stats_ (band, kpad with kpad_rows / heads_per_pad; klen: NULL
 * or, per kpad row, how many leading keys can be real). Writes out (J, G, nq, dv): the output;
 * m (J, G, nq): each row's shift, the largest score q·kᵀ it saw (−inf when none; NaN when a score
 * was NaN); l (J, G, nq): Σ 2^((s − m)·c) (0 when none). Returns 0, or −1 when out of memory.
 * With a score function (scored ≠ 0) the scores are those of prepare_row_ (scale, cap, and
 * rel: NULL or (hq, nq + nk − 1), row h = jg mod hq for query head jg = j·G + g), so m is in
 * natural units and c is log2 e. */
int FN(qkv_flash_fwd_)(const T *q, const T *k, const T *v, const int64_t *koff, const int64_t *voff, int64_t J,
                       int64_t G, int64_t nq, int64_t nk, int64_t d, int64_t dv, int64_t lo, int64_t hi, int has_lo, int has_hi, const uint8_t *kpad, int64_t kpad_rows,
                       int64_t heads_per_pad, const int64_t *klen, T c, int scored, T scale, T cap, const T *rel, int64_t hq,
                       T *out, T *m, T *l, int64_t br, int64_t bc, void *gemm_fn, int nthreads) {
    (void)nthreads; /* read by the OpenMP pragmas alone */
    FN(gemm_t_) gemm = (FN(gemm_t_))gemm_fn;
    const band_t bd = {lo, hi, has_lo, has_hi};
    const int64_t row_blocks = (nq + br - 1) / br, jobs = J * G * row_blocks;
    int failed = 0;
OMP(parallel num_threads(nthreads))
    {
        T *t = FN(buffers_)(br * bc, &failed);
OMP(for schedule(dynamic, 1))
        for (int64_t job = 0; job < jobs; job++) {
            if (!t) continue;
            const int64_t jg = job / row_blocks, q0 = (job % row_blocks) * br, j = jg / G;
            const int64_t q1 = q0 + br < nq ? q0 + br : nq, n = q1 - q0, r0 = jg * nq + q0;
            const int64_t prow = kpad_rows ? j / heads_per_pad : 0;
            const uint8_t *pad = kpad ? kpad + prow * nk : NULL;
            const T *qb = q + r0 * d, *kb = k + (koff ? koff[j] : j * nk * d), *vb = v + (voff ? voff[j] : j * nk * dv);
            const T *relh = rel ? rel + (jg % hq) * (nq + nk - 1) : NULL;
            T *acc = out + r0 * dv;
            for (int64_t i = 0; i < n; i++) {
                m[r0 + i] = -INFINITY;
                l[r0 + i] = 0;
            }
            for (int64_t i = 0; i < n * dv; i++) acc[i] = 0;
            int64_t klo, khi;
            band_keys(&bd, q0, q1, klen && klen[prow] < nk ? klen[prow] : nk, &klo, &khi);
            for (int64_t k0 = klo; k0 < khi; k0 += bc) {
                const int64_t w = khi - k0 < bc ? khi - k0 : bc;
                FN(gemm_rm_)(gemm, 0, 1, n, w, d, qb, d, kb + k0 * d, d, 0, t, w);
                const int masks = FN(tile_masks_)(n, w, q0, k0, &bd, pad);
                for (int64_t i = 0; i < n; i++) {
                    T *row = t + i * w, *ai = acc + i * dv;
                    const int64_t r = r0 + i;
                    int64_t nans;
                    T tmax;
                    if (scored && !masks) { /* one pass: the score function and the maximum */
                        tmax = FN(row_score_max_)(row, relh ? relh + (k0 - q0 - i + nq - 1) : NULL, w, scale, cap, &nans);
                    } else {
                        FN(prepare_row_)(row, NULL, i, w, q0, k0, nq, scored, scale, cap, relh, &bd, pad, masks);
                        tmax = FN(row_max_)(row, w, &nans);
                    }
                    const T old = m[r];
                    const T mn = (nans || old != old) ? (T)NAN : (old > tmax ? old : tmax);
                    const T shift = mn == -INFINITY ? 0 : mn;
                    if (old != mn) { /* the maximum grew: rescale the running sums (by 0 if none yet) */
                        const T alpha = old == -INFINITY ? 0 : EXP2((old - shift) * c);
                        l[r] *= alpha;
                        for (int64_t e = 0; e < dv; e++) ai[e] *= alpha;
                    }
                    m[r] = mn;
                    l[r] += FN(row_exp_)(row, w, shift, c);
                }
                FN(gemm_rm_)(gemm, 0, 0, n, dv, w, t, w, vb + k0 * dv, dv, 1, acc, dv);
            }
            for (int64_t i = 0; i < n; i++) {
                const T li = l[r0 + i], inv = li > 0 ? 1 / li : 0;
                for (int64_t e = 0; e < dv; e++) acc[i * dv + e] = li > 0 ? acc[i * dv + e] * inv : (li == 0 ? 0 : acc[i * dv + e]);
            }
        }
        free(t);
    }
    return failed ? -1 : 0;
}

/* Backward by tile recomputation, from the forward's m (its shift: q·kᵀ − m is exact at the
 * maximum, as the same gemm recomputes the same products) and, per row (J, G, nq):
 * dos = dO / l (·, dv), delta = (rowsum(dO ∘ O) − dlse) / l, dlse = dlse / l, half_l = l / 2
 * (inf for an empty row). out is the forward's output. With P̃ = 2^((s − m)·c):
 *     dV += P̃ᵀ·dos,   dS = P̃ ∘ (dos·Vᵀ − delta),   dQ += scale·dS·K,   dK += scale·dSᵀ·Q.
 * K and V as in the forward (koff, voff). Where P̃ > l/2 (one key holds most of the row) dS is
 * P̃·(dos·(v_j − O_i) + dlse): the subtraction dos·vⱼ − delta cancels there. Each query head
 * writes its own dk, dv slices (J, G, nk, ·): the caller sums them over G. One job per query
 * head, so no two threads write the same rows; each job zeroes its own rows of dq, dk, dv
 * first (they need no initial value) and multiplies dQ and dK by `scale` in their gemms.
 * With a score function (scored, cap, rel, hq as in the forward) dS above is the gradient
 * of the modified score: it is added into drel (NULL, or (J·G, nq + nk − 1): the gradient of rel
 * per query head of each batch entry, summed by the caller) and multiplied by the cap's
 * derivative 1 − tanh² before the dQ and dK gemms. Returns 0, or −1 when out of memory. */
int FN(qkv_flash_bwd_)(const T *q, const T *k, const T *v, const int64_t *koff, const int64_t *voff, const T *out,
                       const T *dos, const T *delta, const T *dlse, const T *half_l, const T *m, int64_t J, int64_t G, int64_t nq, int64_t nk, int64_t d, int64_t dv,
                       int64_t lo, int64_t hi, int has_lo, int has_hi, const uint8_t *kpad, int64_t kpad_rows,
                       int64_t heads_per_pad, const int64_t *klen, T c, int scored, T cap, const T *rel, int64_t hq,
                       T *drel, T scale, T *dq, T *dk, T *dvv, int64_t br, int64_t bc, void *gemm_fn,
                       int nthreads) {
    (void)nthreads; /* read by the OpenMP pragmas alone */
    FN(gemm_t_) gemm = (FN(gemm_t_))gemm_fn;
    const band_t bd = {lo, hi, has_lo, has_hi};
    const int64_t jobs = J * G, width = nq + nk - 1;
    const int capped = scored && cap > 0, post = capped || (scored && drel);
    int failed = 0;
OMP(parallel num_threads(nthreads))
    {
        /* P̃, dS, a row's cap derivative (capped), one tile's rel gradient by diagonal (drel) */
        T *t = FN(buffers_)(2 * br * bc + (capped ? bc : 0) + (drel ? br + bc - 1 : 0), &failed);
OMP(for schedule(dynamic, 1))
        for (int64_t jg = 0; jg < jobs; jg++) {
            if (!t) continue;
            T *u = t + br * bc, *dcap = capped ? u + br * bc : NULL, *diag = drel ? u + br * bc + (capped ? bc : 0) : NULL;
            const int64_t j = jg / G, prow = kpad_rows ? j / heads_per_pad : 0;
            const uint8_t *pad = kpad ? kpad + prow * nk : NULL;
            const T *kb = k + (koff ? koff[j] : j * nk * d), *vb = v + (voff ? voff[j] : j * nk * dv);
            const T *relh = rel ? rel + (jg % hq) * width : NULL;
            T *dkb = dk + jg * nk * d, *dvb = dvv + jg * nk * dv, *drelb = drel ? drel + jg * width : NULL;
            FN(zero_)(dq + jg * nq * d, nq * d);
            FN(zero_)(dkb, nk * d);
            FN(zero_)(dvb, nk * dv);
            if (drelb) FN(zero_)(drelb, width);
            for (int64_t q0 = 0; q0 < nq; q0 += br) {
                const int64_t q1 = q0 + br < nq ? q0 + br : nq, n = q1 - q0, r0 = jg * nq + q0;
                const T *qb = q + r0 * d, *dob = dos + r0 * dv;
                int64_t klo, khi;
                band_keys(&bd, q0, q1, klen && klen[prow] < nk ? klen[prow] : nk, &klo, &khi);
                for (int64_t k0 = klo; k0 < khi; k0 += bc) {
                    const int64_t w = khi - k0 < bc ? khi - k0 : bc;
                    FN(gemm_rm_)(gemm, 0, 1, n, w, d, qb, d, kb + k0 * d, d, 0, t, w); /* S */
                    const int masks = FN(tile_masks_)(n, w, q0, k0, &bd, pad);
                    if (diag) FN(zero_)(diag, n + w - 1);
                    FN(gemm_rm_)(gemm, 0, 1, n, w, dv, dob, dv, vb + k0 * dv, dv, 0, u, w); /* dos·Vᵀ */
                    for (int64_t i = 0; i < n; i++) {
                        const int64_t r = r0 + i;
                        T *p = t + i * w, *ds = u + i * w;
                        const T shift = m[r] == -INFINITY ? 0 : m[r];
                        if (scored && !masks) { /* P̃, one pass */
                            FN(row_score_exp_)(p, dcap, relh ? relh + (k0 - q0 - i + nq - 1) : NULL, w, scale, cap, shift, c);
                        } else {
                            FN(prepare_row_)(p, dcap, i, w, q0, k0, nq, scored, scale, cap, relh, &bd, pad, masks);
                            FN(row_exp_)(p, w, shift, c); /* P̃ */
                        }
                        T *acc = diag ? diag + (n - 1 - i) : NULL; /* row i's key x is diagonal x − i + n − 1 of the tile */
                        if (half_l[r] >= 1) { /* P̃ ≤ 1, so only rows with l < 2 can hold P̃ > l/2 */
                            if (post) FN(row_ds_dscore_)(ds, p, dcap, acc, w, delta[r]);
                            else FN(row_ds_)(ds, p, w, delta[r]);
                            continue;
                        }
                        FN(row_ds_)(ds, p, w, delta[r]);
                        for (int64_t x = 0; x < w; x++)
                            if (p[x] > half_l[r]) {
                                const T *vj = vb + (k0 + x) * dv, *oi = out + r * dv, *gi = dos + r * dv;
                                T s = 0;
                                for (int64_t e = 0; e < dv; e++) s += gi[e] * (vj[e] - oi[e]);
                                ds[x] = p[x] * (s + dlse[r]);
                            }
                        if (post) FN(row_dscore_)(ds, dcap, acc, w);
                    }
                    if (diag) /* the tile's diagonal 0 is rel index k0 − (q1 − 1) + nq − 1 */
                        for (int64_t x = 0; x < n + w - 1; x++) drelb[k0 - q1 + nq + x] += diag[x];
                    FN(gemm_rm_)(gemm, 1, 0, w, dv, n, t, w, dob, dv, 1, dvb + k0 * dv, dv); /* dV += P̃ᵀ·dos */
                    FN(gemm_rm_alpha_)(gemm, 0, 0, n, d, w, scale, u, w, kb + k0 * d, d, 1, dq + r0 * d, d); /* dQ */
                    FN(gemm_rm_alpha_)(gemm, 1, 0, w, d, n, scale, u, w, qb, d, 1, dkb + k0 * d, d);       /* dK */
                }
            }
        }
        free(t);
    }
    return failed ? -1 : 0;
}

#undef FN
#undef CAT
#undef CAT2
