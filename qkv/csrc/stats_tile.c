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
 *   A NaN anywhere in a row makes its maximum and sums NaN (as torch.maximum propagates it).
 *
 * float32 rows run 8 lanes at a time in GCC/clang vector extensions (lowered to the machine's
 * SIMD: AVX2 here, NEON on ARM); float64, used for checking, runs scalar with libm's exp2.
 */
#include <math.h>
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define LANES 8

static inline v8f v_set(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v8f v_select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* 2^x, 8 lanes: x = n + f with f in [−1/2, 1/2] (n by the 1.5·2^23 rounding trick, whose low
 * mantissa bits then hold n), 2^f by its Taylor series to degree 7 (truncation below 6e-9
 * relative), 2^n by building exponent bits. Relative error below 1.2·2^−24 (measured over
 * [−126, 128)); results below 2^−126 flush to 0, which makes 2^−inf = 0;
 * 2^x overflows to inf from x = 128; NaN propagates. */
static inline v8f v_exp2(v8f x) {
    const v8f magic = v_set(12582912.0f);
    v8f xc = v_select(x < v_set(-127.0f), v_set(-127.0f), x);
    xc = v_select(xc > v_set(129.0f), v_set(129.0f), xc);
    xc = v_select(x != x, v_set(0.0f), xc);
    v8f t = xc + magic;
    v8f f = xc - (t - magic);
    v8f p = v_set(1.5252733804059841e-05f);  /* ln2^7 / 7! */
    p = p * f + v_set(1.5403530393381606e-04f); /* ln2^6 / 6! */
    p = p * f + v_set(1.3333558146428443e-03f); /* ln2^5 / 5! */
    p = p * f + v_set(9.6181291076284772e-03f); /* ln2^4 / 4! */
    p = p * f + v_set(5.5504108664821580e-02f); /* ln2^3 / 3! */
    p = p * f + v_set(2.4022650695910071e-01f); /* ln2^2 / 2! */
    p = p * f + v_set(6.9314718055994531e-01f); /* ln2 */
    p = p * f + v_set(1.0f);
    v8i n = (v8i)t - (v8i)magic;
    v8i h = n >> 1; /* 2^n = 2^h · 2^(n − h): both factors normal for n in [−127, 129] */
    v8f r = (p * (v8f)((h + 127) << 23)) * (v8f)((n - h + 127) << 23);
    r = v_select(x < v_set(-126.0f), v_set(0.0f), r);
    return v_select(x != x, x, r);
}

/* Bit i set where lane i of the comparison result is true. */
static inline unsigned lane_bits(v8i mask) {
#if defined(__AVX__)
    return (unsigned)__builtin_ia32_movmskps256((v8f)mask);
#else
    v8i b = mask & (v8i){1, 2, 4, 8, 16, 32, 64, 128};
    return (unsigned)(((b[0] | b[1]) | (b[2] | b[3])) | ((b[4] | b[5]) | (b[6] | b[7])));
#endif
}

static inline float exp2_f32(float x) { return v_exp2(v_set(x))[0]; }
static inline double exp2_f64(double x) { return exp2(x); }

/* Lanes j..j+7 of a row of w entries; past the end: −inf (weight 0, not counted). */
static inline v8f v_load(const float *row, int64_t j, int64_t w) {
    v8f v;
    if (j + LANES <= w) {
        __builtin_memcpy(&v, row + j, sizeof v);
    } else {
        v = v_set(-INFINITY);
        for (int64_t i = 0; j + i < w; i++) v[i] = row[j + i];
    }
    return v;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The row's maximum (NaN ignored), how many entries are not −inf, and how many are NaN. */
static inline float row_max_float(const float *row, int64_t w, int64_t *allowed, int64_t *nans) {
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
    *allowed = ca;
    *nans = cn;
    return m;
}

/* Σ p, Σ p·x and Σ p·|rel0 − j| over the row, for p = 2^x, x = row[j] − shift. */
static inline void row_sums_float(const float *row, int64_t w, float shift, float rel0, float *sp, float *spx, float *spd) {
    const v8f lane = {0, 1, 2, 3, 4, 5, 6, 7};
    v8f s0 = v_set(0.0f), s1 = v_set(0.0f), s2 = v_set(0.0f);
    for (int64_t j = 0; j < w; j += LANES) {
        v8f x = v_load(row, j, w) - v_set(shift);
        v8f p = v_exp2(x);
        v8f d = v_set(rel0 - (float)j) - lane;
        s0 += p;
        s1 += v_select(p > v_set(0.0f), p * x, v_set(0.0f));
        s2 += p * v_select(d < v_set(0.0f), -d, d);
    }
    *sp = hsum(s0);
    *spx = hsum(s1);
    *spd = hsum(s2);
}

static inline double row_max_double(const double *row, int64_t w, int64_t *allowed, int64_t *nans) {
    double m = -INFINITY;
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

static inline void row_sums_double(const double *row, int64_t w, double shift, double rel0, double *sp, double *spx, double *spd) {
    double s0 = 0, s1 = 0, s2 = 0;
    for (int64_t j = 0; j < w; j++) {
        double x = row[j] - shift;
        double p = exp2(x);
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
        __builtin_memcpy(y + j, &v, sizeof v);
    }
    for (; j < n; j++) y[j] = exp2_f32(x[j]);
}
