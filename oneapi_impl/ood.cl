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
