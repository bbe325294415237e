/* The statistics tile kernel for one element type: included by stats_tile.c with T (the type),
 * SUFFIX (the function name's) and EXP2 (a scalar exponential) defined, after the row helpers
 * row_max_SUFFIX and row_sums_SUFFIX. */
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)

#include "parallel.h"
#include "tile_impl.h"

/* Insert (value, index) into a descending list of kk entries, dropping the last (the caller has
 * checked that the value beats it); an equal value already there stays ahead. */
static inline void FN(topk_push_)(T *tv, int64_t *ti, int64_t kk, T val, int64_t idx) {
    int64_t s = kk - 1;
    while (s > 0 && val > tv[s - 1]) {
        tv[s] = tv[s - 1];
        ti[s] = ti[s - 1];
        s--;
    }
    tv[s] = val;
    ti[s] = idx;
}

/* Merge the row's entries into its running top-k (keys k0, k0 + 1, …). */
static inline void FN(row_topk_)(const T *row, int64_t w, T shift, T floor, int64_t k0, T *tv, int64_t *ti, int64_t kk) {
    /* entries must beat the k-th best so far, and be no lower than floor (see row_max_) */
    int64_t j = 0;
#ifdef VECTOR_TOPK
    /* 32 entries at a time; the lanes that may enter are gathered into one bit mask and looked
     * at one by one (few branches: most blocks hold none) */
    const v8f sh = v_set(shift), fl = v_set(floor);
    for (; j + 4 * LANES <= w; j += 4 * LANES) {
        v8f x0 = v_loadu(row + j) - sh, x1 = v_loadu(row + j + LANES) - sh;
        v8f x2 = v_loadu(row + j + 2 * LANES) - sh, x3 = v_loadu(row + j + 3 * LANES) - sh;
        v8f m = v_select(x0 > x1, x0, x1);
        m = v_select(m > x2, m, x2);
        m = v_select(m > x3, m, x3);
        const v8f kth = v_set(tv[kk - 1]);
        if (!lane_bits((m > kth) & (m >= fl))) continue;
        uint32_t bits = lane_bits((x0 > kth) & (x0 >= fl)) | lane_bits((x1 > kth) & (x1 >= fl)) << 8 |
                        lane_bits((x2 > kth) & (x2 >= fl)) << 16 | (uint32_t)lane_bits((x3 > kth) & (x3 >= fl)) << 24;
        for (; bits; bits &= bits - 1) {
            int i = __builtin_ctz(bits);
            T val = row[j + i] - shift; /* rounds as the vector lanes did */
            if (val > tv[kk - 1]) FN(topk_push_)(tv, ti, kk, val, k0 + j + i);
        }
    }
#endif
    for (; j < w; j++)
        if (row[j] - shift > tv[kk - 1] && row[j] - shift >= floor) FN(topk_push_)(tv, ti, kk, row[j] - shift, k0 + j);
}

/* One row of a tile (see stats_tile.c): row holds w scores for keys k0…; the query sits at key
 * position pos; lse2 is the row's lse·log2e or NULL; the other pointers are this row's entries. */
static inline void FN(stats_row_)(T *row, int64_t w, int64_t pos, int64_t k0, int online, int masked, const T *lse2,
                                  T *mx, T *tot, T *ent, T *dist, int64_t *cnt, T *kw, const int64_t *kpos, int64_t P,
                                  T *rw, const int64_t *rel, int64_t Q, T *tv, int64_t *ti, int64_t kk, T *acc,
                                  int64_t dv) {
    int64_t allowed, nans;
    T bound; /* no lower than the row's k-th largest entry in this tile */
    T tmax = FN(row_max_)(row, w, kk, &bound, &allowed, &nans);
    *cnt += masked ? allowed : w;
    /* given the lse, x = row − lse2 = log2 p; online, x = row − (the running maximum) */
    T given = online || !lse2 || *lse2 == -INFINITY ? 0 : *lse2;
    tmax -= given;
    T old = *mx;
    T m = (nans || old != old) ? (T)NAN : (old > tmax ? old : tmax);
    T shift = given;
    if (online) {
        shift = m == -INFINITY ? 0 : m;
        T delta = old == -INFINITY ? 0 : old - shift;
        if (delta < 0 || delta != delta) { /* the maximum grew (or became NaN): rescale the sums */
            T alpha = EXP2(delta);
            *ent = (*ent + delta * *tot) * alpha;
            *tot *= alpha;
            *dist *= alpha;
            for (int64_t i = 0; i < P; i++) kw[i] *= alpha;
            for (int64_t i = 0; i < Q; i++) rw[i] *= alpha;
            if (acc)
                for (int64_t i = 0; i < dv; i++) acc[i] *= alpha;
        }
    }
    *mx = m;
    /* the entries themselves first: the sums pass below may overwrite the row with p */
    if (kk > 0 && tmax > tv[kk - 1]) /* else no entry can enter */
        /* entries below bound − given cannot reach the top-k (rounding is monotonic) */
        FN(row_topk_)(row, w, given, bound - given, k0, tv, ti, kk);
    for (int64_t i = 0; i < P; i++) {
        int64_t j = kpos[i] - k0;
        if (j >= 0 && j < w) kw[i] = EXP2(row[j] - shift);
    }
    for (int64_t i = 0; i < Q; i++) {
        int64_t j = pos + rel[i] - k0;
        if (j >= 0 && j < w) rw[i] += EXP2(row[j] - shift);
    }
    T sp, spx, spd;
    FN(row_sums_)(row, w, shift, (T)(pos - k0), acc ? row : NULL, &sp, &spx, &spd);
    *ent += nans ? (T)NAN : spx;
    *tot += sp;
    *dist += spd;
}

void FN(qkv_stats_tile_)(T *t, int64_t R, int64_t w, int64_t n, int64_t pos0, int64_t k0, int online, int masked,
                         const T *lse2, T *mx, T *tot, T *ent, T *dist, int64_t *cnt, T *kw, const int64_t *kpos, int64_t P, T *rw,
                         const int64_t *rel, int64_t Q, T *topv, int64_t *topi, int64_t kk, T *acc, int64_t dv, int nthreads) {
    (void)nthreads; /* read by the OpenMP pragmas alone */
OMP(parallel for schedule(static) num_threads(nthreads))
    for (int64_t r = 0; r < R; r++)
        FN(stats_row_)(t + r * w, w, pos0 + r % n, k0, online, masked, lse2 ? lse2 + r : NULL, mx + r, tot + r, ent + r,
                       dist + r, cnt + r, kw + r * P, kpos, P, rw + r * Q, rel, Q, topv + r * kk, topi + r * kk, kk,
                       acc ? acc + r * dv : NULL, dv);
}

/* Statistics (and, with v, the output's running numerator) of whole attention calls in one
 * call: for each head and block of `br` query rows, the key blocks of `bc` keys that the band
 * leaves visible are scored with one gemm into a per-thread buffer that stays in cache, masked,
 * passed row by row through stats_row_, and (with v) multiplied into acc with a second gemm.
 *
 * q: (J, G, nq, d), the scores' factor s·log2e folded in; k: (J, nk, d); v: (J, nk, dv) or NULL;
 * query head (j, g) attends with key/value head j, whose matrices start at k + koff[j] and
 * v + voff[j] (koff/voff NULL: at j·nk·d and j·nk·dv). Row arrays are (J, G, nq[, ·]), contiguous,
 * initialised as for qkv_stats_tile_; query row i sits at key position i + pos_off. Key j is allowed for query i iff lo ≤ j − i ≤ hi (has_lo,
 * has_hi: the bound exists) and kpad (NULL, or (J / heads_per_pad, nk) bytes with kpad_rows = 0
 * for one row shared by all) is nonzero; klen (NULL, or per kpad row) bounds the keys visited. lse2: (J, G, nq) or NULL (online). Returns 0, or −1 when a
 * buffer could not be allocated. */
int FN(qkv_attention_stats_)(const T *q, const T *k, const T *v, const int64_t *koff, const int64_t *voff, int64_t J,
                             int64_t G, int64_t nq, int64_t nk, int64_t d, int64_t dv, int64_t pos_off, int64_t lo, int64_t hi, int has_lo, int has_hi, const uint8_t *kpad,
                             int64_t kpad_rows, int64_t heads_per_pad, const int64_t *klen, const T *lse2, T *mx, T *tot,
                             T *ent, T *dist,
                             int64_t *cnt, T *kw, const int64_t *kpos, int64_t P, T *rw, const int64_t *rel, int64_t Q,
                             T *topv, int64_t *topi, int64_t kk, T *acc, int64_t br, int64_t bc, void *gemm_fn,
                             int nthreads) {
    (void)nthreads; /* read by the OpenMP pragmas alone */
    FN(gemm_t_) gemm = (FN(gemm_t_))gemm_fn;
    const band_t bd = {lo, hi, has_lo, has_hi};
    const int online = lse2 == NULL;
    const int64_t row_blocks = (nq + br - 1) / br;
    const int64_t jobs = J * G * row_blocks;
    int failed = 0;
OMP(parallel num_threads(nthreads))
    {
        T *t = (T *)malloc(sizeof(T) * br * bc);
        if (!t) {
OMP(atomic write)
            failed = 1;
        }
OMP(for schedule(dynamic, 1))
        for (int64_t job = 0; job < jobs; job++) {
            if (!t) continue;
            const int64_t jg = job / row_blocks, q0 = (job % row_blocks) * br, j = jg / G;
            const int64_t q1 = q0 + br < nq ? q0 + br : nq, n = q1 - q0;
            const int64_t r0 = jg * nq + q0; /* first row in the (J, G, nq) row arrays */
            const T *qb = q + r0 * d, *kb = k + (koff ? koff[j] : j * nk * d);
            const T *vb = v ? v + (voff ? voff[j] : j * nk * dv) : NULL;
            const int64_t prow = kpad_rows ? j / heads_per_pad : 0;
            const uint8_t *pad = kpad ? kpad + prow * nk : NULL;
            int64_t klo, khi;
            band_keys(&bd, q0, q1, klen && klen[prow] < nk ? klen[prow] : nk, &klo, &khi);
            for (int64_t k0 = klo; k0 < khi; k0 += bc) {
                const int64_t w = khi - k0 < bc ? khi - k0 : bc;
                FN(gemm_rm_)(gemm, 0, 1, n, w, d, qb, d, kb + k0 * d, d, 0, t, w); /* s·log2e */
                const int masked = FN(mask_tile_)(t, n, w, q0, k0, &bd, pad);
                for (int64_t i = 0; i < n; i++) {
                    const int64_t r = r0 + i;
                    FN(stats_row_)(t + i * w, w, q0 + i + pos_off, k0, online, masked, lse2 ? lse2 + r : NULL, mx + r,
                                   tot + r, ent + r, dist + r, cnt + r, kw + r * P, kpos, P, rw + r * Q, rel, Q,
                                   topv + r * kk, topi + r * kk, kk, acc ? acc + r * dv : NULL, dv);
                }
                if (acc && dv > 0) /* t now holds p̃: acc += p̃ · v */
                    FN(gemm_rm_)(gemm, 0, 0, n, dv, w, t, w, vb + k0 * dv, dv, 1, acc + r0 * dv, dv);
            }
        }
        free(t);
    }
    return failed ? -1 : 0;
}

#undef FN
#undef CAT
#undef CAT2
