// What every kernel source shares, prepended to each by _runtime.spirv: dtype kinds, their
// storage types, loads to float32 and the float16 / bfloat16 stores; the attention kernels'
// online-softmax row step.
//   kind: 0 float32, 1 float16, 2 bfloat16, 3 int8, 4 float8_e4m3fn, 5 float8_e5m2

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

// storage type of each kind: float16 and bfloat16 are kept as their bits
#define TYPE_0 float
#define TYPE_1 ushort
#define TYPE_2 ushort
#define TYPE_3 char
#define TYPE_4 uchar
#define TYPE_5 uchar

// OpenCL has no fp8 type: sign, 4 exponent bits (bias 7), 3 mantissa bits; no inf, 0x7f is NaN.
static float decode_e4m3fn(uchar b) {
    const uint sign = (uint)(b & 0x80) << 24, e = (b >> 3) & 0xf, m = b & 7;
    if (e == 0xf && m == 7) return as_float(sign | 0x7fc00000u);
    if (e == 0) return as_float(sign | as_uint((float)m * 0x1p-9f));  // subnormal: m * 2^-6 / 8
    return as_float(sign | ((e + 120) << 23) | (m << 20));
}

static float decode_e5m2(uchar b) {
    const ushort h = (ushort)b << 8;  // e5m2 is float16 with the low mantissa byte cut off
    return vload_half(0, (const half *)&h);
}

#define LOAD_0(p, i) ((p)[i])
#define LOAD_1(p, i) vload_half((i), (const __global half *)(p))  // needs no fp16 arithmetic
#define LOAD_2(p, i) as_float((uint)(p)[i] << 16)                  // bf16: top half of a float32
#define LOAD_3(p, i) ((float)(p)[i])
#define LOAD_4(p, i) decode_e4m3fn((p)[i])
#define LOAD_5(p, i) decode_e5m2((p)[i])
#define LOAD(kind, p, i) CAT(LOAD_, kind)(p, i)

// round to nearest even on the bits, as torch converts (a NaN becomes c10's bf16 NaN)
static ushort encode_bf16(float x) {
    const uint u = as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)0x7fc0;
    return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define STORE_0(p, i, x) ((p)[i] = (x))
#define STORE_1(p, i, x) vstore_half_rte((x), (i), (__global half *)(p))
#define STORE_2(p, i, x) ((p)[i] = encode_bf16(x))
#define STORE(kind, p, i, x) CAT(STORE_, kind)(p, i, x)


// One row's step of an online softmax over the n logits p (-inf: unseen) of a tile: p becomes
// their weights against the row's new running max (all 0 while the row has seen nothing; a NaN
// logit propagates, where fmax would drop it), the running max and sum are updated, and the
// factor the row's accumulator must be scaled by is returned.
static float online_softmax_row(__local float *p, int n, __local float *row_max, __local float *row_sum) {
    const float old_max = *row_max;
    float new_max = old_max;
    for (int k = 0; k < n; ++k)
        if (isnan(p[k]) || p[k] > new_max) new_max = p[k];
    if (new_max == -INFINITY) {
        for (int k = 0; k < n; ++k) p[k] = 0.0f;
        return 1.0f;
    }
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) {
        p[k] = exp(p[k] - new_max);
        sum += p[k];
    }
    const float rescale = exp(old_max - new_max);
    *row_sum = *row_sum * rescale + sum;
    *row_max = new_max;
    return rescale;
}
