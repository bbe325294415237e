/* The statistics tile kernel for one element type: included by stats_tile.c with T (the type),
 * SUFFIX (the function name's) and EXP2 (a scalar exponential) defined, after the row helpers
 * row_max_SUFFIX and row_sums_SUFFIX. */
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, SUFFIX)

/* Insert (value, index) into a descending list of kk entries if it beats the last one. */
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
    /* 32 entries at a time; only lanes above the k-th best are looked at one by one */
    for (; j + 4 * LANES <= w; j += 4 * LANES) {
        v8f x[4], m;
        for (int u = 0; u < 4; u++) {
            x[u] = v_loadu(row + j + u * LANES);
            x[u] -= v_set(shift);
        }
        m = v_select(x[0] > x[1], x[0], x[1]);
        m = v_select(m > x[2], m, x[2]);
        m = v_select(m > x[3], m, x[3]);
        if (!lane_bits((m > v_set(tv[kk - 1])) & (m >= v_set(floor)))) continue;
        for (int u = 0; u < 4; u++) {
            for (unsigned bits = lane_bits((x[u] > v_set(tv[kk - 1])) & (x[u] >= v_set(floor))); bits; bits &= bits - 1) {
                int i = __builtin_ctz(bits);
                if (x[u][i] > tv[kk - 1]) FN(topk_push_)(tv, ti, kk, x[u][i], k0 + j + u * LANES + i);
            }
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
