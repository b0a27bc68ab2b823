// Multi-head latent attention over a paged latent cache: the contract of
// torch_kernels.reference.mla (ragged_paged_mla).
//
// Build-time macros:
//   Q_KIND      queries and output: 0 float32, 1 float16, 2 bfloat16
//   CACHE_KIND  the latent cache: 0-2 as Q_KIND, 3 int8, 4 float8_e4m3fn, 5 float8_e5m2
//   LR, R       latent and RoPE widths; a cache row is [c (LR), k_pe (R)]
// (the attention; the indexer, below, takes its own). Kinds and loads come from dtypes.cl.

typedef CAT(TYPE_, Q_KIND) q_t;

#ifdef LR
typedef CAT(TYPE_, CACHE_KIND) cache_t;

#define W (LR + R)
#define ROWS 16
#define WG (LR < 256 ? LR : 256)
#define COLS ((LR + WG - 1) / WG)
// rows per tile, a power of two: about 16 KiB of cache rows in local memory
#define KT (W <= 64 ? 64 : W <= 128 ? 32 : W <= 256 ? 16 : 8)

// A work-group owns up to ROWS query rows: q_block consecutive tokens of one sequence times
// heads_per_group of the H heads; every head reads the same latent rows, so each row staged in
// local memory serves all of them. It walks the positions its rows see in tiles of KT, through
// the block table, with an online softmax in float32:
//   1. stage the tile's cache rows (keys: all W columns; values: the first LR), in float32
//   2. logits of every (row, position) pair, masked
//   3. per row: new running max, rescale factor, probabilities, running sum
//   4. each work-item owns output columns: acc = acc * rescale + p @ c
// Sparse calls (top_k > 0, q_block 1) walk the token's index list instead: each row sorted,
// repeats replaced by -1 (the op does that), so a position counts once.
// NaN and inf, as the reference and the Triton kernel: nothing outside the rows a tile lists is
// read (they are staged as 0); a NaN or inf the tile holds flows through the sums (a zero weight
// times NaN is NaN), so it may reach every row of the work-group; online_softmax_row (dtypes.cl)
// keeps a NaN logit in the running max.
//
// Quotient-remainder pairs are written in unsigned arithmetic: the signed form makes clang -O2
// emit `freeze`, which llvm-spirv 14 cannot translate.

// NDRange (chunks * WG, query blocks), work-groups (WG, 1): group ids (head chunk, query block).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ragged_paged_mla(__global const q_t *q_nope, __global const q_t *q_pe, __global const cache_t *cache,
                      __global const int *cu_q_lens, __global const int *kv_lens,
                      __global const int *block_table, __global const int *topk, __global const float *scale,
                      __global q_t *out, __global float *lse, int num_seqs, int num_heads, int block_size,
                      int max_blocks, int q_block, int heads_per_group, int top_k, float sm_scale,
                      long cache_base, long block_stride, long slot_stride) {
    __local float qs[ROWS][W];
    __local float ks[KT][W + 1];  // + 1: a GPU reads ks[lane][d] without bank conflicts
    __local float ps[ROWS][KT];
    __local float row_max[ROWS], row_sum[ROWS], row_rescale[ROWS];
    __local long key_row[KT];
    __local int key_pos[KT];  // -1: nothing staged
    __local int row_token[ROWS], row_head[ROWS];  // -1: a row past the tokens or heads

    const uint lid = get_local_id(0);
    const int head0 = get_group_id(0) * heads_per_group, block = get_group_id(1);

    // Sequence s owns query blocks cu[s] / q_block + s, ... (the grid has T / q_block + S):
    // find the last s whose first block is <= ours.
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_q_lens[mid] / q_block + mid <= block) lo = mid; else hi = mid - 1;
    }
    const int seq = lo, q_start = cu_q_lens[seq], q_end = cu_q_lens[seq + 1];
    const int tok0 = q_start + (block - (q_start / q_block + seq)) * q_block;
    if (tok0 >= q_end) return;  // a spare block: the same for the whole work-group
    const int tokens = min(q_block, q_end - tok0);
    const int heads = min(heads_per_group, num_heads - head0);
    const int pos0 = kv_lens[seq] - (q_end - q_start) + (tok0 - q_start);  // position of token tok0
    const float kv_scale = scale[0];
    const float q_scale = sm_scale * kv_scale;

    for (uint r = lid; r < ROWS; r += WG) {
        const uint t = r / (uint)heads_per_group, h = r - t * (uint)heads_per_group;
        const bool real = t < (uint)tokens && h < (uint)heads;
        row_token[r] = real ? (int)t : -1;
        row_head[r] = real ? (int)h : -1;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < ROWS; ++r) {
        const int t = row_token[r];
        const long row = (long)(tok0 + t) * num_heads + head0 + row_head[r];
        for (uint d = lid; d < W; d += WG) {
            float x = 0.0f;
            if (t >= 0) x = d < LR ? LOAD(Q_KIND, q_nope, row * LR + d) : LOAD(Q_KIND, q_pe, row * R + (d - LR));
            qs[r][d] = x * q_scale;
        }
    }
    float acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;

    // dense: positions 0 .. the last token's; sparse: the token's list
    const int end = top_k > 0 ? top_k : pos0 + tokens;
    for (int j0 = 0; j0 < end; j0 += KT) {
        for (uint k = lid; k < KT; k += WG) {
            int j = -1;
            if (j0 + (int)k < end) j = top_k > 0 ? topk[(long)tok0 * top_k + j0 + k] : j0 + (int)k;
            if (j > pos0 + tokens - 1) j = -1;  // past every row's position (a sparse list may name one)
            key_pos[k] = j;
            if (j >= 0) {  // only the sequence's first kv_len rows: the rest may hold anything
                const uint page = (uint)j / (uint)block_size, offset = (uint)j - page * (uint)block_size;
                const long block_id = block_table[(long)seq * max_blocks + page];
                key_row[k] = cache_base + block_id * block_stride + (long)offset * slot_stride;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < KT; ++k) {
            const bool real = key_pos[k] >= 0;  // zeros elsewhere, so that 0 * garbage is no NaN
            for (uint d = lid; d < W; d += WG) ks[k][d] = real ? LOAD(CACHE_KIND, cache, key_row[k] + d) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint i = lid; i < ROWS * KT; i += WG) {
            const uint r = i / KT, k = i % KT;
            const int t = row_token[r], j = key_pos[k];
            float logit = -INFINITY;
            if (t >= 0 && j >= 0 && j <= pos0 + t) {
                float dot = 0.0f;
                for (int d = 0; d < W; ++d) dot = fma(qs[r][d], ks[k][d], dot);
                logit = dot;
            }
            ps[r][k] = logit;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint r = lid; r < ROWS; r += WG) row_rescale[r] = online_softmax_row(ps[r], KT, &row_max[r], &row_sum[r]);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int c = 0; c < COLS; ++c) {
            const uint d = lid + c * WG;
            if (d < LR) {
                for (int r = 0; r < ROWS; ++r) {
                    float a = acc[r][c] * row_rescale[r];
                    for (int k = 0; k < KT; ++k) a = fma(ps[r][k], ks[k][d], a);
                    acc[r][c] = a;
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // before the next tile overwrites ks, ps, key_pos
    }

    for (int r = 0; r < ROWS; ++r) {
        const int t = row_token[r];
        if (t < 0) continue;
        const long row = (long)(tok0 + t) * num_heads + head0 + row_head[r];
        const float sum = row_sum[r];
        // a row that attends to nothing: zeros and lse -inf; a NaN sum stays NaN in both
        for (int c = 0; c < COLS; ++c) {
            const uint d = lid + c * WG;
            if (d < LR) STORE(Q_KIND, out, row * LR + d, sum == 0.0f ? 0.0f : acc[r][c] * kv_scale / sum);
        }
        if (lid == 0) lse[row] = sum == 0.0f ? -INFINITY : row_max[r] + log(sum);
    }
}
#endif

// ---- the indexer ---------------------------------------------------------------------------

// DeepSeek-V3.2's lightning indexer fused with its top-k (torch_kernels.reference.mla.indexer_topk).
// Build-time macros: Q_KIND (q and k_cache), HI, DI (indexer heads and head size), TOPK_P (the
// kept keys: top_k rounded up to a power of two); Q_IN_GLOBAL where the queries do not fit local
// memory beside the keys (DeepSeek-V3.2's 64 x 128 float32 queries and top 2048 take 65,792 bytes,
// over a GPU's 64 KiB): every work-item reads the token's queries from q instead, the same values.
// A work-group per token (NDRange (T * WG_I), work-groups WG_I): its queries and weights staged
// in local memory, it scores TOPK_P positions at a time (a work-item per position) as int64 keys,
// score bits made monotone in the high half and the position reversed in the low half (higher
// score first, then lower position), and merges them into its best keys: the candidates sorted
// ascending against the best sorted descending, the larger of each pair are the best of both,
// sorted again. Bitonic sorts in local memory; the scores are never written out.
#ifdef TOPK_P
#define WG_I 64
#define NONE ((long)0x8000000000000000UL)  // below every real key

static void bitonic_sort(__local long *keys, bool descending) {
    for (uint k = 2; k <= TOPK_P; k <<= 1) {
        for (uint j = k >> 1; j > 0; j >>= 1) {
            for (uint i = get_local_id(0); i < TOPK_P; i += WG_I) {
                const uint other = i ^ j;
                if (other > i) {
                    const long a = keys[i], b = keys[other];
                    const bool first_desc = ((i & k) == 0) == descending;  // this pair's direction
                    if (first_desc ? a < b : a > b) {
                        keys[i] = b;
                        keys[other] = a;
                    }
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
}

static long score_key(float score, int pos) {
    if (isnan(score)) score = -INFINITY;  // NaN ranks as -inf, as in the reference
    if (score == 0.0f) score = 0.0f;  // -0 ties +0
    const int bits = as_int(score);
    const int ordered = bits >= 0 ? bits : bits ^ 0x7fffffff;
    return ((long)ordered << 32) | (long)(0x7fffffff - pos);
}

__kernel __attribute__((reqd_work_group_size(WG_I, 1, 1)))
void indexer_topk(__global const q_t *q, __global const q_t *k_cache, __global const float *weights,
                  __global const int *cu_q_lens, __global const int *kv_lens, __global const int *block_table,
                  __global int *out, int num_seqs, int block_size, int max_blocks, int top_k,
                  long cache_base, long block_stride, long slot_stride) {
#ifdef Q_IN_GLOBAL
#define QS(h, d) LOAD(Q_KIND, q, ((long)t * HI + (h)) * DI + (d))
#else
    __local float qs[HI][DI];
#define QS(h, d) qs[h][d]
#endif
    __local float ws[HI];
    __local long best[TOPK_P], candidates[TOPK_P];
    const uint lid = get_local_id(0);
    const int t = get_group_id(0);
    int lo = 0, hi = num_seqs - 1;  // the last sequence starting at or before t: the one holding it
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_q_lens[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int seen_end = kv_lens[seq] - (cu_q_lens[seq + 1] - t) + 1;  // positions below it are visible
#ifndef Q_IN_GLOBAL
    for (uint i = lid; i < HI * DI; i += WG_I) {
        const uint h = i / DI, d = i - h * DI;
        qs[h][d] = LOAD(Q_KIND, q, ((long)t * HI + h) * DI + d);
    }
#endif
    for (uint h = lid; h < HI; h += WG_I) ws[h] = weights[(long)t * HI + h];
    for (uint i = lid; i < TOPK_P; i += WG_I) best[i] = NONE;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int chunk = 0; chunk < seen_end; chunk += TOPK_P) {
        for (uint i = lid; i < TOPK_P; i += WG_I) {
            const int pos = chunk + (int)i;
            long key = NONE;
            if (pos < seen_end) {
                const uint page = (uint)pos / (uint)block_size, offset = (uint)pos - page * (uint)block_size;
                const long row = cache_base + (long)block_table[(long)seq * max_blocks + page] * block_stride
                                 + (long)offset * slot_stride;
                // the positive and negative weights' terms summed apart: an overflow is then +inf or
                // -inf whatever the order or fusing of the sums, and both ways NaN (see indexer_topk)
                float up = 0.0f, down = 0.0f;
                for (int h = 0; h < HI; ++h) {
                    float dot = 0.0f;
                    for (int d = 0; d < DI; ++d) dot = fma(QS(h, d), LOAD(Q_KIND, k_cache, row + d), dot);
                    const float term = ws[h] * (isnan(dot) ? dot : fmax(dot, 0.0f));  // relu keeping NaN
                    if (ws[h] < 0.0f) down += term; else up += term;
                }
                key = score_key(up + down, pos);
            }
            candidates[i] = key;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        bitonic_sort(candidates, false);
        for (uint i = lid; i < TOPK_P; i += WG_I) best[i] = max(best[i], candidates[i]);
        barrier(CLK_LOCAL_MEM_FENCE);
        bitonic_sort(best, true);
    }
    for (uint i = lid; i < (uint)top_k; i += WG_I)
        out[(long)t * top_k + i] = best[i] == NONE ? -1 : 0x7fffffff - (int)(best[i] & 0xffffffffL);
}
#endif
