/* The statistics tile kernel for one element type: included by stats_tile.c with T (the type),
 * SUFFIX (the function name's) and EXP2 (a scalar exponential) defined, after the row helpers
 * row_max_SUFFIX and row_sums_SUFFIX. */
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)

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

void FN(qkv_stats_tile_)(T *t, int64_t R, int64_t w, int64_t n, int64_t pos0, int64_t k0, int online, int masked,
                         const T *lse2, T *mx, T *tot, T *ent, T *dist, int64_t *cnt, T *kw, const int64_t *kpos, int64_t P, T *rw,
                         const int64_t *rel, int64_t Q, T *topv, int64_t *topi, int64_t kk, T *acc, int64_t dv, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < R; r++) {
        T *row = t + r * w;
        const int64_t pos = pos0 + r % n;
        int64_t allowed, nans;
        T bound; /* no lower than the row's k-th largest entry in this tile */
        T tmax = FN(row_max_)(row, w, kk, &bound, &allowed, &nans);
        cnt[r] += masked ? allowed : w;
        /* given the lse, x = row − lse2 = log2 p; online, x = row − (the running maximum) */
        T given = online || !lse2 || lse2[r] == -INFINITY ? 0 : lse2[r];
        tmax -= given;
        T old = mx[r];
        T m = (nans || old != old) ? (T)NAN : (old > tmax ? old : tmax);
        T shift = given;
        if (online) {
            shift = m == -INFINITY ? 0 : m;
            T delta = old == -INFINITY ? 0 : old - shift;
            if (delta < 0 || delta != delta) { /* the maximum grew (or became NaN): rescale the sums */
                T alpha = EXP2(delta);
                ent[r] = (ent[r] + delta * tot[r]) * alpha;
                tot[r] *= alpha;
                dist[r] *= alpha;
                for (int64_t i = 0; i < P; i++) kw[r * P + i] *= alpha;
                for (int64_t i = 0; i < Q; i++) rw[r * Q + i] *= alpha;
                if (acc)
                    for (int64_t i = 0; i < dv; i++) acc[r * dv + i] *= alpha;
            }
        }
        mx[r] = m;
        /* the entries themselves first: the sums pass below may overwrite the row with p */
        if (kk > 0 && tmax > topv[r * kk + kk - 1]) { /* else no entry can enter */
            T *tv = topv + r * kk;
            int64_t *ti = topi + r * kk;
            /* entries below bound − given cannot reach the top-k (rounding is monotonic) */
            FN(row_topk_)(row, w, given, bound - given, k0, tv, ti, kk);
        }
        for (int64_t i = 0; i < P; i++) {
            int64_t j = kpos[i] - k0;
            if (j >= 0 && j < w) kw[r * P + i] = EXP2(row[j] - shift);
        }
        for (int64_t i = 0; i < Q; i++) {
            int64_t j = pos + rel[i] - k0;
            if (j >= 0 && j < w) rw[r * Q + i] += EXP2(row[j] - shift);
        }
        T sp, spx, spd;
        FN(row_sums_)(row, w, shift, (T)(pos - k0), acc ? row : NULL, &sp, &spx, &spd);
        ent[r] += nans ? (T)NAN : spx;
        tot[r] += sp;
        dist[r] += spd;
    }
}

#undef FN
#undef CAT
#undef CAT2
