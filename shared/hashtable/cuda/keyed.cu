// CUDA kernels for keyed initial rows, the rows of a lookup's occurrences (a stored row or an
// initial one) and fingerprints (see cuda/keyed.py).
//
// The same bits as the torch code they replace: KeyedInitializer.__call__ (initializers.py) and
// fingerprint (hashing.py). The torch code uses only +, -, *, /, sqrt and frexp in float64,
// one rounding per op, rounded once to float32 at the end; so does this file, op for op in the
// torch code's order: every float64 operation is an explicit round-to-nearest intrinsic (never
// contracted into an FMA; the module is also compiled with --fmad=false). Integer hashing is
// splitmix64 on uint64, which is what the torch code computes with wrapping int64 arithmetic
// and masked (logical) right shifts. Constants are hex literals of the Python floats
// (test_cuda_keyed.py checks them against initializers.py).

typedef long long i64;
typedef unsigned long long u64;

#define KD_GOLDEN 0x9E3779B97F4A7C15ULL
#define KD_SIGN 0x8000000000000000ULL

// Per-table modes (keyed.py MODE_*). KD_NONE: the table has no initializer (NaN rows).
#define KD_CONSTANT 0
#define KD_UNIFORM 1
#define KD_NORMAL 2
#define KD_TRUNCATED_NORMAL 3
#define KD_NONE 4

// Per-table float64 parameters (keyed.py init_params): prm[KD_NPARAMS * t + KD_*].
#define KD_MEAN 0
#define KD_STD 1
#define KD_LOWER 2
#define KD_UPPER 3
#define KD_VALUE 4      // CONSTANT (and TRUNCATED_NORMAL with std_dev 0): the value's float32 bits
#define KD_WIDTH 5      // UNIFORM: upper - lower
#define KD_CDF_LO 6     // TRUNCATED_NORMAL: Phi((lower - mean) / std_dev)
#define KD_CDF_WIDTH 7  // TRUNCATED_NORMAL: Phi((upper - mean) / std_dev) - KD_CDF_LO
#define KD_NPARAMS 8
// Per-table int64 parameters: iprm[2 * t] = salt, iprm[2 * t + 1] = mode.

// ---------------------------------------------------------------- constants (initializers.py)

#define KD_LN2 0x1.62e42fefa39efp-1         // _LN2 = 0.6931471805599453
#define KD_SQRT_HALF 0x1.6a09e667f3bcdp-1   // _SQRT_HALF = 0.7071067811865476
#define KD_R0 0x1.71eb851eb851fp-3          // 0.180625
#define KD_SPLIT 0x1.b333333333333p-2       // 0.425
#define KD_NEAR 0x1.999999999999ap+0        // 1.6
#define KD_P_MIN 0x1.56e1fc2f8f359p-997     // 1e-300
#define KD_P_MAX 0x1.fffffffffffffp-1       // 1.0 - 2.0**-53

// _LOG_SERIES, low order first (as the Python lists)
__constant__ double KD_LOG[13] = {
    0x1.0000000000000p+0, 0x1.5555555555555p-2, 0x1.999999999999ap-3, 0x1.2492492492492p-3,
    0x1.c71c71c71c71cp-4, 0x1.745d1745d1746p-4, 0x1.3b13b13b13b14p-4, 0x1.1111111111111p-4,
    0x1.e1e1e1e1e1e1ep-5, 0x1.af286bca1af28p-5, 0x1.8618618618618p-5, 0x1.642c8590b2164p-5,
    0x1.47ae147ae147bp-5};
// AS241 (_A .. _F), low order first
__constant__ double KD_A[8] = {
    0x1.b18d91e9eef75p+1, 0x1.0a4888b1a436ep+7, 0x1.ece5d2213c0ccp+10, 0x1.ad1d8cd4ee71dp+13,
    0x1.66c3e869b752ap+15, 0x1.06c1c55b78f20p+16, 0x1.052d26b2e45e4p+15, 0x1.39a296f7d925ep+11};
__constant__ double KD_B[8] = {
    0x1.0000000000000p+0, 0x1.5281b386e1ab5p+5, 0x1.5797efdc8b3f7p+9, 0x1.512322e75c89fp+12,
    0x1.4b772d5d65266p+14, 0x1.3317caa64f4bep+15, 0x1.c0e457cb1ae76p+14, 0x1.46a7eca984b69p+12};
__constant__ double KD_C[8] = {
    0x1.6c665fde9526ap+0, 0x1.2857748cab19bp+2, 0x1.713f71462256ap+2, 0x1.d2ecb1a3d02c4p+1,
    0x1.453cc085375b2p+0, 0x1.ef2abb9b85c37p-3, 0x1.744eb6c45ec67p-6, 0x1.9615ac0b7ace9p-11};
__constant__ double KD_D[8] = {
    0x1.0000000000000p+0, 0x1.06cefbb46a449p+1, 0x1.ad278e6526633p+0, 0x1.61292f23385c9p-1,
    0x1.2f5123394f040p-3, 0x1.f207a7eab17bfp-7, 0x1.1f18cbfdf2728p-11, 0x1.20d3f686439e4p-30};
__constant__ double KD_E[8] = {
    0x1.aa1b1c13ee526p+2, 0x1.5daea6e875003p+2, 0x1.c8ea6461fa445p+0, 0x1.2fad9315255cfp-2,
    0x1.b2b41193b4ee7p-6, 0x1.45c1908425345p-10, 0x1.c6ec6cc59e02ap-16, 0x1.afb74d693bf93p-23};
__constant__ double KD_F[8] = {
    0x1.0000000000000p+0, 0x1.331d34fc7d77fp-1, 0x1.186eb183443fbp-3, 0x1.e76f93215462ap-7,
    0x1.9c8bc979dc5d7p-11, 0x1.35c2c496374bfp-16, 0x1.31446f740b9e0p-23, 0x1.269bff1f8c190p-49};

// ---------------------------------------------------------------- float64, one rounding per op

__device__ __forceinline__ double kd_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double kd_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double kd_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double kd_div(double a, double b) { return __ddiv_rn(a, b); }

// x.clamp(min=lo, max=hi) of torch: min(max(x, lo), hi), NaN stays NaN.
__device__ __forceinline__ double kd_clamp(double x, double lo, double hi) {
    const double a = x < lo ? lo : x;
    return a > hi ? hi : a;
}

// _poly: acc = c[N-1]; acc = acc * x + c[i] for i = N-2 .. 0 (two roundings a step).
template <int N>
__device__ __forceinline__ double kd_poly(const double (&c)[N], double x) {
    double acc = c[N - 1];
#pragma unroll
    for (int i = N - 2; i >= 0; --i) acc = kd_add(kd_mul(acc, x), c[i]);
    return acc;
}

// log_f64: frexp, m in [sqrt(1/2), sqrt(2)), then e * ln2 + 2 z P(z^2), z = (m - 1) / (m + 1).
__device__ __forceinline__ double kd_log(double x) {
    int e;
    double m = frexp(x, &e);   // exact, as torch.frexp: x = m * 2**e, m in [0.5, 1)
    if (m < KD_SQRT_HALF) {    // torch.where(small, m * 2.0, m); e - small
        m = kd_mul(m, 2.0);
        e -= 1;
    }
    const double ed = (double)e;  // exact
    const double z = kd_div(kd_sub(m, 1.0), kd_add(m, 1.0));
    return kd_add(kd_mul(ed, KD_LN2), kd_mul(kd_mul(2.0, z), kd_poly(KD_LOG, kd_mul(z, z))));
}

// inv_normal_cdf (AS241). torch computes every branch and selects with torch.where; each
// element's selected value comes from the same operations as the one branch computed here
// (NaN takes the same branches: the comparisons are false).
__device__ __forceinline__ double kd_inv_normal_cdf(double p) {
    const double q = kd_sub(p, 0.5);
    if (fabs(q) <= KD_SPLIT) {  // central
        const double r = kd_sub(KD_R0, kd_mul(q, q));
        return kd_div(kd_mul(q, kd_poly(KD_A, r)), kd_poly(KD_B, r));
    }
    const double t = __dsqrt_rn(-kd_log(q < 0.0 ? p : kd_sub(1.0, p)));
    double tail;
    if (t <= 5.0) {  // near
        const double s = kd_sub(t, KD_NEAR);
        tail = kd_div(kd_poly(KD_C, s), kd_poly(KD_D, s));
    } else {  // far
        const double s = kd_sub(t, 5.0);
        tail = kd_div(kd_poly(KD_E, s), kd_poly(KD_F, s));
    }
    return q < 0.0 ? -tail : tail;
}

__device__ __forceinline__ u64 kd_mix64(u64 x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

// key_uniforms: mix64(mix64(key ^ salt) + (j + 1) * GOLDEN) -> (2 * (h >>> 12) + 1) / 2**53.
__device__ __forceinline__ double kd_uniform(u64 key, u64 salt, i64 j) {
    const u64 h = kd_mix64(kd_mix64(key ^ salt) + (u64)(j + 1) * KD_GOLDEN);
    return (double)((h >> 12) * 2 + 1) * 0x1.0p-53;  // < 2**53: both steps exact
}

// Column j of the initial row of `key` from initializer t (KeyedInitializer.__call__): a pure
// function of (key, t, j), so any thread layout gives the same bits. NaN for a table without
// an initializer (or a table id out of range).
__device__ __forceinline__ float kd_initial_value(u64 key, i64 t, i64 j, i64 num_tables,
                                                  const double* __restrict__ prm,
                                                  const i64* __restrict__ iprm) {
    const int mode = (t >= 0 && t < num_tables) ? (int)iprm[2 * t + 1] : KD_NONE;
    const double* P = prm + KD_NPARAMS * t;
    if (mode == KD_CONSTANT) return __uint_as_float((unsigned int)P[KD_VALUE]);  // float32 bits
    if (mode != KD_UNIFORM && mode != KD_NORMAL && mode != KD_TRUNCATED_NORMAL) {
        return __int_as_float(0x7fc00000);
    }
    const double u = kd_uniform(key, (u64)iprm[2 * t], j);
    double x;
    if (mode == KD_UNIFORM) {  // lower + (upper - lower) * u
        x = kd_add(P[KD_LOWER], kd_mul(P[KD_WIDTH], u));
    } else if (mode == KD_NORMAL) {  // mean + std_dev * inv_normal_cdf(u)
        x = kd_add(P[KD_MEAN], kd_mul(P[KD_STD], kd_inv_normal_cdf(u)));
    } else {  // the normal conditioned on [lower, upper] (std_dev > 0)
        const double p = kd_clamp(kd_add(P[KD_CDF_LO], kd_mul(P[KD_CDF_WIDTH], u)), KD_P_MIN,
                                  KD_P_MAX);
        x = kd_clamp(kd_add(P[KD_MEAN], kd_mul(P[KD_STD], kd_inv_normal_cdf(p))), P[KD_LOWER],
                     P[KD_UPPER]);
    }
    return __double2float_rn(x);
}

// Occurrence i's W columns c .. c + W - 1 (W divides dim): run g = inverse[i]'s stored row
// rows[g] of values, or where rows[g] < 0 the initial row of (keys[g], which[g]); stored[i]:
// rows[g] >= 0. W = 4: one float4 copy (values and out 16-byte aligned).
template <int W>
__device__ __forceinline__ void kd_expand(const float* __restrict__ values,
                                          const i64* __restrict__ rows,
                                          const i64* __restrict__ inverse,
                                          const i64* __restrict__ keys,
                                          const i64* __restrict__ which, i64 n, i64 dim,
                                          i64 num_tables, const double* __restrict__ prm,
                                          const i64* __restrict__ iprm, float* __restrict__ out,
                                          bool* __restrict__ stored) {
    const i64 units = dim / W;  // thread units a row
    const i64 total = n * units;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = idx / units;
        const i64 c = (idx - i * units) * W;
        const i64 g = inverse[i];
        const i64 r = rows[g];
        float* dst = out + i * dim + c;
        if (r >= 0) {
            const float* src = values + r * dim + c;
            if constexpr (W == 4) {
                *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
            } else {
#pragma unroll
                for (int k = 0; k < W; ++k) dst[k] = src[k];
            }
        } else {
            const u64 key = (u64)keys[g];
            const i64 t = which[g];
#pragma unroll 1  // one inlined copy of the initializer math (registers, code size)
            for (int k = 0; k < W; ++k) {
                dst[k] = kd_initial_value(key, t, c + k, num_tables, prm, iprm);
            }
        }
        if (c == 0) stored[i] = r >= 0;
    }
}

// ---------------------------------------------------------------- kernels

// out[i, j] (float32, [n, dim] row-major): column j of the initial row of keys[i] in table
// tids[i] (0 without tids), as KeyedInitializer.__call__. One thread per element.
extern "C" __global__ void kd_initial_rows(const i64* __restrict__ keys,
                                           const i64* __restrict__ tids, int has_tids, i64 n,
                                           i64 dim, i64 num_tables,
                                           const double* __restrict__ prm,
                                           const i64* __restrict__ iprm,
                                           float* __restrict__ out) {
    const i64 total = n * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = idx / dim;
        const i64 j = idx - i * dim;
        const i64 t = has_tids ? tids[i] : 0;
        out[idx] = kd_initial_value((u64)keys[i], t, j, num_tables, prm, iprm);
    }
}

// The rows of n occurrences (keyed.expand_rows, Backend.expand_rows): out[i, :] = values[r, :]
// with r = rows[inverse[i]] (values [*, dim], out [n, dim] float32), or where r < 0 the initial
// row of (keys[g], which[g]) from the initializers (prm, iprm), g = inverse[i]; stored[i] = r >= 0.
// rows, keys, which: per run; only occurrences without a row compute an initial row. vec4: dim
// % 4 == 0 and values 16-byte aligned, a thread per 4 columns (float4 copies); else per column.
extern "C" __global__ void kd_expand_rows(const float* __restrict__ values,
                                          const i64* __restrict__ rows,
                                          const i64* __restrict__ inverse,
                                          const i64* __restrict__ keys,
                                          const i64* __restrict__ which, int vec4, i64 n, i64 dim,
                                          i64 num_tables, const double* __restrict__ prm,
                                          const i64* __restrict__ iprm, float* __restrict__ out,
                                          bool* __restrict__ stored) {
    if (vec4) {
        kd_expand<4>(values, rows, inverse, keys, which, n, dim, num_tables, prm, iprm, out,
                     stored);
    } else {
        kd_expand<1>(values, rows, inverse, keys, which, n, dim, num_tables, prm, iprm, out,
                     stored);
    }
}

// fingerprint: mix64(key ^ mix64(tid * GOLDEN)) with the sign bit flipped and bit 0 cleared
// (without tids: mix64(key) ...; tid 0 gives the same, mix64(0) == 0).
extern "C" __global__ void kd_fingerprint(const i64* __restrict__ keys,
                                          const i64* __restrict__ tids, int has_tids, i64 n,
                                          i64* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 x = (u64)keys[i];
        if (has_tids) x ^= kd_mix64((u64)tids[i] * KD_GOLDEN);
        out[i] = (i64)((kd_mix64(x) ^ KD_SIGN) & ~1ULL);
    }
}
