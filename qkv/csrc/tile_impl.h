/* What the tiled C kernels share, for one element type T (FN names the function for it):
 * BLAS gemm calls on row-major tiles, and the causal/window band and key padding applied to a
 * tile of scores. Included by stats_tile_impl.h and flash_impl.h. */
#ifndef QKV_BAND_DEFINED
#define QKV_BAND_DEFINED
#include <stdint.h>

/* Key j is allowed for query row i iff lo ≤ j − i ≤ hi (a missing bound: has_lo/has_hi = 0) and
 * key j is not padding (pad == NULL, or pad[j] nonzero). The kernels also stop at a batch entry's
 * klen (one past its last real key), passed to band_keys as the key count. */
typedef struct {
    int64_t lo, hi;
    int has_lo, has_hi;
} band_t;

/* Keys [*k_lo, *k_hi) that some row of [q0, q1) may see (empty when *k_lo >= *k_hi). */
static inline void band_keys(const band_t *b, int64_t q0, int64_t q1, int64_t nk, int64_t *k_lo, int64_t *k_hi) {
    int64_t a = b->has_lo ? q0 + b->lo : 0, z = b->has_hi ? q1 - 1 + b->hi + 1 : nk;
    *k_lo = a < 0 ? 0 : a;
    *k_hi = z > nk ? nk : z;
}

/* Does the band mask some pair of rows [q0, q1) × keys [k0, k1)? */
static inline int band_cuts(const band_t *b, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
    return (b->has_lo && k0 - (q1 - 1) < b->lo) || (b->has_hi && k1 - 1 - q0 > b->hi);
}
#endif

/* BLAS ?gemm_ (Fortran interface, column-major), passed in by the caller: torch's own. */
typedef void (*FN(gemm_t_))(const char *, const char *, const int *, const int *, const int *, const T *, const T *,
                            const int *, const T *, const int *, const T *, T *, const int *);

/* Row-major c (m × n, row stride ldc) = beta·c + alpha·op(a)·op(b): a is stored m × kd (kd × m
 * when ta), b kd × n (n × kd when tb), row strides lda and ldb. */
static inline void FN(gemm_rm_alpha_)(FN(gemm_t_) gemm, int ta, int tb, int64_t m, int64_t n, int64_t kd, T alpha,
                                      const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
    const int im = (int)m, in = (int)n, ik = (int)kd, ia = (int)lda, ib = (int)ldb, ic = (int)ldc;
    if (m == 0 || n == 0) return;
    if (kd == 0) { /* BLAS leaves c alone or scales it; either way: beta·c */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
        return;
    }
    /* row-major c = op(a)·op(b) is column-major cᵀ = op(b)ᵀ·op(a)ᵀ */
    gemm(tb ? "T" : "N", ta ? "T" : "N", &in, &im, &ik, &alpha, b, &ib, a, &ia, &beta, c, &ic);
}

/* The same with alpha = 1. */
static inline void FN(gemm_rm_)(FN(gemm_t_) gemm, int ta, int tb, int64_t m, int64_t n, int64_t kd, const T *a,
                                int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
    FN(gemm_rm_alpha_)(gemm, ta, tb, m, n, kd, 1, a, lda, b, ldb, beta, c, ldc);
}

/* Which masks cut tile rows [q0, q0 + n) × keys [k0, k0 + w): bit 1 the band, bit 2 padding. */
static inline int FN(tile_masks_)(int64_t n, int64_t w, int64_t q0, int64_t k0, const band_t *b, const uint8_t *pad) {
    int padded = 0;
    if (pad)
        for (int64_t c = 0; c < w && !padded; c++) padded = !pad[k0 + c];
    return band_cuts(b, q0, q0 + n, k0, k0 + w) | (padded << 1);
}

/* Set the disallowed scores of one row (query row qi, keys [k0, k0 + w)) to −inf, for the masks
 * tile_masks_ found (`masks`). */
static inline void FN(mask_row_)(T *row, int64_t w, int64_t qi, int64_t k0, const band_t *b, const uint8_t *pad, int masks) {
    if (masks & 1) {
        int64_t a = b->has_lo ? qi + b->lo - k0 : 0, z = b->has_hi ? qi + b->hi + 1 - k0 : w;
        a = a < 0 ? 0 : (a > w ? w : a);
        z = z < a ? a : (z > w ? w : z);
        for (int64_t c = 0; c < a; c++) row[c] = -INFINITY;
        for (int64_t c = z; c < w; c++) row[c] = -INFINITY;
    }
    if (masks & 2)
        for (int64_t c = 0; c < w; c++)
            if (!pad[k0 + c]) row[c] = -INFINITY;
}

/* Set the disallowed scores of tile t (rows [q0, q0 + n) × keys [k0, k0 + w), row-major) to −inf;
 * return whether any mask applies to the tile. pad: the batch entry's key padding or NULL. */
static inline int FN(mask_tile_)(T *t, int64_t n, int64_t w, int64_t q0, int64_t k0, const band_t *b,
                                 const uint8_t *pad) {
    const int masks = FN(tile_masks_)(n, w, q0, k0, b, pad);
    if (masks)
        for (int64_t i = 0; i < n; i++) FN(mask_row_)(t + i * w, w, q0 + i, k0, b, pad, masks);
    return masks != 0;
}
