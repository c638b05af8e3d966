// CUDA kernels of the hash tables' sparse update (see cuda/sparse_update.py): the gradient sum of
// duplicate keys and row-wise Adagrad, the same bits as the torch code they replace
// (hashing.segment_sum_sorted, adagrad.adagrad_update). Compiled with --fmad=false: no
// multiply-add is contracted, every float op rounds once, in the torch code's order.

typedef long long i64;

// Rows of the sorted sum: sorted position i reads x row (order ? order[i] : i). A row of dim
// floats is dim / 4 float4 when dim % 4 == 0 and the arrays are 16-byte aligned (su_vec), else
// dim floats.
#define SU_LEAF 16  // ranks su_leaf sums in registers: rounds step = 1, 2, 4, 8 of the tree

__device__ __forceinline__ float su_add(float a, float b) { return __fadd_rn(a, b); }

__device__ __forceinline__ float4 su_add(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                       __fadd_rn(a.w, b.w));
}

__device__ __forceinline__ bool su_vec(i64 dim, const void* a, const void* b) {
    return (dim & 3) == 0 && (((unsigned long long)a | (unsigned long long)b) & 15) == 0;
}

// a / b for 0 <= a, 0 < b; in 32 bits when narrow (a, b < 2**32): a 64-bit division costs
// several times more, and every thread of these kernels does one.
__device__ __forceinline__ i64 su_div(i64 a, i64 b, bool narrow) {
    return narrow ? (i64)((unsigned)a / (unsigned)b) : a / b;
}

__device__ __forceinline__ i64 su_src(const i64* __restrict__ order, i64 i) {
    return order != nullptr ? order[i] : i;
}

// The pairwise tree (rounds step 1, 2) of the min(n, 4) rows at sorted positions i .. i + 3,
// column c of w; v0: row i's, loaded by the caller.
template <typename V>
__device__ __forceinline__ V su_tree4(V v0, const V* __restrict__ x,
                                      const i64* __restrict__ order, i64 i, i64 n, i64 w,
                                      i64 c) {
    V v1, v2, v3;
    if (n > 1) v1 = x[su_src(order, i + 1) * w + c];
    if (n > 2) v2 = x[su_src(order, i + 2) * w + c];
    if (n > 3) v3 = x[su_src(order, i + 3) * w + c];
    if (n > 1) v0 = su_add(v0, v1);
    if (n > 3) v2 = su_add(v2, v3);
    if (n > 2) v0 = su_add(v0, v2);
    return v0;
}

// Column c (of w) of su_leaf's row i: the tree (rounds step 1 .. 8) of the n (1..SU_LEAF) rows
// at i .. i + n - 1, four rows at a time (rounds 1, 2 in su_tree4; 4: rows 0 + 4, 8 + 12;
// 8: rows 0 + 8): the torch rounds' additions, few registers.
template <typename V>
__device__ __forceinline__ void su_leaf_row(V* __restrict__ out, const V* __restrict__ x,
                                            const i64* __restrict__ order,
                                            const i64* __restrict__ group,
                                            const i64* __restrict__ starts,
                                            const i64* __restrict__ counts, i64 i, i64 w, i64 c) {
    const V first = x[su_src(order, i) * w + c];  // every row reads its own: issued at once
    const i64 g = group[i];
    const i64 r = i - starts[g];
    const i64 left = counts[g] - r;  // rows from this one to the run's end
    const i64 low = r & -r;
    const i64 b = (r == 0 || low > SU_LEAF) ? SU_LEAF : low;
    const i64 n = left < 1 ? 1 : (left < b ? left : b);
    V s = su_tree4(first, x, order, i, n, w, c);
    if (n > 4) {
        const V v4 = x[su_src(order, i + 4) * w + c];
        s = su_add(s, su_tree4(v4, x, order, i + 4, n - 4, w, c));
    }
    if (n > 8) {
        const V v8 = x[su_src(order, i + 8) * w + c];
        V t = su_tree4(v8, x, order, i + 8, n - 8, w, c);
        if (n > 12) {
            const V v12 = x[su_src(order, i + 12) * w + c];
            t = su_add(t, su_tree4(v12, x, order, i + 12, n - 12, w, c));
        }
        s = su_add(s, t);
    }
    out[i * w + c] = s;
}

// The rounds step = 1 .. SU_LEAF / 2 of segment_sum_sorted's tree on x [m, dim] read through
// order (null: x already sorted), into work [m, dim]: work row i (rank r = i - starts[group[i]]
// in a run of counts[group[i]] rows) gets the value the torch code's row i holds after those
// rounds: the tree of ranks r .. r + b - 1 cut at the run's end, b = the largest power of two
// dividing r (SU_LEAF for r = 0), at most SU_LEAF; a row past its run's end is copied. One
// thread per (row, float4 or float); blocks of 256 threads (runtime.BLOCK), at least 4 an SM:
// 64 registers (92 uncapped: 2 blocks an SM; 41 µs instead of 52 on the H200 for 400K rows
// of dim 16, a few spills included).
extern "C" __launch_bounds__(256, 4) __global__ void su_leaf(
    float* __restrict__ work, const float* __restrict__ x, const i64* __restrict__ order,
    const i64* __restrict__ group, const i64* __restrict__ starts,
    const i64* __restrict__ counts, i64 m, i64 dim) {
    const bool vec = su_vec(dim, x, work);
    const i64 w = vec ? dim >> 2 : dim;
    const i64 total = m * w;
    const bool narrow = total <= 0xffffffffLL;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = su_div(idx, w, narrow);
        const i64 c = idx - i * w;
        if (vec) {
            su_leaf_row((float4*)work, (const float4*)x, order, group, starts, counts, i, w, c);
        } else {
            su_leaf_row(work, x, order, group, starts, counts, i, w, c);
        }
    }
}

// One round (step a power of two) of segment_sum_sorted's pairwise tree, in place on x [m, dim]
// (rows sorted by run): row i, of rank r = i - starts[group[i]] in a run of counts[group[i]]
// rows, adds row i + step when r is a multiple of 2 * step and r + step is in the run. Row
// i + step has rank r + step, an odd multiple of step: no row is read and written in the same
// round. One thread per row, returning at once when it does not add (most rows, most rounds).
extern "C" __global__ void su_tree_round(float* __restrict__ x, const i64* __restrict__ group,
                                         const i64* __restrict__ starts,
                                         const i64* __restrict__ counts, i64 m, i64 dim,
                                         i64 step) {
    const bool vec = su_vec(dim, x, x);
    const i64 w = vec ? dim >> 2 : dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += stride) {
        const i64 g = group[i];
        const i64 r = i - starts[g];
        if ((r & (2 * step - 1)) != 0 || r + step >= counts[g]) continue;  // not adding now
        if (vec) {
            float4* y = (float4*)x + i * w;
            for (i64 c = 0; c < w; ++c) y[c] = su_add(y[c], y[c + step * w]);
        } else {
            float* y = x + i * dim;
            for (i64 c = 0; c < dim; ++c) y[c] = __fadd_rn(y[c], y[c + step * dim]);
        }
    }
}

// a * b + c rounded once to float32, as adagrad.fma_f32 computes it: the exact float64 product,
// the float64 sum corrected by its TwoSum error where it sits on a float32 rounding midpoint.
__device__ __forceinline__ float su_fma_f32(float a, float b, float c) {
    const double p = __dmul_rn((double)a, (double)b);
    const double c64 = (double)c;
    double hi = __dadd_rn(p, c64);
    const double bb = __dsub_rn(hi, p);
    const double lo = __dadd_rn(__dsub_rn(p, __dsub_rn(hi, bb)), __dsub_rn(c64, bb));
    const long long bits = __double_as_longlong(hi);
    const bool midpoint = (bits & ((1LL << 29) - 1)) == (1LL << 28);
    const double inf = __longlong_as_double(0x7ff0000000000000LL);
    if (midpoint && lo != 0.0) hi = nextafter(hi, lo > 0.0 ? inf : -inf);
    return __double2float_rn(hi);
}

// One element of row-wise Adagrad: state = fma(g, g, acc); std = sqrt(state) + eps;
// v += (neg_lr * g) / std.
__device__ __forceinline__ void su_adagrad1(float& v, float& acc, float g, float neg_lr,
                                            float eps) {
    const float state = su_fma_f32(g, g, acc);
    const float std = __fadd_rn(__fsqrt_rn(state), eps);
    v = __fadd_rn(v, __fdiv_rn(__fmul_rn(neg_lr, g), std));
    acc = state;
}

// Row-wise Adagrad as adagrad.adagrad_update (torch.optim.Adagrad, lr_decay 0, weight_decay 0)
// on distinct rows. Entry i's gradient is grads row (from ? from[i] : i) (from: the runs'
// starts, where the tree left each run's sum). A row of -1 is skipped (a static-shape caller's
// unselected entry). One thread per (entry, float4 or float: su_vec of the three arrays).
extern "C" __global__ void su_adagrad(float* __restrict__ values, float* __restrict__ accum,
                                      const i64* __restrict__ rows, const float* __restrict__ grads,
                                      const i64* __restrict__ from, i64 n, i64 dim,
                                      const float* __restrict__ neg_lr_at, float eps) {
    const float neg_lr = *neg_lr_at;  // on the device: a captured graph reads the current rate
    const bool vec = su_vec(dim, values, accum) && su_vec(dim, grads, grads);
    const i64 w = vec ? dim >> 2 : dim;
    const i64 total = n * w;
    const bool narrow = total <= 0xffffffffLL;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = su_div(idx, w, narrow);
        const i64 row = rows[i];
        if (row < 0) continue;
        const i64 c = idx - i * w;
        const i64 at = row * w + c;
        const i64 src = (from != nullptr ? from[i] : i) * w + c;
        if (vec) {
            float4 v = ((const float4*)values)[at];
            float4 a = ((const float4*)accum)[at];
            const float4 g = ((const float4*)grads)[src];
            su_adagrad1(v.x, a.x, g.x, neg_lr, eps);
            su_adagrad1(v.y, a.y, g.y, neg_lr, eps);
            su_adagrad1(v.z, a.z, g.z, neg_lr, eps);
            su_adagrad1(v.w, a.w, g.w, neg_lr, eps);
            ((float4*)values)[at] = v;
            ((float4*)accum)[at] = a;
        } else {
            su_adagrad1(values[at], accum[at], grads[src], neg_lr, eps);
        }
    }
}
