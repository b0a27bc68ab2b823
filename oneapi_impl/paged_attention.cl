// Ragged paged attention and the KV-cache write: the contract of
// torch_kernels.reference.paged_attention.
//
// Build-time macros:
//   Q_KIND      query, new keys/values and output: 0 float32, 1 float16, 2 bfloat16
//   CACHE_KIND  key and value caches: 0-2 as Q_KIND, 3 int8, 4 float8_e4m3fn, 5 float8_e5m2
//   HEAD_SIZE   D
// A cache entry means float32(entry) * scale[kv_head]; storing divides by the scale in float32 and
// rounds to the cache dtype exactly as torch does (the encoders below work on the bits, so they
// do not depend on the device's rounding modes or denormal handling). A NaN stays a NaN; its bits
// in a float16 / bfloat16 cache are c10's scalar ones (torch's vectorized conversions differ).
// Kinds, loads and the decoders come from dtypes.cl.

typedef CAT(TYPE_, Q_KIND) q_t;
typedef CAT(TYPE_, CACHE_KIND) cache_t;

// ---- encoding ------------------------------------------------------------------------------

// |x| (float32 bits a, not NaN) rounded to nearest even in a binary format with mbits mantissa
// bits and exponent bias `bias`; the code without its sign. Values past the largest finite carry
// into the exponent (callers saturate or clamp to inf).
static uint round_magnitude(uint a, int mbits, int bias) {
    const int e = (int)(a >> 23);  // float32 biased exponent
    const int drop = 23 - mbits;
    if (e - 127 >= 1 - bias) {  // a normal number of the target: round off `drop` bits
        const uint t = a + ((1u << (drop - 1)) - 1) + ((a >> drop) & 1);
        return (t >> drop) - ((uint)(127 - bias) << mbits);
    }
    // a subnormal of the target: count its quantum 2^(1 - bias - mbits) in the 24-bit significand
    const uint sig = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int shift = (1 - bias - mbits) - (max(e, 1) - 150);
    if (shift >= 25) return 0;  // below half the smallest subnormal
    const uint q = sig >> shift, rest = sig & ((1u << shift) - 1), half_q = 1u << (shift - 1);
    return q + (rest > half_q || (rest == half_q && (q & 1)));  // q + 1 == 1 << mbits is the smallest normal
}

static ushort encode_f16(float x) {
    const uint u = as_uint(x), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (ushort)(sign | 0x7e00);  // c10's NaN (torch's vector path keeps payloads)
    return (ushort)(sign | min(round_magnitude(a, 10, 15), 0x7c00u));  // overflow -> inf
}


static uchar encode_e4m3fn(float x) {
    const uint u = as_uint(x), sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uchar)(sign | 0x7f);
    return (uchar)(sign | round_magnitude(min(a, 0x43e00000u), 3, 7));  // saturate to 448
}

static uchar encode_e5m2(float x) {
    const uint u = as_uint(x), sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uchar)(sign | 0x7f);
    return (uchar)(sign | round_magnitude(min(a, 0x47600000u), 2, 15));  // saturate to 57344
}

static char encode_int8(float x) {
    if (isnan(x)) return 0;  // what torch's float -> int8 conversion gives on x86
    return (char)clamp(rint(x), -128.0f, 127.0f);  // rint: half to even
}

#define ENCODE_0(x) (x)
#define ENCODE_1(x) encode_f16(x)
#define ENCODE_2(x) encode_bf16(x)
#define ENCODE_3(x) encode_int8(x)
#define ENCODE_4(x) encode_e4m3fn(x)
#define ENCODE_5(x) encode_e5m2(x)
#define ENCODE(kind, x) CAT(ENCODE_, kind)(x)

// mx / ms for mx, ms in [1, 2): the nearest float, and the residual mx - q * ms. OpenCL lets a
// plain float divide be 2.5 ulp off (GPUs use that), so step towards the quotient while the
// residual (its sign is always right) keeps its sign; once two neighbours bracket the quotient
// their residuals are exact and the smaller wins (a quotient is never halfway between floats).
static float nearest_quotient(float mx, float ms, float *residual) {
    float q = mx / ms, r = fma(-q, ms, mx);
    for (int step = 0; step < 4 && r != 0.0f; ++step) {
        const float next = nextafter(q, r > 0.0f ? 2.0f : 0.0f);
        const float r_next = fma(-next, ms, mx);
        const bool bracketed = r_next == 0.0f || (r_next > 0.0f) != (r > 0.0f);
        if (!bracketed || fabs(r_next) < fabs(r)) {
            q = next;
            r = r_next;
        }
        if (bracketed) break;
    }
    *residual = r;
    return q;
}

// The 24-bit significand of a finite nonzero |x| (float32 bits a) and its biased exponent,
// subnormals normalized: |x| = sig * 2^(exponent - 150).
static uint significand(uint a, int *exponent) {
    const int e = (int)(a >> 23);
    if (e) {
        *exponent = e;
        return (a & 0x7fffffu) | 0x800000u;
    }
    const int shift = clz(a) - 8;
    *exponent = 1 - shift;
    return a << shift;
}

// x / s rounded to nearest even, as torch computes it on the CPU, on any OpenCL device: the
// significands are divided in [1, 2), where no residual underflows, and the quotient is put on
// the float32 grid (subnormal or overflowing included) in integers, from the bits, so that
// neither the divide's precision nor flushing denormals to zero changes a bit of the result.
static float divide_rn(float x, float s) {
    const uint ax = as_uint(x) & 0x7fffffffu, as = as_uint(s) & 0x7fffffffu;
    if (ax == 0 || ax >= 0x7f800000u || as == 0 || as >= 0x7f800000u) return x / s;  // zeros, inf, NaN
    const uint sign = (as_uint(x) ^ as_uint(s)) & 0x80000000u;
    int ex, es;
    const uint sx = significand(ax, &ex), ss = significand(as, &es);
    float r;
    const float m = nearest_quotient(as_float(0x3f800000u | (sx & 0x7fffffu)),
                                     as_float(0x3f800000u | (ss & 0x7fffffu)), &r);
    const uint mbits = as_uint(m);
    const int e = (int)(mbits >> 23) + ex - es;  // biased exponent of the quotient
    if (e >= 255) return as_float(sign | 0x7f800000u);
    if (e >= 1) return as_float(sign | ((uint)e << 23) | (mbits & 0x7fffffu));
    // subnormal: drop 1 - e bits; exactly half of the last one is broken by the residual's sign
    const int shift = 1 - e;
    if (shift > 24) return as_float(sign);
    const uint sig = (mbits & 0x7fffffu) | 0x800000u;
    const uint q = sig >> shift, rest = sig & ((1u << shift) - 1), half_q = 1u << (shift - 1);
    const bool up = rest > half_q || (rest == half_q && (r > 0.0f || (r == 0.0f && (q & 1))));
    return as_float(sign | (q + up));
}

// ---- the cache write -----------------------------------------------------------------------

// A cache [num_blocks, block_size, Hkv, D] is any strided view whose last dimension is contiguous:
// entry (block, offset, head, 0) sits at base + block * block_stride + offset * slot_stride +
// head * head_stride (elements from the pointer passed). Slot = block * block_size + offset.
// Kernels take the four numbers of each cache, in that order, as CACHE_LAYOUT(k) declares them.
#define CACHE_LAYOUT(c) long c##_base, long c##_block_stride, long c##_slot_stride, long c##_head_stride
#define ENTRY(c, block, offset, head) \
    (c##_base + (long)(block) * c##_block_stride + (long)(offset) * c##_slot_stride + (long)(head) * c##_head_stride)

// One work-item per element of key / value [T, Hkv, D], on an NDRange (D, Hkv, T).
__kernel void reshape_and_cache(__global const q_t *key, __global const q_t *value,
                                __global cache_t *key_cache, __global cache_t *value_cache,
                                __global const long *slot_mapping, __global const float *k_scale,
                                __global const float *v_scale, int block_size, CACHE_LAYOUT(k), CACHE_LAYOUT(v)) {
    const int d = get_global_id(0), head = get_global_id(1), num_kv_heads = get_global_size(1);
    const long token = get_global_id(2);
    const long slot = slot_mapping[token];
    if (slot < 0) return;  // padding
    const ulong block = (ulong)slot / (uint)block_size, offset = (ulong)slot - block * (uint)block_size;
    const long src = (token * num_kv_heads + head) * HEAD_SIZE + d;
    key_cache[ENTRY(k, block, offset, head) + d] = ENCODE(CACHE_KIND, divide_rn(LOAD(Q_KIND, key, src), k_scale[head]));
    value_cache[ENTRY(v, block, offset, head) + d] =
        ENCODE(CACHE_KIND, divide_rn(LOAD(Q_KIND, value, src), v_scale[head]));
}

// ---- attention -----------------------------------------------------------------------------

// A work-group owns up to ROWS query rows: q_block consecutive tokens of one sequence times
// heads_per_group of the G query heads of one kv head, so every key and value it stages in local
// memory serves all of them (GQA). It walks the keys those rows can see in tiles of KT positions,
// through the block table (a tile may span pages), with an online softmax in float32:
//   1. stage the tile's keys and values, dequantized, in local memory
//   2. logits of every (row, key) pair, masked (causal, window) and soft-capped
//   3. per row: new running max, rescale factor, probabilities, running sum
//   4. each work-item owns output columns: acc = acc * rescale + p @ V
// The k scale is folded into the staged queries and the v scale into the final output.
// NaN and inf (the reference's policy): a NaN or inf is staged as 0 (a zero weight times NaN is
// NaN) and marks its key position; a row that sees a marked position, or whose query holds one,
// is written as NaN. Keys outside the tile's range are never loaded.
//
// Quotient-remainder pairs are written in unsigned arithmetic as q = x / y, r = x - q * y: the
// signed form (or %) makes clang -O2 emit `freeze`, which llvm-spirv 14 cannot translate.
#define ROWS 16
#define WG (HEAD_SIZE < 256 ? HEAD_SIZE : 256)
#define COLS ((HEAD_SIZE + WG - 1) / WG)
// keys per tile, a power of two (so i / KT is a shift): about 16 KiB of K and 16 of V
#define KT (HEAD_SIZE <= 64 ? 64 : HEAD_SIZE <= 128 ? 32 : HEAD_SIZE <= 256 ? 16 : 8)

// NDRange (chunks * WG, Hkv, query blocks), work-groups (WG, 1, 1): group ids are
// (head chunk, kv head, query block).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ragged_paged_attention(__global const q_t *query, __global const cache_t *key_cache,
                            __global const cache_t *value_cache, __global const int *cu_q_lens,
                            __global const int *kv_lens, __global const int *block_table,
                            __global const float *k_scale, __global const float *v_scale,
                            __global q_t *out, int num_seqs, int num_q_heads, int block_size,
                            int max_blocks, int q_block, int heads_per_group,
                            float sm_scale, int sliding_window, float soft_cap, CACHE_LAYOUT(k), CACHE_LAYOUT(v)) {
    __local float qs[ROWS][HEAD_SIZE];
    __local float ks[KT][HEAD_SIZE + 1];  // + 1: a GPU reads ks[lane][d] without bank conflicts
    __local float vs[KT][HEAD_SIZE];
    __local float ps[ROWS][KT];
    __local float row_max[ROWS], row_sum[ROWS], row_rescale[ROWS];
    __local long key_row[KT], value_row[KT];
    __local int row_token[ROWS], row_head[ROWS];  // -1: a row past the tokens or heads
    __local int key_bad[KT], row_bad[ROWS];  // a NaN or inf in the position's key or value / seen by the row

    const uint lid = get_local_id(0);
    const int head0 = get_group_id(0) * heads_per_group, kv_head = get_group_id(1);
    const int num_kv_heads = get_num_groups(1), block = get_group_id(2);
    const int group = num_q_heads / num_kv_heads;

    // Sequence s owns query blocks cu[s] / q_block + s, ... (enough for ceil(q_len / q_block)
    // blocks, the grid has T / q_block + S): find the last s whose first block is <= ours.
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_q_lens[mid] / q_block + mid <= block) lo = mid; else hi = mid - 1;
    }
    const int seq = lo, q_start = cu_q_lens[seq], q_end = cu_q_lens[seq + 1];
    const int tok0 = q_start + (block - (q_start / q_block + seq)) * q_block;
    if (tok0 >= q_end) return;  // a spare block: the same for the whole work-group
    const int tokens = min(q_block, q_end - tok0);
    const int heads = min(heads_per_group, group - head0);
    const int pos0 = kv_lens[seq] - (q_end - q_start) + (tok0 - q_start);  // position of token tok0
    const float q_scale = sm_scale * k_scale[kv_head];

    // row r is token tok0 + r / heads_per_group, query head kv_head * G + head0 + r % heads_per_group
    for (uint r = lid; r < ROWS; r += WG) {
        const uint t = r / (uint)heads_per_group, h = r - t * (uint)heads_per_group;
        const bool real = t < (uint)tokens && h < (uint)heads;
        row_token[r] = real ? (int)t : -1;
        row_head[r] = real ? (int)h : -1;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
        row_bad[r] = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < ROWS; ++r) {
        const int t = row_token[r];
        const long base = ((long)(tok0 + t) * num_q_heads + kv_head * group + head0 + row_head[r]) * HEAD_SIZE;
        for (uint d = lid; d < HEAD_SIZE; d += WG) {
            const float x = t >= 0 ? LOAD(Q_KIND, query, base + d) : 0.0f;
            if (!isfinite(x)) atomic_or(&row_bad[r], 1);
            qs[r][d] = isfinite(x) ? x * q_scale : 0.0f;
        }
    }
    float acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;

    // keys the rows may see: from the first token's window start to the last token's position
    const int first_key = sliding_window > 0 ? max(0, pos0 - sliding_window + 1) : 0;
    const int end_key = pos0 + tokens;
    for (int j0 = first_key; j0 < end_key; j0 += KT) {
        const int n = min(KT, end_key - j0);
        for (uint k = lid; k < KT; k += WG) {
            key_bad[k] = 0;
            if (k < (uint)n) {  // only pages below kv_len: the rest may hold anything
                const uint j = j0 + k, page = j / (uint)block_size, offset = j - page * (uint)block_size;
                const long block_id = block_table[(long)seq * max_blocks + page];
                key_row[k] = ENTRY(k, block_id, offset, kv_head);
                value_row[k] = ENTRY(v, block_id, offset, kv_head);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < KT; ++k) {
            const bool real = k < n;  // zeros past the tile's end, so that 0 * garbage is no NaN
            for (uint d = lid; d < HEAD_SIZE; d += WG) {
                const float key = real ? LOAD(CACHE_KIND, key_cache, key_row[k] + d) : 0.0f;
                const float value = real ? LOAD(CACHE_KIND, value_cache, value_row[k] + d) : 0.0f;
                if (!isfinite(key) || !isfinite(value)) atomic_or(&key_bad[k], 1);
                ks[k][d] = isfinite(key) ? key : 0.0f;
                vs[k][d] = isfinite(value) ? value : 0.0f;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint i = lid; i < ROWS * KT; i += WG) {
            const uint r = i / KT, k = i % KT;
            const int t = row_token[r], pos = pos0 + t, j = j0 + k;
            float logit = -INFINITY;
            if (t >= 0 && j < end_key && j <= pos && (sliding_window <= 0 || j > pos - sliding_window)) {
                if (key_bad[k]) atomic_or(&row_bad[r], 1);
                float dot = 0.0f;
                for (int d = 0; d < HEAD_SIZE; ++d) dot = fma(qs[r][d], ks[k][d], dot);
                logit = soft_cap > 0.0f ? soft_cap * tanh(dot / soft_cap) : dot;
            }
            ps[r][k] = logit;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint r = lid; r < ROWS; r += WG) row_rescale[r] = online_softmax_row(ps[r], KT, &row_max[r], &row_sum[r]);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int c = 0; c < COLS; ++c) {
            const uint d = lid + c * WG;
            if (d < HEAD_SIZE) {
                for (int r = 0; r < ROWS; ++r) {
                    float a = acc[r][c] * row_rescale[r];
                    for (int k = 0; k < KT; ++k) a = fma(ps[r][k], vs[k][d], a);
                    acc[r][c] = a;
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // before the next tile overwrites ks, vs, ps
    }

    const float o_scale = v_scale[kv_head];
    for (int r = 0; r < ROWS; ++r) {
        const int t = row_token[r];
        if (t < 0) continue;
        const long base = ((long)(tok0 + t) * num_q_heads + kv_head * group + head0 + row_head[r]) * HEAD_SIZE;
        for (int c = 0; c < COLS; ++c) {
            const uint d = lid + c * WG;
            // every real row sees at least its own position, so row_sum >= 1
            if (d < HEAD_SIZE) out[base + d] = ENCODE(Q_KIND, row_bad[r] ? NAN : acc[r][c] * o_scale / row_sum[r]);
        }
    }
}
