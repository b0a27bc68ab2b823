// Quantized attention (SageAttention's recipe) and the exact attention backward: the contract of
// torch_kernels.reference.quantized_attention (its module docstring fixes every number).
//
// Build-time macros:
//   X_KIND     q, k, v, the output, grad_out and the gradients: 0 float32, 1 float16, 2 bfloat16
//   HEAD_SIZE  D
// Kinds, loads, stores, encode_bf16 and decode_e4m3fn come from dtypes.cl.
//
// Tensors are contiguous [B, H, N, D] (rows of the N axis). The host passes two tables:
//   seqs  int [S][5]: each sequence's batch element, first and end query row, first and end key
//         row (in N's numbering; without cu_seqlens sequence b is batch element b, all of N);
//   tiles int [T][2]: a work-group's sequence and first row (tiles of a sequence start at its
//         first row, so quantization groups and key tiles are counted from the sequence's start).
// Work-groups are (tile, head): OpenCL dimension 0 holds the tiles' work-items, dimension 1 the
// heads. Where a loop runs along work-items and reads neighbouring local or private values (or
// one value for all), a CPU's OpenCL compiler turns work-items into SIMD lanes; a work-item
// keeps RB independent sums, so that no add waits on the one before. Divisions are unsigned:
// signed quotient-remainder pairs make clang -O2 emit `freeze`, which llvm-spirv 14 cannot translate.

// The reference rounds every product and sum on its own: no fused multiply-adds, so that the
// quantized values and the scores are the reference's bit for bit.
#pragma OPENCL FP_CONTRACT OFF

typedef CAT(TYPE_, X_KIND) x_t;

#define QT 128  // query rows of a quantization tile: every query group of the reference lies in one
#define KT 64   // key rows of a quantization tile, and the key tile of the online softmax
#define BM 64   // work-items of an attention work-group: its query rows (its keys in dK/dV)
#define RB 8    // rows (or keys) a work-item takes at once, BM and KT multiples of it
#define COLS ((HEAD_SIZE + BM - 1) / BM)  // output columns of a work-item in the forward's P.V
#if KT != BM
#error "a work-item per key of a tile and per row: KT and BM must agree"
#endif
#define INT8_MAX 127.0f
#define FP8_MAX 448.0f  // the largest finite float8_e4m3fn
#define PV_FP16 0  // pv_mode, the reference's pv_dtype: 0 "fp16", 1 "fp8", 2 "none"
#define PV_FP8 1

// ---- exact rounding --------------------------------------------------------------------------

// The 24-bit significand of a finite nonzero |x| (float32 bits a) and its biased exponent, a
// subnormal normalized: |x| = significand * 2^(exponent - 150).
static ulong significand_of(uint a, int *exponent) {
    const int e = (int)(a >> 23);
    if (e) {
        *exponent = e;
        return (a & 0x7fffffu) | 0x800000u;
    }
    const int shift = clz(a) - 8;
    *exponent = 1 - shift;
    return (ulong)a << shift;
}

// x / s rounded to nearest even (IEEE float32 division, as torch divides): the significands are
// divided in 64-bit integers and the quotient rounded onto the float32 grid (subnormal and
// overflowing results included) from its bits and the remainder, so no device's division
// precision or denormal mode moves a bit.
static float div_rn(float x, float s) {
    const uint ax = as_uint(x) & 0x7fffffffu, as = as_uint(s) & 0x7fffffffu;
    if (ax == 0 || ax >= 0x7f800000u || as == 0 || as >= 0x7f800000u) return x / s;  // zeros, inf, NaN: exact
    const uint sign = (as_uint(x) ^ as_uint(s)) & 0x80000000u;
    int ex, es;
    const ulong numerator = significand_of(ax, &ex) << 40, divisor = significand_of(as, &es);
    const ulong quotient = numerator / divisor, remainder = numerator - quotient * divisor;
    // |x / s| = (quotient + remainder / divisor) * 2^unit, quotient in [2^39, 2^41)
    const int unit = ex - es - 40, length = (quotient >> 40) ? 41 : 40;
    const int biased = length + unit + 126;  // the result's exponent field if normal
    if (biased >= 255) return as_float(sign | 0x7f800000u);
    const int drop = biased >= 1 ? length - 24 : -149 - unit;  // bits below the result's last place
    if (drop >= 64) return as_float(sign);  // under half the smallest subnormal
    const ulong kept = quotient >> drop, rest = quotient & ((1ul << drop) - 1), tie = 1ul << (drop - 1);
    const uint magnitude = (uint)kept + (rest > tie || (rest == tie && (remainder != 0 || (kept & 1))));
    // a normal's implicit bit lands in the exponent field (a carry to the next binade included)
    return as_float(sign | (biased >= 1 ? ((uint)(biased - 1) << 23) + magnitude : magnitude));
}

// float32 -> float8_e4m3fn code, rounded to nearest even, saturated to +-448 (the reference
// clamps to it first; torch's own cast turns values past 464 into NaN); NaN keeps its sign, as
// torch's. e4m3 keeps 3 mantissa bits: in the binade [2^e, 2^(e+1)), e >= -6 (below it the
// subnormals, whose step is that of e = -6), the step is 2^(e-3), so |x| / step is exact and
// rint rounds it to an integer count of steps, half to even; 16 steps carry into the next binade.
static uchar encode_e4m3fn(float x) {
    const uchar sign = (as_uint(x) >> 24) & 0x80;
    if (isnan(x)) return sign | 0x7f;
    const float a = fmin(fabs(x), FP8_MAX);
    const int e = max((int)(as_uint(a) >> 23) - 127, -6);
    const float steps = rint(a * as_float((uint)(130 - e) << 23));  // a * 2^(3 - e)
    return sign | (uchar)(((e + 6) << 3) + (int)steps);
}

static float round_to_f16(float x) {
    ushort h;
    vstore_half_rte(x, 0, (half *)&h);
    return vload_half(0, (const half *)&h);
}

// x rounded to the values of kind X_KIND, as float32
#define ROUND_0(x) (x)
#define ROUND_1(x) round_to_f16(x)
#define ROUND_2(x) as_float((uint)encode_bf16(x) << 16)
#define ROUND_TO_INPUT(x) CAT(ROUND_, X_KIND)(x)

// P as the P.V product reads it (pv_mode: the reference's pv_dtype); fp8 scales it by 448
static float round_p(float p, int pv_mode) {
    if (pv_mode == PV_FP16) return round_to_f16(p);
    if (pv_mode == PV_FP8) return decode_e4m3fn(encode_e4m3fn(p * FP8_MAX));
    return ROUND_TO_INPUT(p);
}

// the larger of m and x, NaN once either is (fmax drops NaN; the reference's max keeps it)
static float max_keeping_nan(float m, float x) {
    return (x > m || isnan(x)) ? x : m;
}

// ---- quantization ----------------------------------------------------------------------------

// The group of row r of its quantization tile, by grouping: 0 the whole tile (queries and keys
// per_block, keys per_warp), 1 queries per_warp (r / 32), 2 queries per_thread (r / 32, r % 8),
// 3 keys per_thread ((r % 8) / 2).
static uint group_of(uint r, int grouping) {
    if (grouping == 1) return r / 32;
    if (grouping == 2) return r / 32 * 8 + r % 8;
    if (grouping == 3) return r % 8 / 2;
    return 0;
}

// x' = (x - mean) * multiplier, computed as the reference does (the mean subtracted first)
static float smoothed(__global const x_t *x, long offset, __global const float *mean, long mean_offset,
                      int has_mean, float multiplier) {
    float y = LOAD(X_KIND, x, offset);
    if (has_mean) y = y - mean[mean_offset];
    return y * multiplier;
}

// int8 values and per-row scales of queries (role 0, tiles of QT rows) or keys (role 1, KT rows):
// per group scale = amax / 127 (1 where 0, inf where the group holds a NaN or inf), entries
// clamp(round_half_even(x' / scale), +-127), NaN stored as 0. Keys pass multiplier 1 (exact).
// NDRange (tiles * tile rows, H), work-groups (tile rows, 1): a work-item per row.
__kernel void quantize_rows(__global const x_t *x, __global const float *mean, __global char *x8,
                            __global float *scale_out, __global const int *seqs, __global const int *tiles,
                            int num_rows, int role, int grouping, float multiplier, int has_mean) {
    __local float row_amax[QT];
    const uint r = get_local_id(0), rows = get_local_size(0);
    const int h = get_group_id(1), num_heads = get_num_groups(1);
    __global const int *tile = tiles + 2 * get_group_id(0);
    __global const int *seq = seqs + 5 * tile[0];
    const int row = tile[1] + r, end = seq[2 + 2 * role];
    const bool real = row < end;
    const long row_index = (long)(seq[0] * num_heads + h) * num_rows + row;
    const long mean_base = ((long)tile[0] * num_heads + h) * HEAD_SIZE;
    float amax = 0.0f;
    bool nan = false;
    if (real) {
        for (int d = 0; d < HEAD_SIZE; ++d) {
            const float y = smoothed(x, row_index * HEAD_SIZE + d, mean, mean_base + d, has_mean, multiplier);
            amax = fmax(amax, fabs(y));
            nan = nan || isnan(y);
        }
    }
    row_amax[r] = nan ? INFINITY : amax;  // rows past the sequence: 0, no part of any group's max
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint group = group_of(r, grouping);
    float group_amax = 0.0f;
    for (uint other = 0; other < rows; ++other)
        if (group_of(other, grouping) == group) group_amax = fmax(group_amax, row_amax[other]);
    if (!real) return;
    const float scale = group_amax > 0.0f ? div_rn(group_amax, INT8_MAX) : 1.0f;
    for (int d = 0; d < HEAD_SIZE; ++d) {
        const float y = div_rn(smoothed(x, row_index * HEAD_SIZE + d, mean, mean_base + d, has_mean, multiplier),
                               scale);
        x8[row_index * HEAD_SIZE + d] = isnan(y) ? 0 : (char)clamp(rint(y), -INT8_MAX, INT8_MAX);
    }
    scale_out[row_index] = scale;
}

// Values of each sequence and kv head in float8_e4m3fn with one scale per channel: scale =
// amax / 448 over the sequence's keys (1 where amax is 0 or NaN), codes e4m3fn(clamp(v / scale,
// +-448)). NDRange (S * 64, Hkv), work-groups (64, 1): work-items over the channels.
__kernel __attribute__((reqd_work_group_size(64, 1, 1)))
void quantize_values_fp8(__global const x_t *v, __global uchar *v8, __global float *v_scale,
                         __global const int *seqs, int num_rows) {
    const int s = get_group_id(0), h = get_group_id(1), num_heads = get_num_groups(1);
    __global const int *seq = seqs + 5 * s;
    const long head_base = ((long)seq[0] * num_heads + h) * num_rows;
    for (uint d = get_local_id(0); d < HEAD_SIZE; d += 64) {
        float amax = 0.0f;
        bool nan = false;
        for (int j = seq[3]; j < seq[4]; ++j) {
            const float y = LOAD(X_KIND, v, (head_base + j) * HEAD_SIZE + d);
            amax = fmax(amax, fabs(y));
            nan = nan || isnan(y);
        }
        const float scale = amax > 0.0f && !nan ? div_rn(amax, FP8_MAX) : 1.0f;
        for (int j = seq[3]; j < seq[4]; ++j) {
            const long offset = (head_base + j) * HEAD_SIZE + d;
            v8[offset] = encode_e4m3fn(div_rn(LOAD(X_KIND, v, offset), scale));  // saturating: the clamp
        }
        v_scale[((long)s * num_heads + h) * HEAD_SIZE + d] = scale;
    }
}

// ---- forward ---------------------------------------------------------------------------------

// Where a work-group of query rows is: its sequence, its rows and the keys they see.
typedef struct {
    int seq, batch, q0, q1, k0, k1;  // sequence, batch element, query rows [q0, q1), key rows [k0, k1)
    int start, rows;                 // the tile's first query row and how many of its rows are real
    int key_end;                     // keys [0, key_end) of the sequence that some row of the tile sees
} place_t;

static place_t find_place(__global const int *seqs, __global const int *tiles, int causal) {
    place_t p;
    __global const int *tile = tiles + 2 * get_group_id(0);
    __global const int *seq = seqs + 5 * tile[0];
    p.seq = tile[0];
    p.batch = seq[0];
    p.q0 = seq[1];
    p.q1 = seq[2];
    p.k0 = seq[3];
    p.k1 = seq[4];
    p.start = tile[1];
    p.rows = min(BM, p.q1 - p.start);
    const int nk = p.k1 - p.k0, last = p.start + p.rows - 1 - p.q0;
    // bottom-right causal: key j is visible from query i iff j <= i + Nk - Nq
    p.key_end = causal ? clamp(last + nk - (p.q1 - p.q0) + 1, 0, nk) : nk;
    return p;
}

// whether row r of the tile sees key j (both counted from the sequence's first)
static bool visible(place_t p, int causal, int r, int j) {
    return !causal || j <= p.start - p.q0 + r + (p.k1 - p.k0) - (p.q1 - p.q0);
}

// The quantized forward. A work-group owns BM query rows of one head; per key tile of KT (the
// reference's tiles, counted from the sequence's first key; tiles past the last row's diagonal
// are skipped), with its int8 keys, scales, key bias and V (as P.V reads it) staged in local memory:
//   a. a work-item per key: s = (float(q8 . k8) * q_scale) * k_scale + key_bias (int32 dot,
//      exact), -inf where masked
//   b. a work-item per row: m' = max(m, s), p = exp2(s - m'), l = l exp2(m - m') + sum p, and P
//      rounded as P.V reads it
//   c. a work-item per output column (lid, lid + BM, ...): acc = acc exp2(m - m') + P V, float32
// then out = acc / l (* v_scale / 448 for fp8) and lse = ln 2 (m + log2 l) + sm_scale q . k_mean.
// NDRange (tiles * BM, Hq), work-groups (BM, 1).
__kernel __attribute__((reqd_work_group_size(BM, 1, 1)))
void attention_forward(__global const char *q8, __global const float *q_scale, __global const char *k8,
                       __global const float *k_scale, __global const x_t *v, __global const uchar *v8,
                       __global const float *v_scale, __global const float *key_bias,
                       __global const float *k_mean, __global const x_t *q, __global x_t *out,
                       __global float *lse, __global const int *seqs, __global const int *tiles,
                       int nq_rows, int nk_rows, int num_kv_heads, float sm_scale, int causal, int pv_mode,
                       int has_bias, int has_mean) {
    __local char q8s[BM][HEAD_SIZE];
    __local char k8t[HEAD_SIZE][KT];  // transposed: phase a's work-items read along the keys
    __local float vs[KT][HEAD_SIZE];
    __local float ps[KT][BM + 1];     // scores, then P, of (key, row); + 1: no bank conflicts in phase a on a GPU
    __local float q_scales[BM], k_scales[KT], biases[KT], rescales[BM], sums[BM];

    const uint lid = get_local_id(0);
    const int h = get_group_id(1), num_heads = get_num_groups(1);
    const int kv_head = (int)((uint)h / ((uint)num_heads / (uint)num_kv_heads));
    const place_t p = find_place(seqs, tiles, causal);
    const long row0 = (long)(p.batch * num_heads + h) * nq_rows + p.start;  // the tile's first row of q, out, lse
    const long kv_rows = (long)(p.batch * num_kv_heads + kv_head) * nk_rows + p.k0;  // key 0 of k, v
    const long bias_row = (long)(p.batch * num_heads + h) * nk_rows + p.k0;

    for (uint idx = lid; idx < BM * HEAD_SIZE; idx += BM) {
        const uint r = idx / HEAD_SIZE;
        q8s[r][idx - r * HEAD_SIZE] = r < (uint)p.rows ? q8[row0 * HEAD_SIZE + idx] : 0;
    }
    q_scales[lid] = lid < (uint)p.rows ? q_scale[row0 + lid] : 0.0f;
    rescales[lid] = 0.0f;  // rows past the tile's end keep it: phase c computes them, nothing reads them
    float m = -INFINITY, l = 0.0f;  // of row lid
    float acc[BM][COLS];            // rows x columns lid + BM t
    for (int r = 0; r < BM; ++r)
        for (int t = 0; t < COLS; ++t) acc[r][t] = 0.0f;

    for (int j0 = 0; j0 < p.key_end; j0 += KT) {
        const int n = min(KT, p.k1 - p.k0 - j0);  // the reference's whole tile, masked keys included
        for (uint idx = lid; idx < KT * HEAD_SIZE; idx += BM) {
            const uint c = idx / HEAD_SIZE, d = idx - c * HEAD_SIZE;
            const long offset = (kv_rows + j0) * HEAD_SIZE + idx;
            const bool key = c < (uint)n;
            k8t[d][c] = key ? k8[offset] : 0;
            float value = 0.0f;
            if (key) {
                if (pv_mode == PV_FP8) value = decode_e4m3fn(v8[offset]);
                else if (pv_mode == PV_FP16) value = round_to_f16(LOAD(X_KIND, v, offset));
                else value = LOAD(X_KIND, v, offset);
            }
            vs[c][d] = value;
        }
        k_scales[lid] = lid < (uint)n ? k_scale[kv_rows + j0 + lid] : 0.0f;
        biases[lid] = lid < (uint)n && has_bias ? key_bias[bias_row + j0 + lid] : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);

        for (int r0 = 0; r0 < p.rows; r0 += RB) {  // a: work-item lid is key j0 + lid
            int dot[RB];  // RB rows at once: independent sums hide the multiply's latency
            for (int i = 0; i < RB; ++i) dot[i] = 0;
            for (int d = 0; d < HEAD_SIZE; ++d) {
                const int key = k8t[d][lid];
                for (int i = 0; i < RB; ++i) dot[i] += (int)q8s[r0 + i][d] * key;
            }
            for (int i = 0; i < RB; ++i) {
                float s = ((float)dot[i] * q_scales[r0 + i]) * k_scales[lid];
                if (has_bias) s = s + biases[lid];
                ps[lid][r0 + i] = visible(p, causal, r0 + i, j0 + (int)lid) ? s : -INFINITY;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        if (lid < (uint)p.rows) {  // b: work-item lid is row lid
            float m_new = m;
            for (int c = 0; c < n; ++c) m_new = max_keeping_nan(m_new, ps[c][lid]);
            const float m_safe = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: exp2(-inf) = 0
            const float rescale = exp2(m - m_safe);
            float sum = 0.0f;
            for (int c = 0; c < n; ++c) {
                const float prob = exp2(ps[c][lid] - m_safe);
                sum += prob;
                ps[c][lid] = round_p(prob, pv_mode);
            }
            l = l * rescale + sum;
            m = m_new;
            rescales[lid] = rescale;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        for (int t = 0; t < COLS; ++t) {  // c: work-item lid owns columns lid + BM t
            const uint d = lid + BM * t;
            if (d >= HEAD_SIZE) break;
            for (int r0 = 0; r0 < p.rows; r0 += RB) {
                float pv[RB];
                for (int i = 0; i < RB; ++i) pv[i] = 0.0f;
                for (int c = 0; c < n; ++c) {
                    const float value = vs[c][d];
                    for (int i = 0; i < RB; ++i) pv[i] += ps[c][r0 + i] * value;
                }
                for (int i = 0; i < RB; ++i) acc[r0 + i][t] = acc[r0 + i][t] * rescales[r0 + i] + pv[i];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // before the next tile overwrites the staged one
    }

    if (lid < (uint)p.rows) {
        const long row = row0 + lid;
        sums[lid] = l;
        float row_lse = (m + log2(l)) * M_LN2_F;
        if (p.k1 == p.k0) {
            row_lse = -INFINITY;  // nothing to attend to (the reference skips the sequence)
        } else if (has_mean) {  // smoothing shifted every score of the row by sm_scale q . k_mean
            const long mean_base = ((long)p.seq * num_kv_heads + kv_head) * HEAD_SIZE;
            float dot = 0.0f;
            for (int d = 0; d < HEAD_SIZE; ++d) dot += LOAD(X_KIND, q, row * HEAD_SIZE + d) * k_mean[mean_base + d];
            row_lse = row_lse + sm_scale * dot;
        }
        lse[row] = row_lse;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const long v_scale_base = ((long)p.seq * num_kv_heads + kv_head) * HEAD_SIZE;
    for (int t = 0; t < COLS; ++t) {
        const uint d = lid + BM * t;
        if (d >= HEAD_SIZE) break;
        const float o_scale = pv_mode == PV_FP8 ? div_rn(v_scale[v_scale_base + d], FP8_MAX) : 1.0f;
        for (int r = 0; r < p.rows; ++r) {
            // a row with no key has acc = 0 and l = 0; NaN stays NaN
            float o = acc[r][t] / (sums[r] == 0.0f ? 1.0f : sums[r]);
            if (pv_mode == PV_FP8) o = o * o_scale;
            STORE(X_KIND, out, (row0 + r) * HEAD_SIZE + d, o);
        }
    }
}

// ---- backward --------------------------------------------------------------------------------

// Exact attention's gradient (reference.attention_backward), FlashAttention-2's formulas in
// float32 from the inputs' values: s = sm_scale q . k, P = exp(s - lse), dV = P^T dO,
// dS = P (dO V^T - delta), delta = rowsum(dO * O) - d lse, dQ = sm_scale dS K, dK = sm_scale dS^T Q.
// A work-item owns a row (dQ) or a key (dK, dV) and its accumulators; the other side streams
// through local memory, KT rows a tile, RB at a time.

// Rows [KT][HEAD_SIZE] of a and b from first_row on (n real, zeros after) into local memory, as float32.
static void stage_rows(__local float (*as)[HEAD_SIZE], __local float (*bs)[HEAD_SIZE], __global const x_t *a,
                       __global const x_t *b, long first_row, int n) {
    for (uint idx = get_local_id(0); idx < KT * HEAD_SIZE; idx += BM) {
        const uint c = idx / HEAD_SIZE;
        const long offset = first_row * HEAD_SIZE + idx;
        as[c][idx - c * HEAD_SIZE] = c < (uint)n ? LOAD(X_KIND, a, offset) : 0.0f;
        bs[c][idx - c * HEAD_SIZE] = c < (uint)n ? LOAD(X_KIND, b, offset) : 0.0f;
    }
}

// out[i] = x . rows[first + i] for i < RB: RB independent sums hide the adds' latency.
static void dots(const float *x, __local const float (*rows)[HEAD_SIZE], int first, float *out) {
    for (int i = 0; i < RB; ++i) out[i] = 0.0f;
    for (int d = 0; d < HEAD_SIZE; ++d) {
        const float a = x[d];
        for (int i = 0; i < RB; ++i) out[i] += a * rows[first + i][d];
    }
}

// acc = acc * rescale + sum_i weight[i] rows[first + i], row by row. Called with one local array
// per call site: choosing the array at run time kept a CPU from vectorizing the loop.
static void accumulate(float *acc, float rescale, const float *weight, __local const float (*rows)[HEAD_SIZE],
                       int first) {
    for (int d = 0; d < HEAD_SIZE; ++d) {
        float a = acc[d] * rescale;
        for (int i = 0; i < RB; ++i) a += weight[i] * rows[first + i][d];
        acc[d] = a;
    }
}

// Per query row (a work-item each): pass 0 runs an online softmax over the keys that rebuilds O,
// giving the exact lse and delta (saved for the dK/dV kernel); pass 1 accumulates dQ.
// NDRange (tiles * BM, Hq), work-groups (BM, 1).
__kernel __attribute__((reqd_work_group_size(BM, 1, 1)))
void attention_backward_dq(__global const x_t *q, __global const x_t *k, __global const x_t *v,
                           __global const x_t *grad_out, __global const float *grad_lse, __global float *lse_out,
                           __global float *delta_out, __global x_t *dq, __global const int *seqs,
                           __global const int *tiles, int nq_rows, int nk_rows, int num_kv_heads, float sm_scale,
                           int causal, int has_dlse) {
    __local float ks[KT][HEAD_SIZE], vs[KT][HEAD_SIZE];
    const int r = get_local_id(0), h = get_group_id(1), num_heads = get_num_groups(1);
    const int kv_head = (int)((uint)h / ((uint)num_heads / (uint)num_kv_heads));
    const place_t p = find_place(seqs, tiles, causal);
    const bool real = r < p.rows;
    const long row = (long)(p.batch * num_heads + h) * nq_rows + p.start + r;
    const long kv_rows = (long)(p.batch * num_kv_heads + kv_head) * nk_rows + p.k0;

    float qf[HEAD_SIZE], dof[HEAD_SIZE], acc[HEAD_SIZE];
    for (int d = 0; d < HEAD_SIZE; ++d) {
        qf[d] = real ? LOAD(X_KIND, q, row * HEAD_SIZE + d) : 0.0f;
        dof[d] = real ? LOAD(X_KIND, grad_out, row * HEAD_SIZE + d) : 0.0f;
        acc[d] = 0.0f;  // pass 0: O, pass 1: dQ
    }
    float m = -INFINITY, l = 0.0f, row_lse = 0.0f, delta = 0.0f;
    for (int pass = 0; pass < 2; ++pass) {
        for (int j0 = 0; j0 < p.key_end; j0 += KT) {
            const int n = min(KT, p.key_end - j0);
            stage_rows(ks, vs, k, v, kv_rows + j0, n);
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int c0 = 0; c0 < n && real; c0 += RB) {
                float s[RB], dp[RB], weight[RB];
                bool seen[RB];
                dots(qf, ks, c0, s);
                for (int i = 0; i < RB; ++i) {
                    s[i] = s[i] * sm_scale;
                    seen[i] = c0 + i < n && visible(p, causal, r, j0 + c0 + i);
                }
                float rescale = 1.0f;
                if (pass == 0) {
                    float m_new = m;
                    for (int i = 0; i < RB; ++i) m_new = seen[i] ? max_keeping_nan(m_new, s[i]) : m_new;
                    if (m_new == -INFINITY) continue;  // no key seen yet
                    rescale = exp(m - m_new);
                    l = l * rescale;
                    for (int i = 0; i < RB; ++i) {
                        weight[i] = seen[i] ? exp(s[i] - m_new) : 0.0f;
                        l = l + weight[i];
                    }
                    m = m_new;
                } else {
                    dots(dof, vs, c0, dp);
                    for (int i = 0; i < RB; ++i) weight[i] = seen[i] ? exp(s[i] - row_lse) * (dp[i] - delta) : 0.0f;
                }
                if (pass == 0) accumulate(acc, rescale, weight, vs, c0);  // O += P V
                else accumulate(acc, 1.0f, weight, ks, c0);              // dQ += dS K
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        if (pass == 0) {
            row_lse = l == 0.0f ? -INFINITY : m + log(l);
            for (int d = 0; d < HEAD_SIZE; ++d) {
                delta += dof[d] * (l == 0.0f ? 0.0f : acc[d] / l);
                acc[d] = 0.0f;
            }
            if (real) {
                delta = delta - (has_dlse ? grad_lse[row] : 0.0f);
                lse_out[row] = row_lse;
                delta_out[row] = delta;
            }
        }
    }
    if (!real) return;
    for (int d = 0; d < HEAD_SIZE; ++d) STORE(X_KIND, dq, row * HEAD_SIZE + d, acc[d] * sm_scale);
}

// Per key row (a work-item each) of a tile of BM keys and one kv head: dK and dV summed over the
// query rows that see the key, of every query head of the kv head's group (GQA without atomics),
// the queries staged KT at a time with their dO, lse and delta. NDRange (tiles * BM, Hkv).
__kernel __attribute__((reqd_work_group_size(BM, 1, 1)))
void attention_backward_dkdv(__global const x_t *q, __global const x_t *k, __global const x_t *v,
                             __global const x_t *grad_out, __global const float *lse, __global const float *delta,
                             __global x_t *dk, __global x_t *dv, __global const int *seqs,
                             __global const int *tiles, int nq_rows, int nk_rows, int num_q_heads, float sm_scale,
                             int causal) {
    __local float qs[KT][HEAD_SIZE], dos[KT][HEAD_SIZE];
    __local float lses[KT], deltas[KT];
    const uint lid = get_local_id(0);
    const int kv_head = get_group_id(1), num_kv_heads = get_num_groups(1);
    const int group = (int)((uint)num_q_heads / (uint)num_kv_heads);
    __global const int *tile = tiles + 2 * get_group_id(0);
    __global const int *seq = seqs + 5 * tile[0];
    const int batch = seq[0], q0 = seq[1], nq = seq[2] - seq[1], k0 = seq[3], nk = seq[4] - seq[3];
    const int j = tile[1] - k0 + (int)lid;  // this work-item's key, counted from k0
    const bool real = j < nk;
    const long key_row = (long)(batch * num_kv_heads + kv_head) * nk_rows + k0 + j;
    // bottom-right causal: query i sees key j iff i >= j - (Nk - Nq); the tile's first key bounds them all
    const int first_query = causal ? max(0, tile[1] - k0 - (nk - nq)) : 0;

    float kf[HEAD_SIZE], vf[HEAD_SIZE], dkf[HEAD_SIZE], dvf[HEAD_SIZE];
    for (int d = 0; d < HEAD_SIZE; ++d) {
        kf[d] = real ? LOAD(X_KIND, k, key_row * HEAD_SIZE + d) : 0.0f;
        vf[d] = real ? LOAD(X_KIND, v, key_row * HEAD_SIZE + d) : 0.0f;
        dkf[d] = 0.0f;
        dvf[d] = 0.0f;
    }
    for (int g = 0; g < group; ++g) {
        const long q_rows = (long)(batch * num_q_heads + kv_head * group + g) * nq_rows + q0;  // query 0 of the head
        for (int i0 = first_query; i0 < nq; i0 += KT) {
            const int n = min(KT, nq - i0);
            stage_rows(qs, dos, q, grad_out, q_rows + i0, n);
            lses[lid] = lid < (uint)n ? lse[q_rows + i0 + lid] : 0.0f;
            deltas[lid] = lid < (uint)n ? delta[q_rows + i0 + lid] : 0.0f;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int r0 = 0; r0 < n && real; r0 += RB) {
                float s[RB], dp[RB], prob[RB], ds[RB];
                dots(kf, qs, r0, s);
                dots(vf, dos, r0, dp);
                for (int i = 0; i < RB; ++i) {
                    const bool seen = r0 + i < n && (!causal || i0 + r0 + i >= j - (nk - nq));
                    prob[i] = seen ? exp(s[i] * sm_scale - lses[r0 + i]) : 0.0f;
                    ds[i] = seen ? prob[i] * (dp[i] - deltas[r0 + i]) : 0.0f;
                }
                accumulate(dvf, 1.0f, prob, dos, r0);  // dV += P^T dO
                accumulate(dkf, 1.0f, ds, qs, r0);     // dK += dS^T Q
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
    if (!real) return;
    for (int d = 0; d < HEAD_SIZE; ++d) {
        STORE(X_KIND, dk, key_row * HEAD_SIZE + d, dkf[d] * sm_scale);
        STORE(X_KIND, dv, key_row * HEAD_SIZE + d, dvf[d]);
    }
}
