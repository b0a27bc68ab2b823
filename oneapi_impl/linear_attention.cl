// Gated DeltaNet and gated linear attention: the contract of
// torch_kernels.reference.linear_attention (recurrence_naive is the definition).
//
// Per (sequence, value head) the state S [K, V] evolves as
//   DELTA=1: S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
//   DELTA=0: S_t = a_t S_{t-1} + k_t v_t^T
// with a_t = exp(g_t), and o_t = scale S_t^T q_t. Every column of S evolves on its own (the
// delta rule's error is per column too), so a work-group may own a block of VB columns of the
// state: only the gradients of q, k, g and beta need summing over the blocks, which the host
// does from per-block partial buffers [NVB, rows, HV, *].
//
// Build-time macros:
//   QK_KIND, V_KIND  storage of q, k and of v / o: 0 float32, 1 float16, 2 bfloat16
//   DELTA            1 the delta rule (beta given), 0 gated linear attention
//   K_MAX            a power of two >= K (sizes local and private arrays; K is a runtime value)
//   VB               state columns per work-group, a power of two (V is a runtime value)
//   PER_CHANNEL      1: g [rows, HV, K] holds a log decay per key channel (Kimi Delta Attention:
//                    row c of S decays by exp(g_tc)), 0: g [rows, HV]
// g, beta, the states, do and every gradient are float32. Rows are tokens of the flat
// [B * T] axis; sequence n spans rows cu[n] .. cu[n + 1] (the host passes B sequences of T
// rows when there is no cu_seqlens). Head h reads q/k head h / (HV / H).
//
// Divisions are unsigned: signed quotient-remainder pairs make clang -O2 emit `freeze`, which
// llvm-spirv 14 cannot translate.

typedef CAT(TYPE_, QK_KIND) qk_t;  // kinds, loads and stores come from dtypes.cl
typedef CAT(TYPE_, V_KIND) v_t;

#ifndef PER_CHANNEL
#define PER_CHANNEL 0
#endif

#define CHUNK 64
#define WG 64  // work-items of a chunk kernel's work-group: one per chunk row or state column
#define GC (PER_CHANNEL ? K_MAX : 1)  // decay channels of a chunk row in local memory
#define CH(c) (PER_CHANNEL ? (c) : 0)  // the decay channel of key channel c

// Where a work-group is: its sequence's rows, its value head and q/k head, its state columns.
typedef struct {
    long bos, eos;   // rows of the sequence
    int seq, head, qk_head, v0;
} place_t;

static place_t find_place(__global const int *cu, int H, int HV, int block_columns) {
    place_t p;
    p.seq = get_group_id(2);
    p.head = get_group_id(1);
    p.qk_head = (int)((uint)p.head / ((uint)HV / (uint)H));
    p.v0 = get_group_id(0) * block_columns;
    p.bos = cu[p.seq];
    p.eos = cu[p.seq + 1];
    return p;
}

static int chunk_count(place_t p) {
    return (int)(((ulong)(p.eos - p.bos) + CHUNK - 1) / CHUNK);
}

// ---- chunk kernels: shared steps -------------------------------------------------------------
// Within a chunk of n <= CHUNK rows with start state S0: e_t = exp(g_1 + ... + g_t),
// r_t = exp(g_{t+1} + ... + g_last), D_ts = exp(g_{s+1} + ... + g_t) (s <= t). The WY form
// (reference docstring):
//   W = (I + diag(beta) Dkk)^-1 diag(beta) U,  U = V - diag(e) K S0,  Dkk = strict_lower(D * K K^T)
//   O = scale (diag(e) Q S0 + M W),            M = lower(D * Q K^T)
//   S_end = e_last S0 + (diag(r) K)^T W
// (DELTA=0: W = V). With PER_CHANNEL, e, r and D carry a key channel c (e_tc = exp(g_1c + ... +
// g_tc), ...) and the products take D inside their K-sums: Dkk_ts = sum_c K_tc K_sc D_tsc, and
// diag(e) K S0 is (e * K) S0, e_last S0 is diag(e_last) S0 (one decay per state row).
// Each decay is exp of a sum of the gates it spans, never of a difference of
// cumulative sums: those cancel in float32 once gates are large (g = -1e4) and give
// -inf - -inf = NaN for g = -inf (a full state reset). Each helper ends with a barrier, so its
// results are visible to the group.

// Rows c0 .. c0 + n of q (if Qs), k, v (columns v0 ..) and the gates, zero-padded; then e, r.
static void load_chunk(__global const qk_t *q, __global const qk_t *k, __global const v_t *v,
                       __global const float *g, __global const float *beta, place_t p, long c0, int n,
                       int H, int HV, int K, int V,
                       __local float (*Qs)[K_MAX], __local float (*Ks)[K_MAX], __local float (*Vs)[VB],
                       __local float (*gate)[GC], __local float (*e)[GC], __local float (*r)[GC],
                       __local float *bt) {
    const uint lid = get_local_id(0);
    for (uint i = lid; i < CHUNK * K_MAX; i += WG) {
        const uint t = i / K_MAX, c = i % K_MAX;
        const bool real = t < (uint)n && c < (uint)K;
        const long at = ((c0 + t) * H + p.qk_head) * K + c;
        Ks[t][c] = real ? LOAD(QK_KIND, k, at) : 0.0f;
        if (Qs) Qs[t][c] = real ? LOAD(QK_KIND, q, at) : 0.0f;
    }
    for (uint i = lid; i < CHUNK * VB; i += WG) {
        const uint t = i / VB, j = i % VB;
        const bool real = t < (uint)n && p.v0 + j < (uint)V;
        Vs[t][j] = real ? LOAD(V_KIND, v, ((c0 + t) * HV + p.head) * V + p.v0 + j) : 0.0f;
    }
    for (uint i = lid; i < CHUNK * GC; i += WG) {
        const uint t = i / GC, c = i % GC;
        const long at = (c0 + t) * HV + p.head;
        gate[t][c] = t < (uint)n && c < (uint)K ? g[PER_CHANNEL ? at * K + c : at] : 0.0f;
    }
    for (uint t = lid; t < CHUNK; t += WG)
        bt[t] = t < (uint)n && DELTA ? beta[(c0 + t) * HV + p.head] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint i = lid; i < CHUNK * GC; i += WG) {  // summed in row order, as the reference does
        const uint t = i / GC, c = i % GC;
        float from_start = 0.0f, to_end = 0.0f;
        for (uint u = 0; u <= t; ++u) from_start += gate[u][c];
        for (uint u = t + 1; u < (uint)n; ++u) to_end += gate[u][c];
        e[t][c] = t < (uint)n ? exp(from_start) : 0.0f;
        r[t][c] = t < (uint)n ? exp(to_end) : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

// Dkk (DELTA) and, if M is given, M; zero outside their triangles and past row n. A work-item
// owns column s and walks down it, so g_{s+1} + ... + g_t is one running sum (per channel).
static void decay_products(__local float (*Qs)[K_MAX], __local float (*Ks)[K_MAX],
                           __local float (*gate)[GC], int n, int K, __local float (*Dkk)[CHUNK],
                           __local float (*M)[CHUNK]) {
    for (uint s = get_local_id(0); s < CHUNK; s += WG) {
        float segment[GC];
        for (int c = 0; c < GC; ++c) segment[c] = 0.0f;
        for (uint t = 0; t < CHUNK; ++t) {
            if (t > s)
                for (int c = 0; c < GC; ++c) segment[c] += gate[t][c];
            const bool lower = s <= t && t < (uint)n;
            float kk = 0.0f, qk = 0.0f;
            if (lower) {
                for (int c = 0; c < K; ++c) {
                    const float d = PER_CHANNEL ? exp(segment[c]) : 1.0f;  // D_tsc inside the sum
                    kk = fma(d * Ks[t][c], Ks[s][c], kk);
                    if (M) qk = fma(d * Qs[t][c], Ks[s][c], qk);
                }
            }
            const float decay = lower ? (PER_CHANNEL ? 1.0f : exp(segment[0])) : 0.0f;
            if (DELTA) Dkk[t][s] = s < t ? decay * kk : 0.0f;
            if (M) M[t][s] = decay * qk;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

// The chunk's values W from U (holding V on entry, V - diag(e) K S0 on exit) by forward
// substitution, one state column per work-item: W_t = beta_t (U_t - sum_{s<t} Dkk_ts W_s).
static void solve_values(__local float (*S)[VB], __local float (*Ks)[K_MAX], __local float (*e)[GC],
                         __local const float *bt, __local float (*Dkk)[CHUNK], int n, int K,
                         __local float (*U)[VB], __local float (*W)[VB]) {
    const uint lid = get_local_id(0);
#if DELTA
    for (uint i = lid; i < CHUNK * VB; i += WG) {
        const uint t = i / VB, j = i % VB;
        float ks = 0.0f;
        for (int c = 0; c < K; ++c) ks = fma(e[t][CH(c)] * Ks[t][c], S[c][j], ks);
        U[t][j] -= ks;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint j = lid; j < VB; j += WG) {
        for (int t = 0; t < CHUNK; ++t) {
            float w = U[t][j];
            for (int s = 0; s < t; ++s) w = fma(-Dkk[t][s], W[s][j], w);
            W[t][j] = bt[t] * w;
        }
    }
#else
    for (uint i = lid; i < CHUNK * VB; i += WG) {
        const uint t = i / VB, j = i % VB;
        W[t][j] = U[t][j];
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
}

// S = e_last S + (diag(r) K)^T W (e_last, r per state row with PER_CHANNEL), one element per work-item.
static void update_state(__local float (*S)[VB], __local float (*Ks)[K_MAX], __local float (*r)[GC],
                         __local float (*e)[GC], __local float (*W)[VB], int n) {
    for (uint i = get_local_id(0); i < K_MAX * VB; i += WG) {
        const uint c = i / VB, j = i % VB;
        float s = e[n - 1][CH(c)] * S[c][j];
        for (int t = 0; t < n; ++t) s = fma(r[t][CH(c)] * Ks[t][c], W[t][j], s);
        S[c][j] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

// state block <-> global [.., K, V] at `base` (the element of row 0, column 0)
static void read_state(__local float (*S)[VB], __global const float *src, long base, int v0, int K, int V) {
    for (uint i = get_local_id(0); i < K_MAX * VB; i += WG) {
        const uint c = i / VB, j = i % VB;
        S[c][j] = c < (uint)K && v0 + j < (uint)V ? src[base + (long)c * V + v0 + j] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

static void write_state(__local float (*S)[VB], __global float *dst, long base, int v0, int K, int V) {
    for (uint i = get_local_id(0); i < K_MAX * VB; i += WG) {
        const uint c = i / VB, j = i % VB;
        if (c < (uint)K && v0 + j < (uint)V) dst[base + (long)c * V + v0 + j] = S[c][j];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

// ---- chunk forward ---------------------------------------------------------------------------

// NDRange (NVB * WG, HV, N), work-groups (WG, 1, 1): group ids (state block, value head, sequence).
// The group walks its sequence's chunks in order with its state block in local memory.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void chunk_forward(__global const qk_t *q, __global const qk_t *k, __global const v_t *v,
                   __global const float *g, __global const float *beta, __global const float *h0,
                   __global const int *cu, __global v_t *o, __global float *ht,
                   int H, int HV, int K, int V, float scale) {
    __local float S[K_MAX][VB];
    __local float Qs[CHUNK][K_MAX], Ks[CHUNK][K_MAX];
    __local float U[CHUNK][VB], W[CHUNK][VB];
    __local float Dkk[CHUNK][CHUNK], M[CHUNK][CHUNK];
    __local float gate[CHUNK][GC], e[CHUNK][GC], r[CHUNK][GC], bt[CHUNK];

    const place_t p = find_place(cu, H, HV, VB);
    const long state_base = ((long)p.seq * HV + p.head) * K * V;
    read_state(S, h0, state_base, p.v0, K, V);
    for (long c0 = p.bos; c0 < p.eos; c0 += CHUNK) {
        const int n = (int)min((long)CHUNK, p.eos - c0);
        load_chunk(q, k, v, g, beta, p, c0, n, H, HV, K, V, Qs, Ks, U, gate, e, r, bt);
        decay_products(Qs, Ks, gate, n, K, Dkk, M);
        solve_values(S, Ks, e, bt, Dkk, n, K, U, W);
        for (uint i = get_local_id(0); i < CHUNK * VB; i += WG) {
            const uint t = i / VB, j = i % VB;
            if (t >= (uint)n || p.v0 + j >= (uint)V) continue;
            float qs = 0.0f, mw = 0.0f;
            for (int c = 0; c < K; ++c) qs = fma(e[t][CH(c)] * Qs[t][c], S[c][j], qs);
            for (uint s = 0; s <= t; ++s) mw = fma(M[t][s], W[s][j], mw);
            STORE(V_KIND, o, ((c0 + t) * HV + p.head) * V + p.v0 + j, scale * (qs + mw));
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // the outputs read S0 before it moves on
        update_state(S, Ks, r, e, W, n);
    }
    write_state(S, ht, state_base, p.v0, K, V);
}

// ---- chunk backward --------------------------------------------------------------------------
// Gradients of a chunk from dO and dS (the gradient of its end state), with R = (I + A)^-T dW,
// A = diag(beta) Dkk, and the chain rule through the WY form above:
//   dW   = scale M^T dO + diag(r) K dS                      (DELTA=0: dV = dW)
//   dU   = diag(beta) R = dV,  dbeta_t = R_t . U_t + sum_s dA_ts Dkk_ts,  dA_ts = -R_t . W_s (s < t)
//   P1   = D * (scale dO W^T) (lower),  P2 = D * diag(beta) dA (strict lower)
//   dQ   = scale diag(e) dO S0^T + P1 K
//   dK   = P1^T Q + (P2 + P2^T) K + diag(r) W dS^T - diag(e) dU S0^T
//   dS0  = scale (diag(e) Q)^T dO + e_last dS - (diag(e) K)^T dU
//   dg_u from each decay whose sum holds g_u: e_t (t >= u), r_t (t < u), e_last, D_ts (s < u <= t),
//        each term summed where it applies (not as differences of cumulative sums, which cancel).
// PER_CHANNEL: P1 and P2 hold dO W^T and diag(beta) dA without D, which enters per channel c
// where a work-item owning c sums dQ_tc = sum_s P1_ts D_tsc K_sc and the like, and dg_uc.

// Row t's products with state row c over the block's columns: S0_c . dO_t, S0_c . beta_t R_t
// (the row's dU) and dS_c . W_t.
static void state_products(__local float (*S)[VB], __local float (*dS)[VB], __local float (*dO)[VB],
                           __local float (*R)[VB], __local float (*W)[VB], float bt_t, uint c, uint t,
                           float *s0_do, float *s0_du, float *ds_w) {
    float a = 0.0f, b = 0.0f, d = 0.0f;
    for (int j = 0; j < VB; ++j) {
        a = fma(S[c][j], dO[t][j], a);
        b = fma(S[c][j], bt_t * R[t][j], b);
        d = fma(dS[c][j], W[t][j], d);
    }
    *s0_do = a;
    *s0_du = b;
    *ds_w = d;
}

// NDRange and groups as chunk_forward. Pass 1 reruns the forward to store each chunk's start
// state in `checkpoints` [chunks, HV, K, V] (this sequence's chunks from chunk_first[seq]);
// pass 2 walks the chunks backwards carrying dS in local memory.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void chunk_backward(__global const qk_t *q, __global const qk_t *k, __global const v_t *v,
                    __global const float *g, __global const float *beta, __global const float *h0,
                    __global const int *cu, __global const int *chunk_first,
                    __global const float *do_, __global const float *dht, __global float *checkpoints,
                    __global float *dq, __global float *dk, __global float *dv, __global float *dg,
                    __global float *dbeta, __global float *dh0,
                    int H, int HV, int K, int V, float scale, int rows) {
    __local float S[K_MAX][VB], dS[K_MAX][VB];
    __local float Qs[CHUNK][K_MAX], Ks[CHUNK][K_MAX];
    __local float U[CHUNK][VB], W[CHUNK][VB], dO[CHUNK][VB], R[CHUNK][VB];
    __local float Dkk[CHUNK][CHUNK], M[CHUNK][CHUNK], P1[CHUNK][CHUNK], P2[CHUNK][CHUNK];
    __local float gate[CHUNK][GC], e[CHUNK][GC], r[CHUNK][GC], bt[CHUNK];
    __local float d_start[CHUNK], d_end[CHUNK], d_cross[CHUNK];  // dg_u terms of e_t, r_t and D_ts

    const uint lid = get_local_id(0);
    const place_t p = find_place(cu, H, HV, VB);
    const long state_base = ((long)p.seq * HV + p.head) * K * V;
    const long block_rows = (long)get_group_id(0) * rows;  // this block's slice of the partials
    const int chunks = chunk_count(p);

    read_state(S, h0, state_base, p.v0, K, V);
    for (int i = 0; i < chunks; ++i) {
        const long c0 = p.bos + (long)i * CHUNK;
        const int n = (int)min((long)CHUNK, p.eos - c0);
        write_state(S, checkpoints, ((long)(chunk_first[p.seq] + i) * HV + p.head) * K * V, p.v0, K, V);
        load_chunk(q, k, v, g, beta, p, c0, n, H, HV, K, V, 0, Ks, U, gate, e, r, bt);
        decay_products(Qs, Ks, gate, n, K, Dkk, 0);
        solve_values(S, Ks, e, bt, Dkk, n, K, U, W);
        update_state(S, Ks, r, e, W, n);
    }

    read_state(dS, dht, state_base, p.v0, K, V);
    for (int i = chunks - 1; i >= 0; --i) {
        const long c0 = p.bos + (long)i * CHUNK;
        const int n = (int)min((long)CHUNK, p.eos - c0);
        read_state(S, checkpoints, ((long)(chunk_first[p.seq] + i) * HV + p.head) * K * V, p.v0, K, V);
        load_chunk(q, k, v, g, beta, p, c0, n, H, HV, K, V, Qs, Ks, U, gate, e, r, bt);
        for (uint x = lid; x < CHUNK * VB; x += WG) {
            const uint t = x / VB, j = x % VB;
            dO[t][j] = t < (uint)n && p.v0 + j < (uint)V ? do_[((c0 + t) * HV + p.head) * V + p.v0 + j] : 0.0f;
        }
        decay_products(Qs, Ks, gate, n, K, Dkk, M);
        solve_values(S, Ks, e, bt, Dkk, n, K, U, W);

        // dW into R
        for (uint x = lid; x < CHUNK * VB; x += WG) {
            const uint s = x / VB, j = x % VB;
            float mdo = 0.0f, kds = 0.0f;
            for (int t = s; t < n; ++t) mdo = fma(M[t][s], dO[t][j], mdo);
            for (int c = 0; c < K; ++c) kds = fma(r[s][CH(c)] * Ks[s][c], dS[c][j], kds);
            R[s][j] = fma(scale, mdo, kds);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if DELTA
        // R_s = dW_s - sum_{t>s} beta_t Dkk_ts R_t, backward substitution per column
        for (uint j = lid; j < VB; j += WG) {
            for (int s = n - 2; s >= 0; --s) {
                float x = R[s][j];
                for (int t = s + 1; t < n; ++t) x = fma(-bt[t] * Dkk[t][s], R[t][j], x);
                R[s][j] = x;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#endif

        // P1, P2; M and Dkk become their terms of dg and dbeta: dD_ts D_ts and dA_ts Dkk_ts (M only
        // per head). Column-owned as in decay_products, for the running sum g_{s+1} + ... + g_t.
        for (uint s = lid; s < CHUNK; s += WG) {
            float segment = 0.0f;
            for (uint t = 0; t < CHUNK; ++t) {
                if (t > s && !PER_CHANNEL) segment += gate[t][0];
                if (s > t || t >= (uint)n) {
                    P1[t][s] = P2[t][s] = 0.0f;
                    continue;
                }
                const float decay = PER_CHANNEL ? 1.0f : exp(segment);
                float dow = 0.0f, rw = 0.0f;
                for (int j = 0; j < VB; ++j) {
                    dow = fma(dO[t][j], W[s][j], dow);
                    if (DELTA) rw = fma(R[t][j], W[s][j], rw);
                }
                const float dm = scale * dow;
                P1[t][s] = dm * decay;
                if (!PER_CHANNEL) M[t][s] *= dm;  // dg's terms: per head only
                if (DELTA) {
                    const float da = s < t ? -rw : 0.0f;
                    P2[t][s] = bt[t] * da * decay;
                    if (!PER_CHANNEL) M[t][s] += bt[t] * da * Dkk[t][s];
                    Dkk[t][s] *= da;
                } else {
                    P2[t][s] = 0.0f;
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if DELTA
        for (uint t = lid; t < (uint)n; t += WG) {
            float dbeta_t = 0.0f;
            for (int j = 0; j < VB; ++j) dbeta_t = fma(R[t][j], U[t][j], dbeta_t);
            for (uint s = 0; s < t; ++s) dbeta_t += Dkk[t][s];
            dbeta[(block_rows + c0 + t) * HV + p.head] = dbeta_t;
        }
#endif
#if PER_CHANNEL
        // one key channel c per work-item: dq, dk and dg of column c for every row of the chunk
        for (uint c = lid; c < (uint)K; c += WG) {
            float dq_c[CHUNK], dk_c[CHUNK], dg_c[CHUNK], start_c[CHUNK];
            for (int t = 0; t < n; ++t) {
                float s0_do, s0_du, ds_w;
                state_products(S, dS, dO, R, W, bt[t], c, t, &s0_do, &s0_du, &ds_w);
                dq_c[t] = scale * e[t][c] * s0_do;
                dk_c[t] = r[t][c] * ds_w - e[t][c] * s0_du;
                start_c[t] = e[t][c] * (scale * Qs[t][c] * s0_do - Ks[t][c] * s0_du);  // e_tc's term
                dg_c[t] = r[t][c] * Ks[t][c] * ds_w;  // r_tc's term, moved to u > t below
            }
            float last = 0.0f;  // the e_last term, which every gate of the chunk gets
            for (int j = 0; j < VB; ++j) last = fma(S[c][j], dS[c][j], last);
            last *= e[n - 1][c];
            float earlier = 0.0f;  // r_t terms of t < u
            for (int u = 0; u < n; ++u) {
                const float end_u = dg_c[u];
                dg_c[u] = earlier + last;
                earlier += end_u;
            }
            float later = 0.0f;  // e_t terms of t >= u
            for (int u = n - 1; u >= 0; --u) {
                later += start_c[u];
                dg_c[u] += later;
            }
            // D_tsc (s <= t) by a running sum down column s; its term of dg_uc for s < u <= t is
            // summed over t >= u from the bottom up (start_c holds the column's terms)
            for (int s = 0; s < n; ++s) {
                float segment = 0.0f;
                for (int t = s; t < n; ++t) {
                    if (t > s) segment += gate[t][c];
                    const float decay = exp(segment);
                    const float p1 = P1[t][s] * decay, p2 = P2[t][s] * decay;
                    dq_c[t] = fma(p1, Ks[s][c], dq_c[t]);
                    dk_c[s] = fma(p1, Qs[t][c], fma(p2, Ks[t][c], dk_c[s]));
                    dk_c[t] = fma(p2, Ks[s][c], dk_c[t]);
                    start_c[t] = Ks[s][c] * fma(p1, Qs[t][c], p2 * Ks[t][c]);
                }
                float below = 0.0f;
                for (int t = n - 1; t > s; --t) {
                    below += start_c[t];
                    dg_c[t] += below;
                }
            }
            for (int t = 0; t < n; ++t) {
                const long at = ((block_rows + c0 + t) * HV + p.head) * K + c;
                dq[at] = dq_c[t];
                dk[at] = dk_c[t];
                dg[at] = dg_c[t];
            }
        }
#else
        // M[u][s] becomes the sum over t >= u of column s (for u > s): D_ts with s < u <= t holds g_u
        for (uint s = lid; s < CHUNK; s += WG) {
            float below = 0.0f;
            for (int u = n - 1; u > (int)s; --u) {
                below += M[u][s];
                M[u][s] = below;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        // one row per work-item: dq, dk and the row's terms of dg
        for (uint t = lid; t < (uint)n; t += WG) {
            const long row = c0 + t;
            const long qk_at = ((block_rows + row) * HV + p.head) * K;
            float cross = 0.0f, start = 0.0f, end = 0.0f;
            for (uint s = 0; s < t; ++s) cross += M[t][s];
            for (int c = 0; c < K; ++c) {
                float s0_do, s0_du, ds_w;
                state_products(S, dS, dO, R, W, bt[t], c, t, &s0_do, &s0_du, &ds_w);
                float dq_c = scale * e[t][0] * s0_do, dk_c = r[t][0] * ds_w - e[t][0] * s0_du;
                for (uint s = 0; s < CHUNK; ++s) {
                    dq_c = fma(P1[t][s], Ks[s][c], dq_c);
                    dk_c = fma(P1[s][t], Qs[s][c], dk_c);
                    dk_c = fma(P2[t][s] + P2[s][t], Ks[s][c], dk_c);
                }
                dq[qk_at + c] = dq_c;
                dk[qk_at + c] = dk_c;
                start += e[t][0] * (scale * Qs[t][c] * s0_do - Ks[t][c] * s0_du);
                end += r[t][0] * Ks[t][c] * ds_w;
            }
            d_cross[t] = cross;
            d_start[t] = start;
            d_end[t] = end;
        }
#endif
        for (uint x = lid; x < CHUNK * VB; x += WG) {
            const uint t = x / VB, j = x % VB;
            if (t < (uint)n && p.v0 + j < (uint)V)
                dv[((c0 + t) * HV + p.head) * V + p.v0 + j] = DELTA ? bt[t] * R[t][j] : R[t][j];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid == 0 && !PER_CHANNEL) {
            float last = 0.0f;  // the e_last term, which every gate of the chunk gets
            for (uint x = 0; x < K_MAX * VB; ++x) last = fma(S[x / VB][x % VB], dS[x / VB][x % VB], last);
            last *= e[n - 1][0];
            float later = 0.0f;  // e_t terms of t >= u
            for (int u = n - 1; u >= 0; --u) {
                later += d_start[u];
                d_cross[u] += later;
            }
            float earlier = 0.0f;  // r_t terms of t < u
            for (int u = 0; u < n; ++u) {
                dg[(block_rows + c0 + u) * HV + p.head] = d_cross[u] + earlier + last;
                earlier += d_end[u];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // everything above read dS

        for (uint x = lid; x < K_MAX * VB; x += WG) {
            const uint c = x / VB, j = x % VB;
            float d = e[n - 1][CH(c)] * dS[c][j];
            for (int t = 0; t < n; ++t) {
                d = fma(scale * e[t][CH(c)] * Qs[t][c], dO[t][j], d);
                if (DELTA) d = fma(-e[t][CH(c)] * Ks[t][c], bt[t] * R[t][j], d);
            }
            dS[c][j] = d;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    write_state(dS, dh0, state_base, p.v0, K, V);
}

// ---- recurrent kernels -----------------------------------------------------------------------
// A work-item owns one state column h = S[:, j] (K_MAX floats in private memory) of one
// (sequence, value head) and steps through the sequence's rows.

// Step gate_at's decay of state row c < K: exp(g_t), or exp(g_tc) with PER_CHANNEL.
static float row_decay(__global const float *g, long gate_at, int c, int K) {
    return exp(PER_CHANNEL ? g[gate_at * K + c] : g[gate_at]);
}

// One step from h_{t-1}: h becomes h_t; hp gets a_t h_{t-1} (a_t per row with PER_CHANNEL).
// Returns the step's o_t (column j).
static float recurrent_step(float *h, float *hp, __global const qk_t *q, __global const qk_t *k,
                            long qk_at, __global const float *g, long gate_at, float beta_t, float v_j, int K,
                            float scale) {
    const float a = PER_CHANNEL ? 0.0f : exp(g[gate_at]);
    float kh = 0.0f;
    for (int c = 0; c < K_MAX; ++c) {
        hp[c] = PER_CHANNEL ? (c < K ? row_decay(g, gate_at, c, K) * h[c] : 0.0f) : a * h[c];
        if (c < K) kh = fma(LOAD(QK_KIND, k, qk_at + c), hp[c], kh);
    }
    const float delta = DELTA ? beta_t * (v_j - kh) : v_j;
    float out = 0.0f;
    for (int c = 0; c < K; ++c) {
        h[c] = fma(LOAD(QK_KIND, k, qk_at + c), delta, hp[c]);
        out = fma(LOAD(QK_KIND, q, qk_at + c), h[c], out);
    }
    return scale * out;
}

// NDRange (NVB * VB, HV, N), work-groups (VB, 1, 1), one state column per work-item.
__kernel __attribute__((reqd_work_group_size(VB, 1, 1)))
void recurrent_forward(__global const qk_t *q, __global const qk_t *k, __global const v_t *v,
                       __global const float *g, __global const float *beta, __global const float *h0,
                       __global const int *cu, __global v_t *o, __global float *ht,
                       int H, int HV, int K, int V, float scale) {
    const place_t p = find_place(cu, H, HV, VB);
    const int j = p.v0 + get_local_id(0);
    if (j >= V) return;  // no barriers here
    const long state_at = ((long)p.seq * HV + p.head) * K * V + j;
    float h[K_MAX], hp[K_MAX];
    for (int c = 0; c < K_MAX; ++c) h[c] = c < K ? h0[state_at + (long)c * V] : 0.0f;
    for (long row = p.bos; row < p.eos; ++row) {
        const long gate_at = row * HV + p.head, v_at = gate_at * V + j;
        const float out = recurrent_step(h, hp, q, k, (row * H + p.qk_head) * K, g, gate_at,
                                         DELTA ? beta[gate_at] : 0.0f, LOAD(V_KIND, v, v_at), K, scale);
        STORE(V_KIND, o, v_at, out);
    }
    for (int c = 0; c < K; ++c) ht[state_at + (long)c * V] = h[c];
}

// NDRange and groups as recurrent_forward. Pass 1 steps forward storing the state at every
// CHUNK-th row in `checkpoints` (as chunk_backward); pass 2 takes the segments in reverse:
// it recomputes a segment's a_t h_{t-1} into `segment` [groups, CHUNK, K_MAX, VB] from its
// checkpoint, then walks it back carrying dh = dL/dh_t. Per step the column's shares of dq_t,
// dk_t, dg_t and dbeta_t are summed over the group's columns in local memory.
//   o_t = scale q.h_t:      dh += scale q do_j,  dq += scale h_t do_j
//   DELTA: h_t = hp + beta err k, err = v_j - k.hp, with c = k.dh:
//           dv_j = beta c, dbeta += err c, dk += beta err dh - beta c hp, dhp = dh - beta c k
//   DELTA=0: h_t = hp + v_j k:  dv_j = c, dk += v_j dh, dhp = dh
//   hp = a h_{t-1}:          dg += hp.dhp, dh = a dhp (PER_CHANNEL: dg_c = hp_c dhp_c, per row)
__kernel __attribute__((reqd_work_group_size(VB, 1, 1)))
void recurrent_backward(__global const qk_t *q, __global const qk_t *k, __global const v_t *v,
                        __global const float *g, __global const float *beta, __global const float *h0,
                        __global const int *cu, __global const int *chunk_first,
                        __global const float *do_, __global const float *dht, __global float *checkpoints,
                        __global float *segment,
                        __global float *dq, __global float *dk, __global float *dv, __global float *dg,
                        __global float *dbeta, __global float *dh0,
                        int H, int HV, int K, int V, float scale, int rows) {
    __local float share_q[K_MAX][VB], share_k[K_MAX][VB];
    __local float share_g[VB], share_beta[VB];
    __local float share_g_rows[PER_CHANNEL ? K_MAX : 1][VB];

    const uint lid = get_local_id(0);
    const place_t p = find_place(cu, H, HV, VB);
    const int j = p.v0 + lid;
    const bool active = j < V;  // idle columns keep zeros and still meet every barrier
    const long state_at = ((long)p.seq * HV + p.head) * K * V + j;
    const long block_rows = (long)get_group_id(0) * rows;
    const long group = ((long)p.seq * HV + p.head) * get_num_groups(0) + get_group_id(0);
    const int chunks = chunk_count(p);
    float h[K_MAX], hp[K_MAX], dh[K_MAX];

    for (int c = 0; c < K_MAX; ++c) h[c] = active && c < K ? h0[state_at + (long)c * V] : 0.0f;
    for (int i = 0; i < chunks; ++i) {
        const long c0 = p.bos + (long)i * CHUNK, end = min(c0 + CHUNK, p.eos);
        const long checkpoint_at = (long)(chunk_first[p.seq] + i) * HV * K * V + state_at - (long)p.seq * HV * K * V;
        if (active)
            for (int c = 0; c < K; ++c) checkpoints[checkpoint_at + (long)c * V] = h[c];
        for (long row = c0; row < end; ++row) {
            const long gate_at = row * HV + p.head;
            recurrent_step(h, hp, q, k, (row * H + p.qk_head) * K, g, gate_at, DELTA ? beta[gate_at] : 0.0f,
                           active ? LOAD(V_KIND, v, gate_at * V + j) : 0.0f, K, scale);
        }
    }

    for (int c = 0; c < K_MAX; ++c) dh[c] = active && c < K ? dht[state_at + (long)c * V] : 0.0f;
    for (int i = chunks - 1; i >= 0; --i) {
        const long c0 = p.bos + (long)i * CHUNK;
        const int n = (int)min((long)CHUNK, p.eos - c0);
        const long checkpoint_at = (long)(chunk_first[p.seq] + i) * HV * K * V + state_at - (long)p.seq * HV * K * V;
        for (int c = 0; c < K_MAX; ++c) h[c] = active && c < K ? checkpoints[checkpoint_at + (long)c * V] : 0.0f;
        for (int t = 0; t < n; ++t) {
            const long gate_at = (c0 + t) * HV + p.head;
            recurrent_step(h, hp, q, k, ((c0 + t) * H + p.qk_head) * K, g, gate_at,
                           DELTA ? beta[gate_at] : 0.0f, active ? LOAD(V_KIND, v, gate_at * V + j) : 0.0f, K, scale);
            for (int c = 0; c < K_MAX; ++c) segment[((group * CHUNK + t) * K_MAX + c) * VB + lid] = hp[c];
        }
        for (int t = n - 1; t >= 0; --t) {
            const long row = c0 + t, gate_at = row * HV + p.head, qk_at = (row * H + p.qk_head) * K;
            const float a = PER_CHANNEL ? 0.0f : exp(g[gate_at]), beta_t = DELTA ? beta[gate_at] : 0.0f;
            const float v_j = active ? LOAD(V_KIND, v, gate_at * V + j) : 0.0f;
            const float do_j = active ? do_[gate_at * V + j] : 0.0f;
            float kh = 0.0f, c_dh = 0.0f;
            for (int c = 0; c < K_MAX; ++c) {
                hp[c] = segment[((group * CHUNK + t) * K_MAX + c) * VB + lid];
                if (c < K) kh = fma(LOAD(QK_KIND, k, qk_at + c), hp[c], kh);
            }
            const float err = v_j - kh;
            const float delta = DELTA ? beta_t * err : v_j;  // h_t = hp + delta k
            for (int c = 0; c < K; ++c) {
                const float k_c = LOAD(QK_KIND, k, qk_at + c);
                dh[c] = fma(scale * LOAD(QK_KIND, q, qk_at + c), do_j, dh[c]);
                share_q[c][lid] = scale * fma(k_c, delta, hp[c]) * do_j;
                c_dh = fma(k_c, dh[c], c_dh);
            }
            const float derr = DELTA ? beta_t * c_dh : 0.0f;
            float hp_dhp = 0.0f;
            for (int c = 0; c < K; ++c) {
                share_k[c][lid] = DELTA ? beta_t * err * dh[c] - derr * hp[c] : v_j * dh[c];
                dh[c] = fma(-derr, LOAD(QK_KIND, k, qk_at + c), dh[c]);
                hp_dhp = fma(hp[c], dh[c], hp_dhp);
                if (PER_CHANNEL) share_g_rows[PER_CHANNEL ? c : 0][lid] = hp[c] * dh[c];
                dh[c] *= PER_CHANNEL ? row_decay(g, gate_at, c, K) : a;
            }
            share_g[lid] = hp_dhp;
            share_beta[lid] = err * c_dh;
            if (active) dv[gate_at * V + j] = DELTA ? derr : c_dh;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (uint c = lid; c < (uint)K; c += VB) {
                float sq = 0.0f, sk = 0.0f;
                for (int x = 0; x < VB; ++x) {
                    sq += share_q[c][x];
                    sk += share_k[c][x];
                }
                dq[((block_rows + row) * HV + p.head) * K + c] = sq;
                dk[((block_rows + row) * HV + p.head) * K + c] = sk;
                if (PER_CHANNEL) {
                    float sg = 0.0f;
                    for (int x = 0; x < VB; ++x) sg += share_g_rows[PER_CHANNEL ? c : 0][x];
                    dg[((block_rows + row) * HV + p.head) * K + c] = sg;
                }
            }
            if (lid == 0) {
                float sg = 0.0f, sb = 0.0f;
                for (int x = 0; x < VB; ++x) {
                    sg += share_g[x];
                    sb += share_beta[x];
                }
                if (!PER_CHANNEL) dg[(block_rows + row) * HV + p.head] = sg;
                if (DELTA) dbeta[(block_rows + row) * HV + p.head] = sb;
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
    if (active)
        for (int c = 0; c < K; ++c) dh0[state_at + (long)c * V] = dh[c];
}
