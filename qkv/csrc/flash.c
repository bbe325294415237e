/* Exact attention on the CPU for calls with gradients: a tiled forward that keeps each row's
 * shift and sum apart (see qkv/backends/chunked.py for why), and its backward. Per thread, a
 * tile of query rows × keys is scored with one BLAS gemm (torch's own, passed in) into a buffer
 * that stays in cache; the exponentials and dS run in C over that buffer, and the products with
 * V, dO, K and Q are gemms again. The torch formulation in chunked.py is the reference: the same
 * tiles in the same units, with no Nq × Nk memory.
 *
 * float32 rows run 8 lanes at a time (vec.h); float64, used for checking, runs scalar. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* The row's largest entry (NaN ignored; −inf for an empty row) and how many entries are NaN. */
static inline float row_max_float(const float *row, int64_t w, int64_t *nans) {
    v8f mx = v_set(-INFINITY);
    v8i nn = {0};
    for (int64_t j = 0; j < w; j += LANES) {
        v8f x = v_load(row, j, w);
        mx = v_select(x > mx, x, mx);
        nn -= x != x;
    }
    float m = mx[0];
    int64_t cn = 0;
    for (int i = 0; i < LANES; i++) {
        m = mx[i] > m ? mx[i] : m;
        cn += nn[i];
    }
    *nans = cn;
    return m;
}

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
