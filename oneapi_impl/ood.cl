// Mahalanobis scoring, one fused kernel: the contract of torch_kernels.reference.ood.mahalanobis_min.
//
// A work-group of TILE x TILE work-items owns BR = TILE * RB rows. For each tile of TILE output
// columns it runs the whitening GEMM y = (x - center) @ W over the inner dimension, staging tiles
// of x and W in local memory (each work-item keeps RB rows of one column in registers), then
// folds that tile of y into ||y||^2 (in registers) and into the class dot products (in local
// memory). After the last column tile the group reduces ||y||^2 and the (min, argmin) over
// classes. y never goes to global memory.
//
// Build-time macros: X_KIND (0 float32, 1 float64, 2 float16, 3 bfloat16), ACC_F64 (accumulate
// in double), TILE (a power of two), RB (rows per work-item), MAX_C (>= C, sizes the dot products).
//
// The same file holds edm_score_levels (below), built when MAX_H is defined instead of MAX_C.

#if ACC_F64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double acc_t;
#define ACC_INF ((double)INFINITY)
#else
typedef float acc_t;
#define ACC_INF INFINITY
#endif

#if X_KIND == 0
typedef float x_t;
#define LOAD_X(p, i) ((acc_t)(p)[i])
#elif X_KIND == 1
typedef double x_t;
#define LOAD_X(p, i) ((acc_t)(p)[i])
#elif X_KIND == 2
typedef half x_t;  // read with vload_half, which needs no fp16 arithmetic support
#define LOAD_X(p, i) ((acc_t)vload_half((i), (p)))
#elif X_KIND == 3
typedef ushort x_t;  // bfloat16 is the top half of a float32
#define LOAD_X(p, i) ((acc_t)as_float(((uint)(p)[i]) << 16))
#endif

#ifdef MAX_C

// a comes before b: smaller, NaN first (so NaN propagates as in torch.min), lower index on ties.
static bool before(acc_t a, int ia, acc_t b, int ib) {
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a < b || (a == b && ia < ib);
}

// Local id 0 is the column lane j, local id 1 the row lane r; work-item (r, j) computes rows
// r * RB .. r * RB + RB - 1 of column j of each tile. The row blocks run along dimension 0.
#define BR (TILE * RB)

__kernel __attribute__((reqd_work_group_size(TILE, TILE, 1)))
void mahalanobis_min(__global const x_t *x, __global const acc_t *center, __global const acc_t *w,
                     __global const acc_t *class_proj, __global const acc_t *class_sq,
                     __global acc_t *score, __global long *nearest, int B, int D, int C) {
    __local acc_t xs[BR][TILE + 1];  // + 1: no bank conflicts on a GPU
    __local acc_t ws[TILE][TILE];
    __local acc_t ys[BR][TILE + 1];
    __local acc_t dots[BR * MAX_C];
    __local acc_t red[BR][TILE];
    __local int red_index[BR][TILE];

    const int j = get_local_id(0), r = get_local_id(1);
    const int lid = r * TILE + j;
    const long row0 = (long)get_group_id(0) * BR;

    for (int i = lid; i < BR * C; i += TILE * TILE) dots[i] = 0;
    acc_t sq[RB];
    for (int q = 0; q < RB; ++q) sq[q] = 0;

    for (int n0 = 0; n0 < D; n0 += TILE) {
        acc_t acc[RB];
        for (int q = 0; q < RB; ++q) acc[q] = 0;
        for (int k0 = 0; k0 < D; k0 += TILE) {
            // stage the centred x tile (BR x TILE) and the W tile (TILE x TILE)
            for (int q = 0; q < RB; ++q) {
                const int rr = r * RB + q;
                const long row = row0 + rr;
                const int k = k0 + j;
                xs[rr][j] = (row < B && k < D) ? LOAD_X(x, row * D + k) - center[k] : (acc_t)0;
            }
            ws[r][j] = (k0 + r < D && n0 + j < D) ? w[(long)(k0 + r) * D + n0 + j] : (acc_t)0;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int kk = 0; kk < TILE; ++kk) {
                const acc_t wkj = ws[kk][j];
                for (int q = 0; q < RB; ++q) acc[q] = fma(xs[r * RB + q][kk], wkj, acc[q]);
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        for (int q = 0; q < RB; ++q) {
            sq[q] = fma(acc[q], acc[q], sq[q]);
            ys[r * RB + q][j] = acc[q];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // fold this column tile of y into the class dot products
        for (int i = lid; i < BR * C; i += TILE * TILE) {
            const int rr = i / C, c = i - rr * C;
            acc_t dot = dots[i];
            for (int jj = 0; jj < TILE && n0 + jj < D; ++jj) dot = fma(ys[rr][jj], class_proj[(long)c * D + n0 + jj], dot);
            dots[i] = dot;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    // ||y||^2 per row: reduce across the column lanes
    for (int q = 0; q < RB; ++q) red[r * RB + q][j] = sq[q];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = TILE / 2; half_size > 0; half_size /= 2) {
        if (j < half_size)
            for (int q = 0; q < RB; ++q) red[r * RB + q][j] += red[r * RB + q][j + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    acc_t row_sq[RB];
    for (int q = 0; q < RB; ++q) row_sq[q] = red[r * RB + q][0];
    barrier(CLK_LOCAL_MEM_FENCE);
    // (min, argmin) over classes: lanes take classes j, j + TILE, ...
    for (int q = 0; q < RB; ++q) {
        const int rr = r * RB + q;
        acc_t best = ACC_INF;
        int best_class = C;
        for (int c = j; c < C; c += TILE) {
            const acc_t distance = row_sq[q] - 2 * dots[rr * C + c] + class_sq[c];
            if (before(distance, c, best, best_class)) { best = distance; best_class = c; }
        }
        red[rr][j] = best;
        red_index[rr][j] = best_class;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = TILE / 2; half_size > 0; half_size /= 2) {
        if (j < half_size) {
            for (int q = 0; q < RB; ++q) {
                const int rr = r * RB + q;
                if (before(red[rr][j + half_size], red_index[rr][j + half_size], red[rr][j], red_index[rr][j])) {
                    red[rr][j] = red[rr][j + half_size];
                    red_index[rr][j] = red_index[rr][j + half_size];
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (j == 0) {
        for (int q = 0; q < RB; ++q) {
            const long row = row0 + r * RB + q;
            if (row < B) {
                const acc_t d = red[r * RB + q][0];
                score[row] = d < 0 ? (acc_t)0 : d;  // not fmax: a NaN score stays NaN
                nearest[row] = red_index[r * RB + q][0];
            }
        }
    }
}

#endif  // MAX_C

// EDM scoring, one fused kernel: the contract of torch_kernels.reference.ood.edm_score_levels.
//
// A work-group of WG work-items owns RB rows and runs the whole denoiser at every noise level for
// them. The hidden state h [RB][H] lives in local memory; each layer's work-items own its output
// columns (j = lid, lid + WG, ...), read the previous layer from local memory and a column of the
// weights from global memory, and meet at a barrier. The output layer's work-items own feature
// columns and fold them straight into each row's error, kept in registers across levels and
// summed over the group at the end. With SCOPED the tangent (one Jacobian-vector product per level)
// rides along in local memory next to each activation.
//
// Build-time macros: X_KIND and ACC_F64 as above, RB (rows per work-group), MAX_H (>= H, sizes the
// local arrays), WG (work-items per group, a power of two), SCOPED (0: "denoise", 1: "scoped").

#ifdef MAX_H

static acc_t silu_and_slope(acc_t h, acc_t *slope) {
    const acc_t gate = (acc_t)1 / ((acc_t)1 + exp(-h));
    *slope = gate * ((acc_t)1 + h * ((acc_t)1 - gate));
    return h * gate;
}

// act = silu(h) and its tangent tact = silu'(h) th, for this work-item's columns of every row
static void activate(__local acc_t (*h)[MAX_H], __local acc_t (*th)[MAX_H], __local acc_t (*act)[MAX_H],
                     __local acc_t (*tact)[MAX_H], int lid, int H) {
    for (int j = lid; j < H; j += WG) {
        for (int q = 0; q < RB; ++q) {
            acc_t slope;
            act[q][j] = silu_and_slope(h[q][j], &slope);
#if SCOPED
            tact[q][j] = slope * th[q][j];
#endif
        }
    }
}

// One output column of a GEMM over the hidden width for every row: out[q] = bias + src[q] . w[: stride],
// and the tangent's tout[q] = tsrc[q] . w[: stride] (w points at the column's first weight)
static void column(__local acc_t (*src)[MAX_H], __local acc_t (*tsrc)[MAX_H], __global const acc_t *w, long stride,
                   int H, acc_t bias, acc_t *out, acc_t *tout) {
    for (int q = 0; q < RB; ++q) out[q] = bias, tout[q] = 0;
    for (int i = 0; i < H; ++i) {
        const acc_t wi = w[(long)i * stride];
        for (int q = 0; q < RB; ++q) {
            out[q] = fma(src[q][i], wi, out[q]);
#if SCOPED
            tout[q] = fma(tsrc[q][i], wi, tout[q]);
#endif
        }
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void edm_score_levels(__global const x_t *x, __global const acc_t *mean, __global const acc_t *inv_scale,
                      __global const acc_t *coef, __global const acc_t *noise, __global const acc_t *level_weights,
                      __global const acc_t *level_bias, __global const acc_t *w_in, __global const acc_t *w1,
                      __global const acc_t *b1, __global const acc_t *w2, __global const acc_t *b2,
                      __global const acc_t *w_out, __global const acc_t *b_out, __global acc_t *score,
                      int B, int D, int H, int L, int K) {
    __local acc_t h[RB][MAX_H], act[RB][MAX_H], inner[RB][MAX_H];
#if SCOPED
    __local acc_t th[RB][MAX_H], tact[RB][MAX_H], tinner[RB][MAX_H];  // tangents of the three
#else
    __local acc_t (*th)[MAX_H] = h, (*tact)[MAX_H] = act, (*tinner)[MAX_H] = inner;  // never read
#endif
    __local acc_t red[RB][WG];

    const int lid = get_local_id(0);
    const long row0 = (long)get_group_id(0) * RB;
    acc_t total[RB];
    for (int q = 0; q < RB; ++q) total[q] = 0;

    for (int l = 0; l < L; ++l) {
        const acc_t sigma = coef[4 * l], c_in = coef[4 * l + 1], c_skip = coef[4 * l + 2], c_out = coef[4 * l + 3];
        // input layer: h = c_in (y [+ sigma n]) @ w_in + level_bias; the tangent's input is c_in n
        for (int j = lid; j < H; j += WG) {
            acc_t acc[RB];
            for (int q = 0; q < RB; ++q) acc[q] = 0;
            acc_t tacc = 0;
            for (int d = 0; d < D; ++d) {
                const acc_t w = w_in[(long)d * H + j], n = noise[(long)l * D + d];
                for (int q = 0; q < RB; ++q) {
                    const long row = row0 + q;
                    const acc_t y = row < B ? (LOAD_X(x, row * D + d) - mean[d]) * inv_scale[d] : (acc_t)0;
                    acc[q] = fma(SCOPED ? c_in * y : c_in * (y + sigma * n), w, acc[q]);
                }
                tacc = fma(c_in * n, w, tacc);
            }
            for (int q = 0; q < RB; ++q) {
                h[q][j] = acc[q] + level_bias[(long)l * H + j];
#if SCOPED
                th[q][j] = tacc;
#endif
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // residual blocks: h += silu(silu(h) @ w1[k] + b1[k]) @ w2[k] + b2[k]
        for (int k = 0; k < K; ++k) {
            const long wk = (long)k * H * H;
            activate(h, th, act, tact, lid, H);
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int j = lid; j < H; j += WG) {
                acc_t z[RB], tz[RB];
                column(act, tact, w1 + wk + j, H, H, b1[(long)k * H + j], z, tz);
                for (int q = 0; q < RB; ++q) {
                    acc_t slope;
                    inner[q][j] = silu_and_slope(z[q], &slope);
#if SCOPED
                    tinner[q][j] = slope * tz[q];
#endif
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int j = lid; j < H; j += WG) {
                acc_t update[RB], tupdate[RB];
                column(inner, tinner, w2 + wk + j, H, H, b2[(long)k * H + j], update, tupdate);
                for (int q = 0; q < RB; ++q) {
                    h[q][j] += update[q];
#if SCOPED
                    th[q][j] += tupdate[q];
#endif
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        activate(h, th, act, tact, lid, H);
        barrier(CLK_LOCAL_MEM_FENCE);
        // output layer F = silu(h) @ w_out + b_out, folded into each row's error column by column
        const acc_t weight = level_weights[l];
        for (int d = lid; d < D; d += WG) {
            const acc_t n = noise[(long)l * D + d];
            acc_t f[RB], tf[RB];
            column(act, tact, w_out + d, D, H, b_out[d], f, tf);
            for (int q = 0; q < RB; ++q) {
                const long row = row0 + q;
                const acc_t y = row < B ? (LOAD_X(x, row * D + d) - mean[d]) * inv_scale[d] : (acc_t)0;
#if SCOPED
                const acc_t residual = c_skip * y + c_out * f[q] - y;
                total[q] += weight * (residual * residual / (sigma * sigma) + c_out * tf[q] * n + (c_skip - 1) * n * n);
#else
                const acc_t residual = c_skip * (y + sigma * n) + c_out * f[q] - y;
                total[q] += weight * residual * residual;
#endif
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // the next level overwrites h and act
    }
    // each row's score: the sum of its work-items' feature columns
    for (int q = 0; q < RB; ++q) red[q][lid] = total[q];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = WG / 2; half_size > 0; half_size /= 2) {
        if (lid < half_size)
            for (int q = 0; q < RB; ++q) red[q][lid] += red[q][lid + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < RB && row0 + lid < B) score[row0 + lid] = red[lid][0];
}

#endif  // MAX_H
