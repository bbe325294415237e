/* Exact attention for a few query rows against a long key/value cache: decoding.
 *
 * Each generated token attends with Nq ≤ a few rows per query head to every cached key. The
 * work per key is a handful of dot products, so the time is the time to read K and V: this
 * kernel reads each key and value row once, in cache order, for all query rows that use it (the
 * G query heads of a grouped-query group times the Nq rows), and keeps everything else in L1:
 *
 *   for each job (key/value head j, split s of the keys), for each tile of TK keys:
 *     S = c · Q_j · Kᵀ            (R × TK, R = G·Nq rows, c = scale · log2 e; a bfloat16 cache
 *                                  with the processor's bfloat16 dot product where it has one,
 *                                  else K converted to float32 where it is used)
 *     masks (band, key padding) → −inf
 *     online softmax per row: m, l, and the unnormalised output O += 2^(S − m) · V
 *   then the splits of a head and its sink are merged exactly: M = max m_s, L = Σ l_s 2^(m_s − M),
 *   O = Σ O_s 2^(m_s − M) / L  (flash-decoding; in natural units and double precision, so that
 *   a sink of any size takes part).
 *
 * Splitting the keys lets every thread stream its own part of one head's cache when there are
 * fewer heads than threads (batch 1, 8 key/value heads, 2 or more threads).
 *
 * Shapes: q (J, R, d) float32, row r = g·nq + i is query head g of the group at query position
 * i; key/value head j = b·hk + h's rows start at k + b·ksb + h·ksh (v likewise), consecutive rows ks and vs
 * elements apart, each row contiguous; out (J, R, dv) float32; lse (J, R) float32 in natural
 * units (−inf for a row with no key). sinks: NULL or (J, R) double logits in natural units, each
 * added to its row's denominator (a row with no key then gives 0 and lse = its sink). Masks as in tile_impl.h: key n is allowed for row
 * position i iff lo ≤ n − i ≤ hi; pad (kpad_rows rows of nk bytes; row j / heads_per_pad) or
 * NULL; klen (per pad row: keys past it are padding) or NULL. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vec.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define LN2_F64 0.6931471805599453 /* ln 2: a part's shift m (log2 units) is m·ln 2 in natural units */
#define TK 32 /* keys per tile: the scores of 8 rows (1 KiB) stay in L1 between the softmax and V */

#define T float
#define SUFFIX _decode
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)
#include "tile_impl.h" /* the band and key-padding masks, as the other kernels apply them */

/* row[j] = 2^(row[j] − shift) in place (w ≤ TK, a multiple of 8 lanes in the buffer); their sum. */
static inline float row_exp_dec(float *row, int64_t w, float shift) {
    v8f s = v_set(0.0f);
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t j = 0; j < w; j += LANES) {
        v8f p = v_exp2(v_loadu(row + j) - v_set(shift));
        p = v_select(lane + (int32_t)j < (int32_t)w, p, v_set(0.0f));
        v_storeu(row + j, p);
        s += p;
    }
    return hsum(s);
}

/* acc[e] += p·x[e]. */
static inline void axpy_f32(float *acc, float p, const float *x, int64_t dv) {
    const v8f vp = v_set(p);
    int64_t e = 0;
    for (; e + LANES <= dv; e += LANES) v_storeu(acc + e, v_loadu(acc + e) + vp * v_loadu(x + e));
    for (; e < dv; e++) acc[e] += p * x[e];
}

typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2), may_alias));
typedef _Float16 v8h __attribute__((vector_size(16), aligned(2), may_alias));

/* Entries [i, i + 8) of a cache as float32 (kind: 0 float32; 1 bfloat16, the upper half of a
 * float32; 2 float16, converted in hardware with F16C). Converting where the entries are used,
 * rather than a tile at a time beforehand, lets the loads of the cache overlap the arithmetic. */
static inline __attribute__((always_inline)) v8f load8(const void *base, int kind, int64_t i) {
    if (kind == 0) return v_loadu((const float *)base + i);
#if defined(__AVX2__) /* one vpmovzxwd from memory and a shift (the generic form compiled to five instructions) */
    if (kind == 1)
        return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i))), 16);
#else
    if (kind == 1) return (v8f)(__builtin_convertvector(*(const v8u16 *)((const uint16_t *)base + i), v8i) << 16);
#endif
    return __builtin_convertvector(*(const v8h *)((const _Float16 *)base + i), v8f);
}

static inline __attribute__((always_inline)) float load1(const void *base, int kind, int64_t i) {
    if (kind == 0) return ((const float *)base)[i];
    if (kind == 1) {
        const uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return (float)((const _Float16 *)base)[i];
}

/* x rounded to bfloat16 (to nearest, ties to even; a NaN stays a NaN). Exact for the query
 * rows of a bfloat16 call, which arrive as float32 copies of bfloat16 numbers. */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (x != x) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* {Σ a0, Σ a1, …, Σ a7}: eight horizontal sums at once. */
VEC_FN v8f hsum8(const v8f *a) {
#if defined(__AVX__)
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
#else
    return (v8f){hsum(a[0]), hsum(a[1]), hsum(a[2]), hsum(a[3]), hsum(a[4]), hsum(a[5]), hsum(a[6]), hsum(a[7])};
#endif
}

/* Software prefetch of the rows PF_KEYS keys ahead (one tile) into L2, once per cache line, as a
 * row's first vector is loaded. With several query rows per key the loop spends long enough on
 * each line that the hardware prefetchers fall behind; prefetching into L1 instead evicted the
 * tile in use. Measured on a 2-core AVX-512 EPYC, 1 thread, Nk = 32768, D = 128: 32 query heads
 * on 4 KV heads, float32, 25.5 → 12.7 ms (bfloat16 15.1 → 7.0); 32 on 8, float32, 30 → 19 ms.
 * A bfloat16 or float16 cache with one row per key is streamed fast enough without it (8 heads:
 * 5.6 ms without, 8.1 with). */
#define PF_KEYS 32
static inline __attribute__((always_inline)) int prefetching(int kind, int64_t g) { return kind == 0 || g > 1; }
/* Prefetch the line of entry i + PF_KEYS rows (rows ld apart) when e, the entry's offset in its
 * row, starts a cache line. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *base, int kind, int64_t i, int64_t ld,
                                                                 int64_t e) {
    if ((e & (kind == 0 ? 15 : 31)) == 0)
        __builtin_prefetch((const char *)base + (i + PF_KEYS * ld) * (kind == 0 ? 4 : 2), 0, 2);
}

#define RG 8 /* query rows that share each load of K and V */
/* Up to this many rows, V's rows are read whole and in order (the prefetchers stream them) and
 * added into each row's output in L1; beyond, 8 lanes of each row's output stay in a register
 * while the tile's V rows pass (and the next tile is prefetched). Measured on a 2-core AVX-512
 * EPYC, 1 thread, Nk = 32768, D = 128, in order vs in registers: 1 row (8 heads) float32 15.8
 * vs 15.9 ms, bfloat16 5.9 vs 6.7; 2 rows 16.1 vs 14.2, 9.5 vs 7.9; 4 rows 19.4 vs 17.2, 14.3
 * vs 8.6. */
#define IN_ORDER_ROWS 1

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define DOT_BF16 1 /* the processor's bfloat16 dot product (AVX-512 BF16) */
#else
#define DOT_BF16 0
#endif

/* s[r·TK + t] = c·(q_r · k_(n0+t)) for rows r < g (g ≤ RG, q rows d apart) and the w keys from
 * n0 (cache rows ld apart): each K load feeds g rows; two keys at a time keep 2·g sums in flight.
 * q is float32 (then pre-scaled, and c = 1), or with dot (a bfloat16 cache, DOT_BF16) bfloat16
 * rows multiplied by the processor's bfloat16 dot product: 16 products per instruction instead
 * of 8 and no conversion of K; each product of two bfloat16 numbers is exact in float32 and the
 * sums are float32. */
static inline __attribute__((always_inline)) void scores_group(const void *q, int64_t g, const void *k, int kind,
                                                               int dot, int64_t ld, int64_t n0, int64_t w, int64_t d,
                                                               float c, float *s) {
    const int step = dot ? 16 : LANES, qkind = dot ? 1 : 0;
    const int64_t dn = d - d % step;
    const v8f zero = v_set(0.0f);
    for (int64_t t = 0; t < w; t += 2) {
        const int two = t + 1 < w;
        const int64_t i0 = (n0 + t) * ld, i1 = two ? i0 + ld : i0;
        v8f a[RG], b[RG];
        for (int64_t r = 0; r < RG; r++) a[r] = b[r] = zero;
        for (int64_t e = 0; e < dn; e += step) {
            if (prefetching(kind, g)) {
                prefetch_ahead(k, kind, i0 + e, ld, e);
                prefetch_ahead(k, kind, i1 + e, ld, e);
            }
#if DOT_BF16
            if (dot) {
                const uint16_t *kb = (const uint16_t *)k, *qb = (const uint16_t *)q;
                const __m256bh x0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(kb + i0 + e));
                const __m256bh x1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(kb + i1 + e));
                for (int64_t r = 0; r < g; r++) {
                    const __m256bh y = (__m256bh)_mm256_loadu_si256((const __m256i *)(qb + r * d + e));
                    a[r] = (v8f)_mm256_dpbf16_ps((__m256)a[r], y, x0);
                    b[r] = (v8f)_mm256_dpbf16_ps((__m256)b[r], y, x1);
                }
                continue;
            }
#endif
            const v8f x0 = load8(k, kind, i0 + e), x1 = load8(k, kind, i1 + e);
            for (int64_t r = 0; r < g; r++) {
                const v8f y = v_loadu((const float *)q + r * d + e);
                a[r] += y * x0;
                b[r] += y * x1;
            }
        }
        const v8f sa = hsum8(a), sb = hsum8(b);
        for (int64_t r = 0; r < g; r++) {
            float xa = sa[r], xb = sb[r];
            for (int64_t e = dn; e < d; e++) {
                const float y = load1(q, qkind, r * d + e);
                xa += y * load1(k, kind, i0 + e);
                xb += y * load1(k, kind, i1 + e);
            }
            s[r * TK + t] = c * xa;
            if (two) s[r * TK + t + 1] = c * xb;
        }
    }
}

/* o_r (dv) = alpha_r·o_r + Σ_t p_r[t]·v_(n0+t) for rows r < g (o rows dv + 2 apart, p rows TK
 * apart) over w keys (cache rows ld apart): each V load feeds g rows. in_order: V's rows whole and
 * in order, o in L1; otherwise 8 lanes of each o_r in a register while the tile's rows pass.
 * No key is skipped, even at weight 0, so a non-finite value reaches every row (decode_part). */
static inline __attribute__((always_inline)) void weigh_group(float *o, const float *alpha, const float *p, int64_t g,
                                                              const void *v, int kind, int64_t ld, int64_t n0,
                                                              int64_t w, int64_t dv, int in_order) {
    const int64_t d8 = dv - dv % LANES;
    if (in_order) {
        for (int64_t r = 0; r < g; r++)
            if (alpha[r] != 1)
                for (int64_t e = 0; e < dv; e++) o[r * (dv + 2) + e] *= alpha[r];
        for (int64_t t = 0; t < w; t++) {
            const int64_t i = (n0 + t) * ld;
            for (int64_t e = 0; e < d8; e += LANES) {
                const v8f x = load8(v, kind, i + e);
                if (prefetching(kind, g)) prefetch_ahead(v, kind, i + e, ld, e);
                for (int64_t r = 0; r < g; r++) {
                    float *orow = o + r * (dv + 2) + e;
                    v_storeu(orow, v_loadu(orow) + v_set(p[r * TK + t]) * x);
                }
            }
            for (int64_t e = d8; e < dv; e++) {
                const float x = load1(v, kind, i + e);
                for (int64_t r = 0; r < g; r++) o[r * (dv + 2) + e] += p[r * TK + t] * x;
            }
        }
        return;
    }
    int64_t e0 = 0;
    /* 16 lanes of each row at a time: each broadcast weight feeds two FMAs, so the loads (one
     * weight per row, two V vectors) stay fewer than the FMAs. */
    for (; e0 + 2 * LANES <= d8; e0 += 2 * LANES) {
        v8f a[RG], b[RG];
        for (int64_t r = 0; r < g; r++) {
            a[r] = v_loadu(o + r * (dv + 2) + e0) * v_set(alpha[r]);
            b[r] = v_loadu(o + r * (dv + 2) + e0 + LANES) * v_set(alpha[r]);
        }
        for (int64_t t = 0; t < w; t++) {
            const int64_t i = (n0 + t) * ld + e0;
            const v8f x = load8(v, kind, i), y = load8(v, kind, i + LANES);
            if (prefetching(kind, g)) prefetch_ahead(v, kind, i, ld, e0);
            for (int64_t r = 0; r < g; r++) {
                const v8f pr = v_set(p[r * TK + t]);
                a[r] += pr * x;
                b[r] += pr * y;
            }
        }
        for (int64_t r = 0; r < g; r++) {
            v_storeu(o + r * (dv + 2) + e0, a[r]);
            v_storeu(o + r * (dv + 2) + e0 + LANES, b[r]);
        }
    }
    for (int64_t e = e0; e < d8; e += LANES) {
        v8f a[RG];
        for (int64_t r = 0; r < g; r++) a[r] = v_loadu(o + r * (dv + 2) + e) * v_set(alpha[r]);
        for (int64_t t = 0; t < w; t++) {
            const v8f x = load8(v, kind, (n0 + t) * ld + e);
            if (prefetching(kind, g)) prefetch_ahead(v, kind, (n0 + t) * ld + e, ld, e);
            for (int64_t r = 0; r < g; r++) a[r] += v_set(p[r * TK + t]) * x;
        }
        for (int64_t r = 0; r < g; r++) v_storeu(o + r * (dv + 2) + e, a[r]);
    }
    for (int64_t e = d8; e < dv; e++)
        for (int64_t r = 0; r < g; r++) {
            float a = o[r * (dv + 2) + e] * alpha[r];
            for (int64_t t = 0; t < w; t++) {
                const float x = load1(v, kind, (n0 + t) * ld + e);
                a += p[r * TK + t] * x;
            }
            o[r * (dv + 2) + e] = a;
        }
}

/* g a constant in each case, so that the per-row sums of scores_group and weigh_group stay in
 * registers (with a variable g the compiler keeps them in memory, and every FMA waits on a store). */
#define FOR_ROWS(g, CALL)       \
    switch (g) {                \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    case 4: CALL(4); break;     \
    case 5: CALL(5); break;     \
    case 6: CALL(6); break;     \
    case 7: CALL(7); break;     \
    default: CALL(8); break;    \
    }


/* scores_group and weigh_group for each cache type and group size, as functions of their own:
 * compiled apart, their loops keep their sums in registers (inlined into the tile loop, the
 * float32 cache ran 10–15% slower). */
#define FOR_KINDS(kind, CALL_G)                                   \
    switch (kind) {                                               \
    case 0: { FOR_ROWS(g, CALL_G##0) } break;                     \
    case 1: { FOR_ROWS(g, CALL_G##1) } break;                     \
    default: { FOR_ROWS(g, CALL_G##2) } break;                    \
    }

/* q: float32 rows scaled by c already (c = 1 here), or bfloat16 rows for a bfloat16 cache where
 * DOT_BF16 (see scores_group). */
static __attribute__((noinline)) void scores_rows(const void *q, int64_t g, const void *k, int kind, int64_t ld,
                                                  int64_t n0, int64_t w, int64_t d, float c, float *s) {
#define SC0(G) scores_group(q, G, k, 0, 0, ld, n0, w, d, c, s)
#define SC1(G) scores_group(q, G, k, 1, DOT_BF16, ld, n0, w, d, c, s)
#define SC2(G) scores_group(q, G, k, 2, 0, ld, n0, w, d, c, s)
    FOR_KINDS(kind, SC)
#undef SC0
#undef SC1
#undef SC2
}

static __attribute__((noinline)) void weigh_rows(float *o, const float *alpha, const float *p, int64_t g, const void *v,
                                                 int kind, int64_t ld, int64_t n0, int64_t w, int64_t dv) {
#define WE0(G) weigh_group(o, alpha, p, G, v, 0, ld, n0, w, dv, G <= IN_ORDER_ROWS)
#define WE1(G) weigh_group(o, alpha, p, G, v, 1, ld, n0, w, dv, G <= IN_ORDER_ROWS)
#define WE2(G) weigh_group(o, alpha, p, G, v, 2, ld, n0, w, dv, G <= IN_ORDER_ROWS)
    FOR_KINDS(kind, WE)
#undef WE0
#undef WE1
#undef WE2
}

/* Are x[0 .. n) all finite? x·0 is 0 for a finite x, NaN for NaN or ±inf. */
static inline int all_finite(const float *x, int64_t n) {
    float z = 0;
    for (int64_t i = 0; i < n; i++) z += x[i] * 0.0f;
    return z == z;
}

/* Are rows [n0, n1) of a cache (rows ld apart, w entries each, kind as load8) all finite? For the
 * keys a job's band or key padding skips: the non-finite rule counts them too, and one pass
 * here, at memory speed, costs less than the caller's second pass over the whole cache. */
static int rows_finite(const void *base, int kind, int64_t ld, int64_t n0, int64_t n1, int64_t w) {
    const int64_t w8 = w - w % LANES;
    v8f z = v_set(0.0f);
    float zs = 0;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t e = 0; e < w8; e += LANES) z += load8(base, kind, n * ld + e) * 0.0f;
        for (int64_t e = w8; e < w; e++) zs += load1(base, kind, n * ld + e) * 0.0f;
    }
    zs += hsum(z);
    return zs == zs;
}

/* One job: rows R of head j (q: R × d) against keys [a, z) of its K and V (kind as load8):
 * writes the running (O, m, l) of each row into part (R × (dv + 2)). buf: RG·TK + RG + R·d
 * floats. Returns whether its query rows and every K and V entry it read were finite, read off what they reach: a
 * NaN or ±inf in a key makes its score non-finite (checked on the first row, before the masks),
 * one in a value makes every output row non-finite (0·inf is NaN, and no key is skipped); an
 * overflowing score or sum also answers "no", which only sends the caller to the full check.
 * Instantiated per cache type
 * and per group size below, so that the conversions and the row loops are compiled out. */
static inline __attribute__((always_inline)) int decode_part(const float *q, const void *kj, const void *vj, int kind,
                                                              int64_t ks, int64_t vs, int64_t R, int64_t nq, int64_t d,
                                                              int64_t dv, const band_t *bd, const uint8_t *pad, float c,
                                                              int64_t a, int64_t z, float *part, float *buf) {
    float *s = buf, *alpha = s + RG * TK, *qj = alpha + RG;
    const int dot = DOT_BF16 && kind == 1; /* bfloat16 rows: q as bfloat16, scaled after the dot */
    uint16_t *qb = (uint16_t *)qj;
    if (dot)
        for (int64_t i = 0; i < R * d; i++) qb[i] = to_bf16(q[i]);
    else
        for (int64_t i = 0; i < R * d; i++) qj[i] = c * q[i]; /* scores come out in log2 units */
    int finite = all_finite(q, R * d); /* a fully masked row would never show its query's NaN */
    for (int64_t r = 0; r < R; r++) {
        float *o = part + r * (dv + 2);
        memset(o, 0, sizeof(float) * (size_t)dv);
        o[dv] = -INFINITY;
        o[dv + 1] = 0;
    }
    for (int64_t n0 = a; n0 < z; n0 += TK) {
        const int64_t w = z - n0 < TK ? z - n0 : TK;
        const int masks = FN(tile_masks_)(nq, w, 0, n0, bd, pad);
        for (int64_t r0 = 0; r0 < R; r0 += RG) {
            const int64_t g = R - r0 < RG ? R - r0 : RG;
            float *o = part + r0 * (dv + 2);
            if (dot) scores_rows(qb + r0 * d, g, kj, kind, ks, n0, w, d, c, s);
            else scores_rows(qj + r0 * d, g, kj, kind, ks, n0, w, d, 1.0f, s);
            if (r0 == 0) finite = finite && all_finite(s, w); /* before the masks: every key of the tile */
            for (int64_t r = 0; r < g; r++) { /* masks and the online softmax, row by row */
                float *sr = s + r * TK, *orow = o + r * (dv + 2);
                if (masks) FN(mask_row_)(sr, w, (r0 + r) % nq, n0, bd, pad, masks);
                int64_t nans;
                const float tmax = row_max_f32(sr, w, &nans);
                const float old = orow[dv];
                const float mn = (nans || old != old) ? NAN : (old > tmax ? old : tmax);
                if (mn == -INFINITY) { /* nothing allowed yet in this row: it adds nothing */
                    alpha[r] = 1;
                    memset(sr, 0, sizeof(float) * TK);
                    continue;
                }
                alpha[r] = old == mn ? 1 : (old == -INFINITY ? 0 : exp2_f32(old - mn));
                const float sum = row_exp_dec(sr, w, mn);
                orow[dv] = mn;
                orow[dv + 1] = orow[dv + 1] * alpha[r] + sum;
            }
            weigh_rows(o, alpha, s, g, vj, kind, vs, n0, w, dv);
        }
    }
    for (int64_t r = 0; r < R && finite; r++) finite = all_finite(part + r * (dv + 2), dv);
    return finite;
}

/* decode_part for each cache type, with the type's conversion inlined. */
static int decode_part_f32(const float *q, const void *k, const void *v, int64_t ks, int64_t vs, int64_t R, int64_t nq,
                           int64_t d, int64_t dv, const band_t *bd, const uint8_t *pad, float c, int64_t a, int64_t z,
                           float *part, float *buf) {
    return decode_part(q, k, v, 0, ks, vs, R, nq, d, dv, bd, pad, c, a, z, part, buf);
}
static int decode_part_bf16(const float *q, const void *k, const void *v, int64_t ks, int64_t vs, int64_t R, int64_t nq,
                            int64_t d, int64_t dv, const band_t *bd, const uint8_t *pad, float c, int64_t a, int64_t z,
                            float *part, float *buf) {
    return decode_part(q, k, v, 1, ks, vs, R, nq, d, dv, bd, pad, c, a, z, part, buf);
}
static int decode_part_f16(const float *q, const void *k, const void *v, int64_t ks, int64_t vs, int64_t R, int64_t nq,
                           int64_t d, int64_t dv, const band_t *bd, const uint8_t *pad, float c, int64_t a, int64_t z,
                           float *part, float *buf) {
    return decode_part(q, k, v, 2, ks, vs, R, nq, d, dv, bd, pad, c, a, z, part, buf);
}

/* Forward; see the top of this file. splits ≥ 1 parts per head; scratch holds
 * J · splits · R · (dv + 2) floats. Returns 0 when every key and value was read and found finite
 * and every query entry is finite (the non-finite rule then holds without another pass), 1 when
 * not (keys skipped by a mask, or a NaN or ±inf somewhere), −1 when out of memory. */
int qkv_decode_fwd(const float *q, const void *k, const void *v, int kind, int64_t hk, int64_t ksb, int64_t ksh,
                   int64_t vsb, int64_t vsh, int64_t ks, int64_t vs, int64_t J, int64_t R, int64_t nq, int64_t nk,
                   int64_t d, int64_t dv, int64_t lo, int64_t hi, int has_lo, int has_hi, const uint8_t *kpad,
                   int64_t kpad_rows, const int64_t *klen, float c, const double *sinks, int64_t splits, float *scratch,
                   float *out, float *lse, int nthreads) {
    (void)nthreads; /* read by the OpenMP pragmas alone */
    const band_t bd = {lo, hi, has_lo, has_hi};
    const size_t esz = kind == 0 ? 4 : 2;
    const int64_t part = R * (dv + 2), jobs = J * splits;
    int failed = 0, unchecked = 0;
    int64_t keys_checked = 0; /* keys read and found finite, over all heads: J·nk when all were */
OMP(parallel num_threads(nthreads))
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(RG * TK + RG + R * d));
        if (!buf) {
OMP(atomic write)
            failed = 1;
        }
OMP(for schedule(dynamic, 1))
        for (int64_t job = 0; job < jobs; job++) {
            if (!buf) continue;
            const int64_t j = job / splits, sp = job % splits, prow = kpad_rows ? j / hk : 0;
            const int64_t nreal = klen && klen[prow] < nk ? klen[prow] : nk;
            int64_t a, z;
            band_keys(&bd, 0, nq, nreal, &a, &z);
            const int64_t span = z > a ? z - a : 0, chunk = (span + splits - 1) / splits;
            const int64_t a2 = a + sp * chunk, z2 = a2 + chunk < z ? a2 + chunk : z;
            const void *kj = (const char *)k + (size_t)(j / hk * ksb + j % hk * ksh) * esz;
            const void *vj = (const char *)v + (size_t)(j / hk * vsb + j % hk * vsh) * esz;
            const uint8_t *pad = kpad ? kpad + prow * nk : NULL;
            const int64_t z3 = z2 > a2 ? z2 : a2;
            float *out_part = scratch + job * part;
            int finite;
            if (kind == 0) finite = decode_part_f32(q + j * R * d, kj, vj, ks, vs, R, nq, d, dv, &bd, pad, c, a2, z3, out_part, buf);
            else if (kind == 1) finite = decode_part_bf16(q + j * R * d, kj, vj, ks, vs, R, nq, d, dv, &bd, pad, c, a2, z3, out_part, buf);
            else finite = decode_part_f16(q + j * R * d, kj, vj, ks, vs, R, nq, d, dv, &bd, pad, c, a2, z3, out_part, buf);
            int64_t checked_keys = z3 - a2;
            if (sp == 0 && finite) { /* the keys no part reads: [0, sa) before the band, [sz, nk) after it */
                const int64_t sa = a < nk ? a : nk, sz = z > sa ? z : sa;
                finite = rows_finite(kj, kind, ks, 0, sa, d) && rows_finite(vj, kind, vs, 0, sa, dv) &&
                         rows_finite(kj, kind, ks, sz, nk, d) && rows_finite(vj, kind, vs, sz, nk, dv);
                checked_keys += sa + (nk - sz);
            }
            if (finite) {
OMP(atomic)
                keys_checked += checked_keys;
            } else {
OMP(atomic write)
                unchecked = 1;
            }
        }
        free(buf);
        /* Merge the splits of each row and its sink in natural units and double precision (a
         * part's shift m, float in log2 units, is m·ln 2 there): a sink of any finite size joins
         * exactly, where in float32 log2 units one above FLT_MAX·ln 2 ≈ 2.36e38 would be +inf, and
         * the lse is rounded to float once. */
OMP(for schedule(static))
        for (int64_t jr = 0; jr < J * R; jr++) {
            const int64_t j = jr / R, r = jr % R;
            const float *p0 = scratch + j * splits * part + r * (dv + 2);
            const double sink = sinks ? sinks[jr] : -INFINITY; /* one more logit in the denominator */
            float mk = -INFINITY; /* the largest shift of the parts: −inf when no key reached the row */
            int nan = 0;
            for (int64_t sp = 0; sp < splits; sp++) {
                const float m = p0[sp * part + dv];
                nan |= m != m;
                mk = m > mk ? m : mk;
            }
            float *o = out + jr * dv;
            if (nan || mk == -INFINITY) { /* NaN stays NaN; a row with no key gives 0, lse the sink */
                for (int64_t e = 0; e < dv; e++) o[e] = nan ? NAN : 0;
                lse[jr] = nan ? NAN : (float)sink;
                continue;
            }
            const double mx = fmax(sink, mk * LN2_F64);
            double L = sink == -INFINITY ? 0 : exp(sink - mx);
            memset(o, 0, sizeof(float) * (size_t)dv);
            for (int64_t sp = 0; sp < splits; sp++) {
                const float *ps = p0 + sp * part;
                if (ps[dv] == -INFINITY) continue;
                const double f = exp(ps[dv] * LN2_F64 - mx);
                L += f * ps[dv + 1];
                axpy_f32(o, (float)f, ps, dv);
            }
            const float inv = (float)(1 / L);
            for (int64_t e = 0; e < dv; e++) o[e] *= inv;
            lse[jr] = (float)(mx + log(L));
        }
    }
    return failed ? -1 : (unchecked || keys_checked != J * nk);
}
