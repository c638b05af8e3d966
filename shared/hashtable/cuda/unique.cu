// CUDA kernels of the deterministic unique of (table id, key) pairs (see cuda/unique.py): the
// same tensors as hashing.unique_pairs, around torch's stable sorts, in three launches and one
// cumsum instead of some thirty torch ops.
//
// Every index is int64 and every loop a grid-stride loop, so any n runs with a bounded grid.
// Each output position is written by exactly one thread: no atomics, the same bits every run.

typedef long long i64;

// tid32[i] = (int32) tids[order[i]]: the table ids in key order, as the torch code's
// table_ids[order].to(torch.int32) (a conversion that keeps the low 32 bits).
extern "C" __global__ void uq_gather_tid(const i64* __restrict__ tids,
                                         const i64* __restrict__ order, int* __restrict__ tid32,
                                         i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        tid32[i] = (int)tids[order[i]];
    }
}

// Run flags of the sorted pairs, for a cumsum that gives the 0-based unique index of each sorted
// position: flags[i] = 1 where pair i differs from pair i - 1 (i >= 1), flags[0] = 0. With table
// ids (has_tids), the pairs are sorted by key, then stably by table id (tidx: that second sort's
// indices, tsorted its values): order[i] = korder[tidx[i]] is written and the keys compared are
// keys[order[i]]; without, the sorted keys ksorted (order is korder). flags[n] (the cumsum's last
// element, read on the host with the unique count) is 2**62 if the smallest key, ksorted[0], is
// negative, else 0: group[n - 1] < 2**62, so the bit reads apart.
extern "C" __global__ void uq_flags(const i64* __restrict__ keys, const i64* __restrict__ ksorted,
                                    const i64* __restrict__ korder, const i64* __restrict__ tidx,
                                    const int* __restrict__ tsorted, i64* __restrict__ order,
                                    i64* __restrict__ flags, int has_tids, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 change = 0;
        if (has_tids) {
            const i64 o = korder[tidx[i]];
            order[i] = o;
            if (i > 0) {
                const i64 p = korder[tidx[i - 1]];
                change = (keys[o] != keys[p]) || (tsorted[i] != tsorted[i - 1]);
            }
        } else if (i > 0) {
            change = ksorted[i] != ksorted[i - 1];
        }
        flags[i] = change;
        if (i == 0) flags[n] = ksorted[0] < 0 ? (1LL << 62) : 0;
    }
}

// The runs of the unique indices group [n] (non-decreasing, 0-based): starts[g] = first sorted
// position of g, ends[g] = one past its last (the caller subtracts starts: the counts), and
// inverse[order[i]] = group[i] (order is a permutation: each inverse entry is written once).
extern "C" __global__ void uq_runs(const i64* __restrict__ group, const i64* __restrict__ order,
                                   i64* __restrict__ starts, i64* __restrict__ ends,
                                   i64* __restrict__ inverse, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const i64 g = group[i];
        inverse[order[i]] = g;
        if (i == 0 || group[i - 1] != g) starts[g] = i;
        if (i == n - 1 || group[i + 1] != g) ends[g] = i + 1;
    }
}
