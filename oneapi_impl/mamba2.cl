// Mamba-2's decode step: the contract of torch_kernels.reference.mamba2 (selective_state_update).
//
// A work-item per (batch entry, head, head channel) walks its dstate entries: it decays each of
// its state row's entries, adds the input, stores it and sums it against C for out. It alone
// touches those entries, so no barrier. The launcher hands it the rows the batch uses, gathered
// as float32 (state), and dt, A, D and dt_bias as float32 arrays; a padding entry (live 0) writes
// zeros to out and its gathered row is not copied back. Arithmetic in float32.
//
// Build-time macros: X_KIND (0 float32, 1 float16, 2 bfloat16: x, B, C, z and out).

typedef CAT(TYPE_, X_KIND) x_t;

__kernel void selective_state_update(__global float *state, __global const x_t *x, __global const float *dt,
                                     __global const float *A, __global const x_t *B, __global const x_t *C,
                                     __global const float *D, __global const x_t *z, __global const float *dt_bias,
                                     __global const int *live, __global x_t *out, int heads, int headdim,
                                     int dstate, int heads_per_group, int has_d, int has_z, int has_bias,
                                     int softplus) {
    const int p = get_global_id(0), h = get_global_id(1), b = get_global_id(2);
    const long channel = ((long)b * heads + h) * headdim + p;
    if (!live[b]) {
        STORE(X_KIND, out, channel, 0.0f);
        return;
    }
    const long head_channel = (long)h * headdim + p;
    float d = dt[channel] + (has_bias ? dt_bias[head_channel] : 0.0f);
    if (softplus && d <= 20.0f) d = log1p(exp(d));
    const float xv = LOAD(X_KIND, x, channel);
    const long group = ((long)b * (heads / heads_per_group) + h / heads_per_group) * dstate;
    __global float *s = state + channel * dstate;
    __global const float *a = A + head_channel * dstate;
    float acc = 0.0f;
    for (int n = 0; n < dstate; ++n) {
        const float v = s[n] * exp(d * a[n]) + d * xv * LOAD(X_KIND, B, group + n);
        s[n] = v;
        acc += v * LOAD(X_KIND, C, group + n);
    }
    if (has_d) acc += D[head_channel] * xv;
    if (has_z) {
        const float zv = LOAD(X_KIND, z, channel);
        acc *= zv / (1.0f + exp(-zv));
    }
    STORE(X_KIND, out, channel, acc);
}
