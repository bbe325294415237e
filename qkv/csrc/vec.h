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

/* unaligned 8-lane access (one vmovups on x86, not a copy through the stack) */
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
static inline v8f v_loadu(const float *p) { return *(const v8f_unaligned *)p; }
static inline void v_storeu(float *p, v8f v) { *(v8f_unaligned *)p = v; }

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
/* Lanes j..j+7 of a row of w entries; past the end: −inf (weight 0, not counted). */
static inline v8f v_load(const float *row, int64_t j, int64_t w) {
    v8f v;
    if (j + LANES <= w) {
        v = v_loadu(row + j);
    } else {
        v = v_set(-INFINITY);
        for (int64_t i = 0; j + i < w; i++) v[i] = row[j + i];
    }
    return v;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#endif
