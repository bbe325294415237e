/* Exact attention on the CPU for calls with gradients: a tiled forward that keeps each row's
 * shift and sum apart (see qkv/backends/chunked.py for why), and its backward. Per thread, a
 * tile of query rows × keys is scored with one BLAS gemm (torch's own, passed in) into a buffer
 * that stays in cache; the exponentials and dS run in C over that buffer, and the products with
 * V, dO, K and Q are gemms again. The torch formulation in chunked.py is the reference: the same
 * tiles in the same units, with no Nq × Nk memory.
 *
 * A built-in score function (softcap, relative bias: qkv/score_mods) is applied to each tile
 * after its gemm, in natural units (the scale multiplies the products first).
 *
 * float32 rows run 8 lanes at a time (vec.h); float64, used for checking, runs scalar. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* The float instance of flash_impl.h's row_max_ (vec.h's row_max_f32). */
static inline float row_max_float(const float *row, int64_t w, int64_t *nans) { return row_max_f32(row, w, nans); }

/* row[j] = 2^((row[j] − shift)·c), in place; returns their sum. */
static inline float row_exp_float(float *row, int64_t w, float shift, float c) {
    v8f s = v_set(0.0f);
    int64_t j = 0;
    for (; j + LANES <= w; j += LANES) {
        v8f p = v_exp2((v_loadu(row + j) - v_set(shift)) * v_set(c));
        v_storeu(row + j, p);
        s += p;
    }
    float tail = 0;
    for (; j < w; j++) {
        row[j] = exp2_f32((row[j] - shift) * c);
        tail += row[j];
    }
    return hsum(s) + tail;
}

/* ds[j] = p[j]·(ds[j] − delta), in place. */
static inline void row_ds_float(float *ds, const float *p, int64_t w, float delta) {
    int64_t j = 0;
    for (; j + LANES <= w; j += LANES) v_storeu(ds + j, v_loadu(p + j) * (v_loadu(ds + j) - v_set(delta)));
    for (; j < w; j++) ds[j] = p[j] * (ds[j] - delta);
}

/* Lanes [0, n) of p (n ≤ 8; the rest 0), and their store back. */
VEC_FN v8f v_load_part(const float *p, int64_t n) {
    if (n == LANES) return v_loadu(p);
    v8f v = v_set(0.0f);
    for (int64_t i = 0; i < n; i++) v[i] = p[i];
    return v;
}

VEC_FN void v_store_part(float *p, v8f v, int64_t n) {
    if (n == LANES) {
        v_storeu(p, v);
        return;
    }
    for (int64_t i = 0; i < n; i++) p[i] = v[i];
}

/* A built-in score function on n ≤ 8 products q·kᵀ: s = scale·q·kᵀ, then cap·tanh(s/cap) when
 * cap > 0 (inv = 1/cap; *th = tanh(s/cap)), then s + rel[0 .. n) when rel is not NULL. Every
 * kernel below computes a score through this one function, so the backward recomputes exactly
 * the scores whose maximum the forward kept. */
VEC_FN v8f v_score(v8f raw, const float *rel, int64_t n, float scale, float cap, float inv, v8f *th) {
    v8f s = raw * v_set(scale);
    if (cap > 0) {
        *th = v_tanh(s * v_set(inv));
        s = *th * v_set(cap);
    }
    if (rel) s += v_load_part(rel, n);
    return s;
}

/* A built-in score function on one row of products, in place (v_score; deriv, unless NULL:
 * 1 − tanh²(s/cap), the cap's derivative, for the backward). */
static inline void row_score_float(float *row, float *deriv, const float *rel, int64_t w, float scale, float cap) {
    const float inv = cap > 0 ? 1 / cap : 0;
    for (int64_t j = 0; j < w; j += LANES) {
        const int64_t n = w - j < LANES ? w - j : LANES;
        v8f th = v_set(0.0f);
        const v8f s = v_score(v_load_part(row + j, n), rel ? rel + j : NULL, n, scale, cap, inv, &th);
        if (deriv) v_store_part(deriv + j, v_set(1.0f) - th * th, n);
        v_store_part(row + j, s, n);
    }
}

/* The gradient of a row's modified scores (ds) → of its products' scaled values: added into
 * acc (unless NULL: the relative bias's gradient, key by key), then times deriv (unless NULL). */
static inline void row_dscore_float(float *ds, const float *deriv, float *acc, int64_t w) {
    for (int64_t j = 0; j < w; j += LANES) {
        const int64_t n = w - j < LANES ? w - j : LANES;
        v8f g = v_load_part(ds + j, n);
        if (acc) v_store_part(acc + j, v_load_part(acc + j, n) + g, n);
        if (deriv) v_store_part(ds + j, g * v_load_part(deriv + j, n), n);
    }
}

/* row_score_float, then row_max_float, in one pass (for rows no mask cuts). */
static inline float row_score_max_float(float *row, const float *rel, int64_t w, float scale, float cap, int64_t *nans) {
    const float inv = cap > 0 ? 1 / cap : 0;
    v8f mx = v_set(-INFINITY);
    v8i nn = {0};
    for (int64_t j = 0; j < w; j += LANES) {
        const int64_t n = w - j < LANES ? w - j : LANES;
        v8f th = v_set(0.0f), s = v_score(v_load_part(row + j, n), rel ? rel + j : NULL, n, scale, cap, inv, &th);
        v_store_part(row + j, s, n);
        if (n < LANES) s = v_load(row, j, w); /* lanes past the end: −inf */
        mx = v_select(s > mx, s, mx);
        nn -= s != s;
    }
    return lanes_max(mx, nn, nans);
}

/* row_score_float, then row_exp_float, in one pass (for rows no mask cuts; the backward's P̃). */
static inline void row_score_exp_float(float *row, float *deriv, const float *rel, int64_t w, float scale, float cap,
                                       float shift, float c) {
    const float inv = cap > 0 ? 1 / cap : 0;
    for (int64_t j = 0; j < w; j += LANES) {
        const int64_t n = w - j < LANES ? w - j : LANES;
        v8f th = v_set(0.0f);
        const v8f s = v_score(v_load_part(row + j, n), rel ? rel + j : NULL, n, scale, cap, inv, &th);
        if (deriv) v_store_part(deriv + j, v_set(1.0f) - th * th, n);
        v_store_part(row + j, v_exp2((s - v_set(shift)) * v_set(c)), n);
    }
}

/* row_ds_float, then row_dscore_float, in one pass (for rows without a dominant key). */
static inline void row_ds_dscore_float(float *ds, const float *p, const float *deriv, float *acc, int64_t w, float delta) {
    for (int64_t j = 0; j < w; j += LANES) {
        const int64_t n = w - j < LANES ? w - j : LANES;
        v8f g = v_load_part(p + j, n) * (v_load_part(ds + j, n) - v_set(delta));
        if (acc) v_store_part(acc + j, v_load_part(acc + j, n) + g, n);
        if (deriv) g *= v_load_part(deriv + j, n);
        v_store_part(ds + j, g, n);
    }
}

static inline double row_max_double(const double *row, int64_t w, int64_t *nans) {
    double m = -INFINITY;
    int64_t nn = 0;
    for (int64_t j = 0; j < w; j++) {
        m = row[j] > m ? row[j] : m;
        nn += row[j] != row[j];
    }
    *nans = nn;
    return m;
}

static inline double row_exp_double(double *row, int64_t w, double shift, double c) {
    double s = 0;
    for (int64_t j = 0; j < w; j++) {
        row[j] = exp2((row[j] - shift) * c);
        s += row[j];
    }
    return s;
}

static inline void row_ds_double(double *ds, const double *p, int64_t w, double delta) {
    for (int64_t j = 0; j < w; j++) ds[j] = p[j] * (ds[j] - delta);
}

static inline void row_score_double(double *row, double *deriv, const double *rel, int64_t w, double scale, double cap) {
    for (int64_t j = 0; j < w; j++) {
        double s = row[j] * scale;
        if (cap > 0) {
            const double th = tanh(s / cap);
            s = th * cap;
            if (deriv) deriv[j] = 1 - th * th;
        }
        row[j] = rel ? s + rel[j] : s;
    }
}

static inline void row_dscore_double(double *ds, const double *deriv, double *acc, int64_t w) {
    for (int64_t j = 0; j < w; j++) {
        if (acc) acc[j] += ds[j];
        if (deriv) ds[j] *= deriv[j];
    }
}

static inline double row_score_max_double(double *row, const double *rel, int64_t w, double scale, double cap, int64_t *nans) {
    row_score_double(row, NULL, rel, w, scale, cap);
    return row_max_double(row, w, nans);
}

static inline void row_score_exp_double(double *row, double *deriv, const double *rel, int64_t w, double scale, double cap,
                                        double shift, double c) {
    row_score_double(row, deriv, rel, w, scale, cap);
    row_exp_double(row, w, shift, c);
}

static inline void row_ds_dscore_double(double *ds, const double *p, const double *deriv, double *acc, int64_t w, double delta) {
    row_ds_double(ds, p, w, delta);
    row_dscore_double(ds, deriv, acc, w);
}

static inline double exp2_f64(double x) { return exp2(x); }

#define T float
#define SUFFIX float
#define EXP2 exp2_f32
#include "flash_impl.h"
#undef T
#undef SUFFIX
#undef EXP2

#define T double
#define SUFFIX double
#define EXP2 exp2_f64
#include "flash_impl.h"
#undef T
#undef SUFFIX
#undef EXP2

/* y = tanh(x) by the kernels' own v_tanh (for tests). */
void qkv_tanh_float(const float *x, float *y, int64_t n) {
    for (int64_t j = 0; j < n; j += LANES) {
        const int64_t m = n - j < LANES ? n - j : LANES;
        v_store_part(y + j, v_tanh(v_load_part(x + j, m)), m);
    }
}

/* 1 when gemm_fn computes a small row-major product correctly through gemm_rm_ (qkv checks
 * torch's BLAS once before using it). */
int qkv_gemm_check_float(void *gemm_fn) {
    const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, -1, 2, 0, 0.5f, 3}; /* (2 × 3)·(3 × 2) */
    float c[4] = {0};
    gemm_rm_float((gemm_t_float)gemm_fn, 0, 0, 2, 2, 3, a, 3, b, 2, 0, c, 2);
    return c[0] == 6.5f && c[1] == 8 && c[2] == 17 && c[3] == 14;
}

int qkv_gemm_check_double(void *gemm_fn) {
    const double a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, -1, 2, 0, 0.5, 3};
    double c[4] = {0};
    gemm_rm_double((gemm_t_double)gemm_fn, 0, 0, 2, 2, 3, a, 3, b, 2, 0, c, 2);
    return c[0] == 6.5 && c[1] == 8 && c[2] == 17 && c[3] == 14;
}
