// CUDA kernels of the hash tables' sparse update (see cuda/sparse_update.py): the gradient sum of
// duplicate keys and row-wise Adagrad, the same bits as the torch code they replace
// (hashing.segment_sum_sorted, adagrad.adagrad_update). Compiled with --fmad=false: no
// multiply-add is contracted, every float op rounds once, in the torch code's order.

typedef long long i64;

// One round of segment_sum_sorted's pairwise tree, in place on x [m, dim] (rows sorted by run):
// row i, of rank r = i - starts[group[i]] in a run of counts[group[i]] rows, adds row i + step
// when r is a multiple of 2 * step and r + step is in the run. Row i + step has rank
// r + step, an odd multiple of step: no row is read and written in the same round.
extern "C" __global__ void su_tree_round(float* __restrict__ x, const i64* __restrict__ group,
                                         const i64* __restrict__ starts,
                                         const i64* __restrict__ counts, i64 m, i64 dim,
                                         i64 step) {
    const i64 total = m * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = idx / dim;
        const i64 g = group[i];
        const i64 r = i - starts[g];
        if (r % (2 * step) == 0 && r + step < counts[g]) {
            x[idx] = __fadd_rn(x[idx], x[idx + step * dim]);
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

// Row-wise Adagrad as adagrad.adagrad_update (torch.optim.Adagrad, lr_decay 0, weight_decay 0)
// on distinct rows: state = fma(g, g, acc); std = sqrt(state) + eps; v += (neg_lr * g) / std.
// A row of -1 is skipped (a static-shape caller's unselected entry).
extern "C" __global__ void su_adagrad(float* __restrict__ values, float* __restrict__ accum,
                                      const i64* __restrict__ rows, const float* __restrict__ grads,
                                      i64 n, i64 dim, float neg_lr, float eps) {
    const i64 total = n * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const i64 i = idx / dim;
        if (rows[i] < 0) continue;
        const i64 at = rows[i] * dim + (idx - i * dim);
        const float g = grads[idx];
        const float state = su_fma_f32(g, g, accum[at]);
        const float std = __fadd_rn(__fsqrt_rn(state), eps);
        values[at] = __fadd_rn(values[at], __fdiv_rn(__fmul_rn(neg_lr, g), std));
        accum[at] = state;
    }
}
