/* 8-lane float32 vectors in GCC/clang vector extensions (lowered to the machine's SIMD: AVX2
 * on x86-64, NEON on ARM) and the exponential the native kernels share. */
#ifndef QKV_VEC_H
#define QKV_VEC_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define LANES 8

/* VEC_FN declares a function that takes or returns a v8f or v8i by value. Without AVX (baseline
 * x86-64) such a vector is passed in memory, where an AVX build passes it in a register, and
 * GCC and clang warn that the calling convention differs (-Wpsabi). There VEC_FN forces inlining,
 * so no call passes a vector (and GCC emits no out-of-line copy, whose warning no pragma reaches);
 * what is left are the warnings at the definitions, about calls that do not exist, silenced here.
 * The exported kernels take only pointers and scalars. With AVX, VEC_FN leaves inlining to the
 * compiler. */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX__)
#define VEC_FN static inline __attribute__((always_inline))
#if defined(__clang__)
#if __has_warning("-Wpsabi")
#pragma clang diagnostic ignored "-Wpsabi"
#endif
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#else
#define VEC_FN static inline
#endif

/* unaligned 8-lane access (one vmovups on x86, not a copy through the stack) */
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
VEC_FN v8f v_loadu(const float *p) { return *(const v8f_unaligned *)p; }
VEC_FN void v_storeu(float *p, v8f v) { *(v8f_unaligned *)p = v; }

VEC_FN v8f v_set(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
VEC_FN v8f v_select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* Lane-wise max(x, lo) and min(x, hi); where x is NaN the bound comes out (vmaxps/vminps
 * semantics; callers put NaN back). */
VEC_FN v8f v_max(v8f x, v8f lo) {
#if defined(__AVX__)
    return __builtin_ia32_maxps256(x, lo);
#else
    return v_select(x > lo, x, lo);
#endif
}
VEC_FN v8f v_min(v8f x, v8f hi) {
#if defined(__AVX__)
    return __builtin_ia32_minps256(x, hi);
#else
    return v_select(x < hi, x, hi);
#endif
}

/* 2^x, 8 lanes, for softmax weights: x = (s − max)·c ≤ 0, though it is accurate up to x = 127.
 * x is clamped to [−127, 127] (one max, one min) and split as n + f with f in [−1/2, 1/2] (n by
 * the 1.5·2^23 rounding trick, whose low mantissa bits then hold n); 2^f comes from a degree-6
 * minimax polynomial (1.9e-9 relative) and 2^n from one exponent field, which is 0 for
 * n = −127. So 2^−inf = 0, results below 2^−126.5 flush to 0, x above 127 gives 2^127, and
 * NaN propagates. Relative error at most 1.34·2^−24 over [−126, 127]: every float32 in
 * [−2, −1), whose fractions cover [−1/2, 1/2] at 2^−23 spacing, measures at most 1.337 (near
 * f = ±0.5002); tests check it. */
VEC_FN v8f v_exp2(v8f x) {
    const v8f magic = v_set(12582912.0f);
    v8f xc = v_min(v_max(x, v_set(-127.0f)), v_set(127.0f));
    v8f t = xc + magic;
    v8f f = xc - (t - magic);
    v8f p = v_set(1.534580223960802e-04f);
    p = p * f + v_set(1.3399927411228418e-03f);
    p = p * f + v_set(9.618489071726799e-03f);
    p = p * f + v_set(5.550328642129898e-02f);
    p = p * f + v_set(2.4022646248340607e-01f);
    p = p * f + v_set(6.931471824645996e-01f);
    p = p * f + v_set(1.0f);
    v8i n = (v8i)t - (v8i)magic;
    v8f r = p * (v8f)((n + 127) << 23);
    return v_select(x != x, x, r);
}

/* Bit i set where lane i of the comparison result is true. */
VEC_FN unsigned lane_bits(v8i mask) {
#if defined(__AVX__)
    return (unsigned)__builtin_ia32_movmskps256((v8f)mask);
#else
    v8i b = mask & (v8i){1, 2, 4, 8, 16, 32, 64, 128};
    return (unsigned)(((b[0] | b[1]) | (b[2] | b[3])) | ((b[4] | b[5]) | (b[6] | b[7])));
#endif
}

/* tanh, 8 lanes, for softcapped scores. |x| < 3/4: x + x³·P(x²), P a degree-6 fit of
 * (tanh(x)/x − 1)/x² (relative error 1.36·2^−24 over [0, 3/4] in float32 arithmetic); elsewhere
 * sign(x)·(1 − 2/(2^(2|x|·log2 e) + 1)), whose subtraction leaves a result ≥ 0.63, so the
 * exponential's error passes on damped. Relative error at most 2.6·2^−24 (tests check it, on
 * every float32 in [1/4, 8)); ±inf gives ±1 (v_exp2 saturates at 2^127), NaN propagates. */
VEC_FN v8f v_tanh(v8f x) {
    const v8i sign = (v8i)v_set(-0.0f);
    const v8f ax = (v8f)((v8i)x & ~sign), u = x * x;
    v8f p = v_set(-6.328162853606045e-04f);
    p = p * u + v_set(2.969730179756880e-03f);
    p = p * u + v_set(-8.596676401793957e-03f);
    p = p * u + v_set(2.180436812341213e-02f);
    p = p * u + v_set(-5.395958200097084e-02f);
    p = p * u + v_set(1.333327740430832e-01f);
    p = p * u + v_set(-3.333333134651184e-01f);
    const v8f small = x + x * u * p;
    const v8i near = ax < v_set(0.75f);
    if (lane_bits(near) == 0xFF) return small; /* softcapped scores are mostly well below the cap */
    const v8f e = v_exp2(ax * v_set(2.8853900817779268f)); /* 2·log2 e */
    const v8f big = (v8f)((v8i)(v_set(1.0f) - v_set(2.0f) / (e + v_set(1.0f))) | ((v8i)x & sign));
    return v_select(near, small, big);
}

static inline float exp2_f32(float x) { return v_exp2(v_set(x))[0]; }
/* Lanes j..j+7 of a row of w entries; past the end: −inf (weight 0, not counted). */
VEC_FN v8f v_load(const float *row, int64_t j, int64_t w) {
    v8f v;
    if (j + LANES <= w) {
        v = v_loadu(row + j);
    } else {
        v = v_set(-INFINITY);
        for (int64_t i = 0; j + i < w; i++) v[i] = row[j + i];
    }
    return v;
}

VEC_FN float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The largest lane of mx, and (into *nans) the NaNs counted lane by lane in nn. */
VEC_FN float lanes_max(v8f mx, v8i nn, int64_t *nans) {
    float m = mx[0];
    int64_t cn = 0;
    for (int i = 0; i < LANES; i++) {
        m = mx[i] > m ? mx[i] : m;
        cn += nn[i];
    }
    *nans = cn;
    return m;
}

/* The row's largest entry (NaN ignored; −inf for an empty row) and how many entries are NaN. */
static inline float row_max_f32(const float *row, int64_t w, int64_t *nans) {
    v8f mx = v_set(-INFINITY);
    v8i nn = {0};
    for (int64_t j = 0; j < w; j += LANES) {
        v8f x = v_load(row, j, w);
        mx = v_select(x > mx, x, mx);
        nn -= x != x;
    }
    return lanes_max(mx, nn, nans);
}


#endif
