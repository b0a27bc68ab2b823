// Mahalanobis scoring, one fused kernel: the contract of torch_kernels.reference.ood.mahalanobis_min.
//
// A work-group of GROUP work-items owns ROWS rows. It stages the centred rows in local memory,
// computes y = (x - center) @ W column by column (work-items take columns, so reads of W are
// contiguous across them), keeps y in local memory for the class dot products, and reduces
// ||y||^2 and the (min, argmin) over classes across the group. y never goes to global memory.
//
// Build-time macros: X_KIND (0 float32, 1 float64, 2 float16, 3 bfloat16), ACC_F64 (accumulate
// in double), ROWS, GROUP (a power of two), MAX_D (>= D, sizes the local arrays).

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

__kernel __attribute__((reqd_work_group_size(GROUP, 1, 1)))
void mahalanobis_min(__global const x_t *x, __global const acc_t *center, __global const acc_t *w,
                     __global const acc_t *class_proj, __global const acc_t *class_sq,
                     __global acc_t *score, __global long *nearest, int B, int D, int C) {
    __local acc_t xc[ROWS * MAX_D];
    __local acc_t y[ROWS * MAX_D];
    __local acc_t red[ROWS * GROUP];
    __local int red_index[ROWS * GROUP];

    const int lid = get_local_id(0);
    const long row0 = (long)get_group_id(0) * ROWS;

    for (int i = lid; i < ROWS * D; i += GROUP) {
        const int r = i / D, k = i - r * D;
        const long row = row0 + r;
        xc[i] = row < B ? LOAD_X(x, row * D + k) - center[k] : (acc_t)0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    acc_t sq[ROWS];
    for (int r = 0; r < ROWS; ++r) sq[r] = 0;
    for (int j = lid; j < D; j += GROUP) {
        acc_t acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = 0;
        for (int k = 0; k < D; ++k) {
            const acc_t wkj = w[(long)k * D + j];
            for (int r = 0; r < ROWS; ++r) acc[r] = fma(xc[r * D + k], wkj, acc[r]);
        }
        for (int r = 0; r < ROWS; ++r) {
            y[r * D + j] = acc[r];
            sq[r] = fma(acc[r], acc[r], sq[r]);
        }
    }
    for (int r = 0; r < ROWS; ++r) red[r * GROUP + lid] = sq[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size /= 2) {
        if (lid < half_size)
            for (int r = 0; r < ROWS; ++r) red[r * GROUP + lid] += red[r * GROUP + lid + half_size];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int r = 0; r < ROWS; ++r) sq[r] = red[r * GROUP];
    barrier(CLK_LOCAL_MEM_FENCE);  // red is reused below

    acc_t best[ROWS];
    int best_class[ROWS];
    for (int r = 0; r < ROWS; ++r) { best[r] = ACC_INF; best_class[r] = C; }
    for (int c = lid; c < C; c += GROUP) {
        acc_t dot[ROWS];
        for (int r = 0; r < ROWS; ++r) dot[r] = 0;
        for (int j = 0; j < D; ++j) {
            const acc_t p = class_proj[(long)c * D + j];
            for (int r = 0; r < ROWS; ++r) dot[r] = fma(y[r * D + j], p, dot[r]);
        }
        for (int r = 0; r < ROWS; ++r) {
            const acc_t distance = sq[r] - 2 * dot[r] + class_sq[c];
            if (before(distance, c, best[r], best_class[r])) { best[r] = distance; best_class[r] = c; }
        }
    }
    for (int r = 0; r < ROWS; ++r) { red[r * GROUP + lid] = best[r]; red_index[r * GROUP + lid] = best_class[r]; }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int half_size = GROUP / 2; half_size > 0; half_size /= 2) {
        if (lid < half_size) {
            for (int r = 0; r < ROWS; ++r) {
                const int a = r * GROUP + lid, b = a + half_size;
                if (before(red[b], red_index[b], red[a], red_index[a])) { red[a] = red[b]; red_index[a] = red_index[b]; }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < ROWS && row0 + lid < B) {
        const acc_t d = red[lid * GROUP];
        score[row0 + lid] = d < 0 ? (acc_t)0 : d;  // not fmax: a NaN score stays NaN
        nearest[row0 + lid] = red_index[lid * GROUP];
    }
}
