/* One fused pass over a tile of attention scores for qkv.inspect.attention_stats.
 *
 * The torch formulation of a statistics tile makes about ten passes over the tile (shift,
 * exp2, p·x, p·|i − j|, sums, comparisons for the top-k); here each row is read twice (its
 * maximum, then everything else) while it is still in cache. Built and loaded by
 * qkv/backends/native.py (compiled on first use with the machine's C compiler; qkv falls back
 * to the torch formulation when there is none).
 *
 * Layout: the tile is R rows × w keys, row-major and contiguous, in log2 units. Row r belongs
 * to head group r / n and query row i = r % n, which sits at key position pos0 + i. Per-row
 * arrays (mx, tot, ent, dist, cnt) have R entries; kw is R × P, rw is R × Q, the running
 * top-k is R × kk (values descending, indices), all contiguous.
 *
 * Semantics (the torch formulation in qkv/inspect/stats.py is the reference). The tile holds
 * s·log2e (s: the scaled, masked score).
 *   online: mx is the running row maximum and every sum holds 2^(x − mx); when the maximum
 *     grows by δ the sums are rescaled by 2^−δ and the entropy sum Σ p̃ (x − mx) gains −δ·tot
 *     first. The top-k holds s·log2e.
 *   given the lse (lse2 = lse·log2e per row; without lse2 the tile already holds log2 p):
 *     x = s·log2e − lse2 = log2 p; mx is the running maximum of log2 p, the top-k holds log2 p,
 *     nothing rescales.
 *   ent += Σ p·x (x = −inf contributes 0), tot += Σ p, dist += Σ p·|pos − j|,
 *   kw[p] = the weight of key kpos[p] (assigned where that key is in the tile),
 *   rw[q] += the weight of key pos + rel[q], cnt += the keys not at −inf (masked tiles),
 *   top-k: entries strictly above the row's k-th best enter (earlier keys win ties).
 *   acc (optional, online only: the attention output's running numerator, R × dv): rescaled with
 *     the sums, and the tile's weights p = 2^(x − mx) are left in t for the caller's P·V.
 *   A NaN anywhere in a row makes its maximum and sums NaN (as torch.maximum propagates it).
 *
 * float32 rows run 8 lanes at a time in GCC/clang vector extensions (lowered to the machine's
 * SIMD: AVX2 here, NEON on ARM); float64, used for checking, runs scalar with libm's exp2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

static inline double exp2_f64(double x) { return exp2(x); }

/* The row's maximum (NaN ignored), how many entries are not −inf, and how many are NaN; and
 * in *bound a value no larger than the row's kk-th largest entry: the lanes' maxima are 8
 * entries of the row, so their kk-th largest is (−inf when kk > 8). On a row block's first
 * tile, where every entry would beat an empty top-k, this bound skips most of them. */
static inline float row_max_float(const float *row, int64_t w, int64_t kk, float *bound, int64_t *allowed, int64_t *nans) {
    v8f mx = v_set(-INFINITY);
    v8i a = {0}, nn = {0};
    for (int64_t j = 0; j < w; j += LANES) {
        v8f x = v_load(row, j, w);
        mx = v_select(x > mx, x, mx);
        a -= x != v_set(-INFINITY);
        nn -= x != x;
    }
    float m = mx[0];
    int64_t ca = 0, cn = 0;
    for (int i = 0; i < LANES; i++) {
        m = mx[i] > m ? mx[i] : m;
        ca += a[i];
        cn += nn[i];
    }
    *bound = -INFINITY;
    if (kk > 0 && kk <= LANES) {
        float top[LANES];
        for (int i = 0; i < LANES; i++) { /* insertion sort, descending */
            int s = i;
            for (; s > 0 && top[s - 1] < mx[i]; s--) top[s] = top[s - 1];
            top[s] = mx[i];
        }
        *bound = top[kk - 1];
    }
    *allowed = ca;
    *nans = cn;
    return m;
}

/* Σ p, Σ p·x and Σ p·|rel0 − j| over the row, for p = 2^x, x = row[j] − shift; p is stored
 * into out (which may be the row itself) unless out is NULL. */
static inline void row_sums_float(const float *row, int64_t w, float shift, float rel0, float *out, float *sp, float *spx,
                                  float *spd) {
    const v8f lane = {0, 1, 2, 3, 4, 5, 6, 7};
    v8f s0 = v_set(0.0f), s1 = v_set(0.0f), s2 = v_set(0.0f);
    for (int64_t j = 0; j < w; j += LANES) {
        v8f x = v_load(row, j, w) - v_set(shift);
        v8f p = v_exp2(x);
        if (out) {
            if (j + LANES <= w)
                v_storeu(out + j, p);
            else
                for (int64_t i = 0; j + i < w; i++) out[j + i] = p[i];
        }
        v8f d = v_set(rel0 - (float)j) - lane;
        s0 += p;
        s1 += v_select(p > v_set(0.0f), p * x, v_set(0.0f));
        s2 += p * v_select(d < v_set(0.0f), -d, d);
    }
    *sp = hsum(s0);
    *spx = hsum(s1);
    *spd = hsum(s2);
}

static inline double row_max_double(const double *row, int64_t w, int64_t kk, double *bound, int64_t *allowed, int64_t *nans) {
    double m = -INFINITY;
    (void)kk;
    *bound = -INFINITY;
    int64_t a = 0, nn = 0;
    for (int64_t j = 0; j < w; j++) {
        double x = row[j];
        m = x > m ? x : m;
        a += x != -INFINITY;
        nn += x != x;
    }
    *allowed = a;
    *nans = nn;
    return m;
}

static inline void row_sums_double(const double *row, int64_t w, double shift, double rel0, double *out, double *sp,
                                   double *spx, double *spd) {
    double s0 = 0, s1 = 0, s2 = 0;
    for (int64_t j = 0; j < w; j++) {
        double x = row[j] - shift;
        double p = exp2(x);
        if (out) out[j] = p;
        double d = rel0 - (double)j;
        s0 += p;
        s1 += p > 0 ? p * x : 0.0;
        s2 += p * fabs(d);
    }
    *sp = s0;
    *spx = s1;
    *spd = s2;
}

#define T float
#define SUFFIX float
#define EXP2 exp2_f32
#define VECTOR_TOPK
#include "stats_tile_impl.h"
#undef VECTOR_TOPK
#undef T
#undef SUFFIX
#undef EXP2

#define T double
#define SUFFIX double
#define EXP2 exp2_f64
#include "stats_tile_impl.h"
#undef T
#undef SUFFIX
#undef EXP2

/* y = 2^x elementwise with the kernels' float32 exponential (for qkv's tests). */
void qkv_exp2_float(const float *x, float *y, int64_t n) {
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        v8f v = v_load(x, j, n);
        v = v_exp2(v);
        v_storeu(y + j, v);
    }
    for (; j < n; j++) y[j] = exp2_f32(x[j]);
}
