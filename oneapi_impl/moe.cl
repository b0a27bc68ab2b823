// Mixture of experts: the contract of torch_kernels.reference.moe (its module docstring).
//
// Build-time macros:
//   A_KIND  the left GEMM operand, and every activation-like input: x, h, dy, router logits
//           (0 float32, 1 float16, 2 bfloat16)
//   W_KIND  expert weights: 0-2 as A_KIND, 4 float8_e4m3fn (dequantized here with float32 scales)
//   TM      rows of a GEMM tile: 4 (decode: about one token per expert), 16 or 64 (prefill)
// Output and combine-input dtypes are runtime kinds (0-2): they are touched once per element, and
// one build then serves every out_dtype and fused_moe's float32 intermediate.
//
// GEMM tiles: a WY x WX work-group (256 work-items) owns TM rows x TN columns, each work-item RM
// rows (strided by WY) x RN columns (strided by WX), so work-items next in dimension 0 read next
// columns of the local B tile and the same A element. K goes in steps of TK through the local
// tiles As [TK][TM] and Bs [TK][TN]. Row tiles never straddle experts: expert e owns tiles
// tile_ends[e-1] .. tile_ends[e] (ceil(rows_e / TM) each, the host's cumulative counts; the host
// passes only the experts that have rows, with their weights).
//
// Ranges below are OpenCL's, dimension 0 first (the host lists them slowest first, as SYCL does).
// Divisions are unsigned: signed quotient-remainder pairs make clang -O2 emit `freeze`, which
// llvm-spirv 14 cannot translate.


#define WY (TM < 16 ? TM : 16)  // work-items along a tile's rows (OpenCL dimension 1)
#define WX (256 / WY)             // and along its columns (dimension 0)
#define GROUP (WX * WY)
#define TN (WX < 64 ? 64 : WX)
#define TK 32
#define RM (TM / WY)
#define RN (TN / WX)
// Local tile rows are one longer than the tile: the loads write down columns, which then fall in
// different local-memory banks on a GPU.
#define TM_PAD (TM + 1)
#define TN_PAD (TN + 1)

typedef CAT(TYPE_, A_KIND) a_t;
typedef CAT(TYPE_, W_KIND) w_t;

static float load_kind(int kind, __global const void *p, ulong i) {
    if (kind == 1) return vload_half(i, (__global const half *)p);
    if (kind == 2) return as_float((uint)((__global const ushort *)p)[i] << 16);
    return ((__global const float *)p)[i];
}

static void store_kind(int kind, __global void *p, ulong i, float x) {
    if (kind == 1) vstore_half_rte(x, i, (__global half *)p);
    else if (kind == 2) ((__global ushort *)p)[i] = encode_bf16(x);
    else ((__global float *)p)[i] = x;
}

// ---- weights ---------------------------------------------------------------------------------

// How to read expert e's [N, K] matrix (row n = output channel) from w and its scales.
typedef struct {
    int transposed;  // 1: stored [E, N, K]; 0: stored [E, K, N]
    int scale_mode;  // 0 none, 1 per output channel [E, N], 2 per (bn, bk) block
    int bn, bk;      // block shape (scale_mode 2)
} weight_t;

// Bs[kk][j] = weight (n0 + j, k0 + kk) of expert e, zero outside the matrix, as
// reference.dequantize_weights computes it (entry * scale in float32). Always inlined with
// constant `transposed` and `scale_mode`, so that each layout gets a loop of its own.
static inline __attribute__((always_inline)) void load_weight_tile_as(
        __local float (*Bs)[TN_PAD], __global const w_t *w, __global const float *scale, uint e, uint n0, uint k0,
        uint N, uint K, uint n_end, const int transposed, const int scale_mode, uint bn, uint bk) {
    __global const w_t *we = w + (ulong)e * N * K;
    const uint kb = (K + bk - 1) / bk;
    __global const float *se = scale + (scale_mode == 1 ? (ulong)e * N : (ulong)e * ((N + bn - 1) / bn) * kb);
    for (uint i = get_local_id(1) * WX + get_local_id(0); i < TK * TN; i += GROUP) {
        // consecutive work-items read along the stored contiguous axis
        const uint kk = transposed ? i % TK : i / TN, j = transposed ? i / TK : i % TN;
        const uint n = n0 + j, k = k0 + kk;
        float v = 0.0f;
        if (n < n_end && k < K) {
            v = LOAD(W_KIND, we, transposed ? (ulong)n * K + k : (ulong)k * N + n);
            if (scale_mode == 1) v *= se[n];
            if (scale_mode == 2) v *= se[(n / bn) * kb + k / bk];
        }
        Bs[kk][j] = v;
    }
}

static void load_weight_tile(__local float (*Bs)[TN_PAD], __global const w_t *w, __global const float *scale,
                             weight_t f, uint e, uint n0, uint k0, uint N, uint K, uint n_end) {
#define LOAD_WEIGHTS(transposed, mode) \
    load_weight_tile_as(Bs, w, scale, e, n0, k0, N, K, n_end, transposed, mode, f.bn, f.bk)
#if W_KIND == 4  // fp8 weights come only from fused_moe: stored [E, N, K], always with scales
    if (f.scale_mode == 2) LOAD_WEIGHTS(1, 2);
    else LOAD_WEIGHTS(1, 1);
#else
    if (f.transposed) LOAD_WEIGHTS(1, 0);
    else LOAD_WEIGHTS(0, 0);
#endif
#undef LOAD_WEIGHTS
}

// ---- row tiles -------------------------------------------------------------------------------

typedef struct {
    uint expert;
    long row0, row_end;  // the tile's first row and its expert's end
} tile_t;

// Row tile `tile` of the launch: its expert by binary search of the cumulative tile counts.
static tile_t find_tile(__global const long *offsets, __global const long *tile_ends, int E, long tile) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (tile_ends[mid] > tile) hi = mid;
        else lo = mid + 1;
    }
    tile_t t;
    t.expert = lo;
    const long first_tile = lo ? tile_ends[lo - 1] : 0, first_row = lo ? offsets[lo - 1] : 0;
    t.row0 = first_row + (tile - first_tile) * TM;
    t.row_end = offsets[lo];
    return t;
}

// As[kk][m] = a[row(row0 + m)][k0 + kk], zero past the tile's rows or K; row() is token_of_row
// when gathering from the tokens, else the identity.
static void load_row_tile(__local float (*As)[TM_PAD], __global const a_t *a, __global const long *token_of_row,
                          tile_t t, uint k0, uint K) {
    const uint lid = get_local_id(1) * WX + get_local_id(0);
    for (uint i = lid; i < TK * TM; i += GROUP) {
        const uint m = i / TK, kk = i % TK;
        const long r = t.row0 + m;
        long src = r;
        if (token_of_row && r < t.row_end) src = token_of_row[r];
        const bool real = r < t.row_end && k0 + kk < K && src >= 0;
        As[kk][m] = real ? LOAD(A_KIND, a, (ulong)src * K + k0 + kk) : 0.0f;
    }
}

// acc[i][j] += sum_kk As[kk][ty + WY i] Bs[kk][tx + WX j]
static void multiply_tiles(__local float (*As)[TM_PAD], __local float (*Bs)[TN_PAD], float acc[RM][RN]) {
    const uint tx = get_local_id(0), ty = get_local_id(1);
    for (uint kk = 0; kk < TK; ++kk) {
        float b[RN];
        for (uint j = 0; j < RN; ++j) b[j] = Bs[kk][tx + WX * j];
        for (uint i = 0; i < RM; ++i) {
            const float a = As[kk][ty + WY * i];
            for (uint j = 0; j < RN; ++j) acc[i][j] = fma(a, b[j], acc[i][j]);
        }
    }
}

// Where this work-item's accumulator (i, j) of tile t, columns n0.., lands in a row-major output
// `width` wide: its element index, or -1 past the expert's rows or the width.
static long tile_output_index(tile_t t, uint n0, uint i, uint j, uint width) {
    const long r = t.row0 + get_local_id(1) + WY * i;
    const uint n = n0 + get_local_id(0) + WX * j;
    return r < t.row_end && n < width ? r * width + n : -1;
}

// ---- grouped_mm ------------------------------------------------------------------------------

// out[r] = a[r] @ W_e for the rows r of expert e, float32 accumulation; out rows past the last
// expert are the host's (zeros). Range: (column tiles * WX, row tiles * WY), local (WX, WY).
__kernel void grouped_mm(__global const a_t *a, __global const w_t *w, __global const float *scale,
                         __global const long *offsets, __global const long *tile_ends, __global void *out,
                         int E, int N, int K, int transposed, int scale_mode, int bn, int bk, int out_kind) {
    __local float As[TK][TM_PAD];
    __local float Bs[TK][TN_PAD];
    const tile_t t = find_tile(offsets, tile_ends, E, get_group_id(1));
    const uint n0 = get_group_id(0) * TN;
    const weight_t f = {transposed, scale_mode, bn, bk};
    float acc[RM][RN];
    for (uint i = 0; i < RM; ++i)
        for (uint j = 0; j < RN; ++j) acc[i][j] = 0.0f;
    for (uint k0 = 0; k0 < (uint)K; k0 += TK) {
        load_row_tile(As, a, 0, t, k0, K);
        load_weight_tile(Bs, w, scale, f, t.expert, n0, k0, N, K, N);
        barrier(CLK_LOCAL_MEM_FENCE);
        multiply_tiles(As, Bs, acc);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (uint i = 0; i < RM; ++i)
        for (uint j = 0; j < RN; ++j) {
            const long o = tile_output_index(t, n0, i, j, N);
            if (o >= 0) store_kind(out_kind, out, o, acc[i][j]);
        }
}

// ---- grouped_mm_weight_grad --------------------------------------------------------------------

// out[e] = a_e^T dy_e ([K, N]) over expert e's rows, zero for an expert with no rows.
// Range: (N tiles * WX, K tiles * WY, E), local (WX, WY, 1); tile rows here run along K.
__kernel void grouped_mm_weight_grad(__global const a_t *a, __global const a_t *dy, __global const long *offsets,
                                     __global void *out, int K, int N, int out_kind) {
    __local float As[TK][TM_PAD];
    __local float Bs[TK][TN_PAD];
    const uint e = get_group_id(2), k0 = get_group_id(1) * TM, n0 = get_group_id(0) * TN;
    const long start = e ? offsets[e - 1] : 0, end = offsets[e];
    const uint lid = get_local_id(1) * WX + get_local_id(0);
    float acc[RM][RN];
    for (uint i = 0; i < RM; ++i)
        for (uint j = 0; j < RN; ++j) acc[i][j] = 0.0f;
    for (long r0 = start; r0 < end; r0 += TK) {
        for (uint i = lid; i < TK * TM; i += GROUP) {
            const uint rr = i / TM, m = i % TM;
            const bool real = r0 + rr < end && k0 + m < (uint)K;
            As[rr][m] = real ? LOAD(A_KIND, a, (ulong)(r0 + rr) * K + k0 + m) : 0.0f;
        }
        for (uint i = lid; i < TK * TN; i += GROUP) {
            const uint rr = i / TN, j = i % TN;
            const bool real = r0 + rr < end && n0 + j < (uint)N;
            Bs[rr][j] = real ? LOAD(A_KIND, dy, (ulong)(r0 + rr) * N + n0 + j) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        multiply_tiles(As, Bs, acc);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const uint tx = get_local_id(0), ty = get_local_id(1);
    for (uint i = 0; i < RM; ++i) {
        const uint k = k0 + ty + WY * i;
        if (k >= (uint)K) continue;
        for (uint j = 0; j < RN; ++j) {
            const uint n = n0 + tx + WX * j;
            if (n < (uint)N) store_kind(out_kind, out, ((ulong)e * K + k) * N + n, acc[i][j]);
        }
    }
}

// ---- fused_moe: gate/up GEMM with the activation in its epilogue ----------------------------------

#define SWIGLUOAI_ALPHA 1.702f
#define SWIGLUOAI_LIMIT 7.0f

static float sigmoid(float x) {
    return 1.0f / (1.0f + exp(-x));
}

// reference.activate on one (gate, up) pair: 0 silu, 1 gelu (erf), 2 swigluoai
static float activate(float gate, float up, int activation) {
    if (activation == 0) return gate / (1.0f + exp(-gate)) * up;
    if (activation == 1) return 0.5f * gate * (1.0f + erf(gate * M_SQRT1_2_F)) * up;
    gate = gate > SWIGLUOAI_LIMIT ? SWIGLUOAI_LIMIT : gate;  // comparisons keep a NaN, as torch's clamp
    up = up > SWIGLUOAI_LIMIT ? SWIGLUOAI_LIMIT : up < -SWIGLUOAI_LIMIT ? -SWIGLUOAI_LIMIT : up;
    return (up + 1.0f) * gate * sigmoid(SWIGLUOAI_ALPHA * gate);
}

// h[r] = activate(w13_e x[token_of_row[r]]) rounded to x's dtype, for the routed rows r; gate
// columns j and up columns I + j of w13 [E, 2I, H] go into two accumulators of one work-item.
// Range: (column tiles of I * WX, row tiles * WY), local (WX, WY).
__kernel void gate_up(__global const a_t *x, __global const w_t *w13, __global const float *scale,
                      __global const long *token_of_row, __global const long *offsets, __global const long *tile_ends,
                      __global a_t *h, int E, int I, int H, int scale_mode, int bn, int bk, int activation) {
    __local float As[TK][TM_PAD];
    __local float Gs[TK][TN_PAD];
    __local float Us[TK][TN_PAD];
    const tile_t t = find_tile(offsets, tile_ends, E, get_group_id(1));
    const uint n0 = get_group_id(0) * TN;
    const weight_t f = {1, scale_mode, bn, bk};
    float gate[RM][RN], up[RM][RN];
    for (uint i = 0; i < RM; ++i)
        for (uint j = 0; j < RN; ++j) gate[i][j] = up[i][j] = 0.0f;
    for (uint k0 = 0; k0 < (uint)H; k0 += TK) {
        load_row_tile(As, x, token_of_row, t, k0, H);
        load_weight_tile(Gs, w13, scale, f, t.expert, n0, k0, 2 * I, H, I);
        load_weight_tile(Us, w13, scale, f, t.expert, I + n0, k0, 2 * I, H, 2 * I);
        barrier(CLK_LOCAL_MEM_FENCE);
        multiply_tiles(As, Gs, gate);
        multiply_tiles(As, Us, up);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (uint i = 0; i < RM; ++i)
        for (uint j = 0; j < RN; ++j) {
            const long o = tile_output_index(t, n0, i, j, I);
            if (o >= 0) STORE(A_KIND, h, o, activate(gate[i][j], up[i][j], activation));
        }
}

// ---- dispatch and combine ----------------------------------------------------------------------

// out[r] = x[token_of_row[r]] bit for bit, zero where it is -1; rows as 16-bit units.
// Range: (row units, R).
__kernel void moe_gather(__global const ushort *x, __global const long *token_of_row, __global ushort *out,
                         int row_units) {
    const ulong r = get_global_id(1), u = get_global_id(0);
    const long t = token_of_row[r];
    out[r * row_units + u] = t >= 0 ? x[(ulong)t * row_units + u] : 0;
}

// out[t] = sum_j weights[t, j] * y[row_of_slot[t, j]] in float32 in slot order, dropped slots
// never read. Range: (N, T).
__kernel void moe_combine(__global const void *y, __global const long *row_of_slot, __global const float *weights,
                          __global void *out, int k, int N, int y_kind, int out_kind) {
#pragma OPENCL FP_CONTRACT OFF  // a product, then a sum: the reference's roundings, bit for bit
    const ulong t = get_global_id(1), n = get_global_id(0);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const long r = row_of_slot[t * k + j];
        if (r < 0) continue;
        const float term = weights[t * k + j] * load_kind(y_kind, y, (ulong)r * N + n);
        acc = acc + term;
    }
    store_kind(out_kind, out, t * N + n, acc);
}

// ---- router_topk ------------------------------------------------------------------------------
// The choice rule of reference.router_topk: experts ranked by their logits, or by score + bias
// with a bias; NaN ranks as -inf; equal values go to the lowest index; a row with a NaN logit
// gets NaN weights. Ranked values are never NaN, so NaN marks an expert out of the running (in an
// excluded group).

static float ranked_value(float x) { return isnan(x) ? -INFINITY : x; }

// Next of the ranking after (prev_value, prev_index): the largest value below it, equal values by
// lowest index; the first of the ranking if `first`; -1 if none. NaN positions are skipped.
static int next_largest(__global const float *v, int count, float prev_value, int prev_index, int first) {
    int best = -1;
    float best_value = 0.0f;
    for (int i = 0; i < count; ++i) {
        const float value = v[i];
        const bool after = first || value < prev_value || (value == prev_value && i > prev_index);
        if (!isnan(value) && after && (best < 0 || value > best_value)) {
            best = i;
            best_value = value;
        }
    }
    return best;
}

// One work-item per token. scratch [T, E + G] holds the token's ranked values (NaN outside the
// kept groups) and group scores. Range: (T).
__kernel void router_topk(__global const a_t *logits, __global const float *bias, __global float *scratch,
                          __global float *weights, __global long *ids, int E, int k, int sigmoid_scoring,
                          int has_bias, int renormalize, int groups, int topk_groups, float scaling) {
    const ulong t = get_global_id(0);
    __global const a_t *l = logits + t * E;
    __global float *choice = scratch + t * (ulong)(E + groups);
    __global float *group_score = choice + E;
    float max_logit = -INFINITY, inv_sum = 1.0f;
    if (!sigmoid_scoring) {
        for (int i = 0; i < E; ++i) max_logit = fmax(max_logit, LOAD(A_KIND, l, i));
        float sum = 0.0f;
        for (int i = 0; i < E; ++i) sum += exp(LOAD(A_KIND, l, i) - max_logit);
        inv_sum = 1.0f / sum;
    }
#define SCORE(i) (sigmoid_scoring ? sigmoid(LOAD(A_KIND, l, i)) : exp(LOAD(A_KIND, l, i) - max_logit) * inv_sum)
    // groups are ranked by biased scores, experts by them too with a bias, else by their logits
    const int by_score = has_bias || groups;
    bool nan_row = false;
    for (int i = 0; i < E; ++i) {
        const float x = LOAD(A_KIND, l, i);
        nan_row |= isnan(x);
        choice[i] = ranked_value(by_score ? SCORE(i) + bias[i] : x);
    }
    if (groups) {
        const int size = (int)((uint)E / (uint)groups);
        for (int g = 0; g < groups; ++g) {  // sum of the group's two largest
            const int top = next_largest(choice + g * size, size, 0.0f, 0, 1);
            float s = choice[g * size + top];
            if (size > 1) s += choice[g * size + next_largest(choice + g * size, size, s, top, 0)];
            group_score[g] = ranked_value(s);  // inf + -inf
        }
        for (int g = 0; g < groups; ++g) {
            int rank = 0;  // groups ahead of g
            for (int o = 0; o < groups; ++o)
                rank += group_score[o] > group_score[g] || (group_score[o] == group_score[g] && o < g);
            for (int i = 0; i < size; ++i) {
                __global float *c = choice + g * size + i;
                if (rank >= topk_groups) *c = NAN;
                else if (!has_bias) *c = ranked_value(LOAD(A_KIND, l, g * size + i));
            }
        }
    }
    float total = 0.0f;
    int prev = 0;
    for (int j = 0; j < k; ++j) {
        const int i = next_largest(choice, E, j ? choice[prev] : 0.0f, prev, j == 0);
        const float s = SCORE(i);  // the unbiased score
        ids[t * k + j] = i;
        weights[t * k + j] = s;
        total += s;
        prev = i;
    }
    for (int j = 0; j < k; ++j) {
        const float s = weights[t * k + j];
        weights[t * k + j] = nan_row ? NAN : (renormalize ? s / total : s) * scaling;
    }
#undef SCORE
}
