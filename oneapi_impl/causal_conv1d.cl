// Causal depthwise conv1d: the contract of torch_kernels.reference.causal_conv1d.
//
// causal_conv1d_fwd: a work-item per output (batch, channel, step), the WIDTH taps unrolled; taps
// before step 0 read the initial states, taps across a packed-sequence boundary count zero.
// causal_conv1d_update: a work-item per (batch entry, channel) walks the new steps with its
// window in registers, then writes the new inputs into its conv_state row; it alone touches that
// row's channel, so reads and writes need no barrier. Arithmetic in float32; the filter and bias
// arrive as float32.
//
// Build-time macros: X_KIND (0 float32, 1 float16, 2 bfloat16: x, initial states, conv_state
// and out), WIDTH (the filter width).

typedef CAT(TYPE_, X_KIND) x_t;

static float silu(float v) { return v / (1.0f + exp(-v)); }

__kernel void causal_conv1d_fwd(__global const x_t *x, __global const float *weight, __global const float *bias,
                                __global const int *seq_idx, __global const x_t *h0, __global x_t *out,
                                int dim, int length, int has_bias, int has_seq, int has_h0, int use_silu) {
    const long t = get_global_id(0), c = get_global_id(1), b = get_global_id(2);
    const long row = b * dim + c;
    float acc = has_bias ? bias[c] : 0.0f;
    for (int k = 0; k < WIDTH; ++k) {
        const long src = t - (WIDTH - 1 - k);
        float v;
        if (src >= 0) {
            v = LOAD(X_KIND, x, row * length + src);
            if (has_seq && seq_idx[b * length + src] != seq_idx[b * length + t]) v = 0.0f;
        } else {
            v = has_h0 ? LOAD(X_KIND, h0, row * (WIDTH - 1) + src + WIDTH - 1) : 0.0f;
        }
        acc += weight[c * WIDTH + k] * v;
    }
    if (use_silu) acc = silu(acc);
    STORE(X_KIND, out, row * length + t, acc);
}

__kernel void causal_conv1d_update(__global const x_t *x, __global x_t *state, __global const float *weight,
                                   __global const float *bias, __global const int *cache_seqlens,
                                   __global const int *rows, __global x_t *out, int dim, int length, int state_len,
                                   long stride_row, long stride_ch, long stride_pos, int has_bias, int circular,
                                   int has_rows, int use_silu) {
    const int c = get_global_id(0), b = get_global_id(1);
    if (c >= dim) return;
    const long line = has_rows ? rows[b] : b;
    __global const x_t *xs = x + ((long)b * dim + c) * length;
    __global x_t *o = out + ((long)b * dim + c) * length;
    if (line < 0) {  // a padding entry: zeros out, no row read or written
        for (int l = 0; l < length; ++l) STORE(X_KIND, o, l, 0.0f);
        return;
    }
    __global x_t *s = state + line * stride_row + c * stride_ch;
    const int start = circular ? cache_seqlens[b] % state_len : 0;
    float window[WIDTH];  // window[WIDTH - 1] is the current input
    for (int i = 0; i < WIDTH - 1; ++i) {
        const int pos = circular ? (start - (WIDTH - 1) + i + state_len) % state_len : state_len - (WIDTH - 1) + i;
        window[i] = LOAD(X_KIND, s, pos * stride_pos);
    }
    float w[WIDTH];
    for (int k = 0; k < WIDTH; ++k) w[k] = weight[c * WIDTH + k];
    const float bias_c = has_bias ? bias[c] : 0.0f;
    for (int l = 0; l < length; ++l) {
        window[WIDTH - 1] = LOAD(X_KIND, xs, l);
        float acc = bias_c;
        for (int k = 0; k < WIDTH; ++k) acc += w[k] * window[k];
        STORE(X_KIND, o, l, use_silu ? silu(acc) : acc);
        for (int k = 0; k < WIDTH - 1; ++k) window[k] = window[k + 1];
    }
    if (circular) {
        for (int l = length > state_len ? length - state_len : 0; l < length; ++l)
            s[((start + l) % state_len) * stride_pos] = xs[l];
    } else {  // shift left by length, then the new inputs at the end
        for (int p = 0; p < state_len; ++p) {
            const int src = p + length;
            s[p * stride_pos] = src < state_len ? s[src * stride_pos] : xs[src - state_len];
        }
    }
}
