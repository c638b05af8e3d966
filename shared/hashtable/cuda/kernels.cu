// CUDA kernels for the slot layout of shared/hashtable/table.py (see cuda/__init__.py).
//
// Block kernels loop over their work with `for (t = threadIdx.x; t < n; t += blockDim.x)` and
// separate phases with __syncthreads(), so they give the same result for any block size (the
// tests compare them with the torch core on the device). Indices that cross into int32 are
// bounded by the host (n < 2**31 keys a call).

typedef long long i64;
typedef unsigned long long u64;

#define HT_SIGN 0x8000000000000000ULL

#ifndef HT_SMEM
#define HT_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---------------------------------------------------------------- hashing (= hashing.py)

__device__ __forceinline__ u64 ht_mix64(u64 x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

// mix64(key ^ mix64(tid * GOLDEN)) with the sign bit flipped and the lowest bit cleared.
__device__ __forceinline__ i64 ht_fingerprint(i64 key, i64 tid) {
    u64 x = (u64)key;
    if (tid != 0) x ^= ht_mix64((u64)tid * 0x9E3779B97F4A7C15ULL);
    return (i64)((ht_mix64(x) ^ HT_SIGN) & ~1ULL);
}

// floor(u * nb / 2**64) for the unsigned value u of the fingerprint: the high word of u * nb.
__device__ __forceinline__ i64 ht_bucket(i64 fp, i64 nb) {
    return (i64)__umul64hi((u64)fp ^ HT_SIGN, (u64)nb);
}

// ---------------------------------------------------------------- find

// Lower bound of fp in the globally sorted slot_fp, known to lie in [base, base + c]
// (slots before the bucket hold smaller values, slot base + c a larger one or the array's end).
// W == 0: binary search. W > 0: an interpolation guess (fingerprints are uniform inside the
// bucket's range) and a window of W slots read with 16-byte loads, moved by whole windows
// while the bound lies outside it; needs slot_fp 16-byte aligned, cap even and cap >= W.
// *fp_at gets slot_fp[result] (or 1, an odd non-fingerprint, past the end).
template <int W>
__device__ __forceinline__ i64 ht_lower_bound(const i64* __restrict__ slot_fp, i64 fp, i64 nb,
                                              i64 base, i64 c, i64 cap, i64* fp_at) {
    if constexpr (W == 0) {
        i64 lo = base, hi = base + c;
        while (lo < hi) {
            i64 mid = (lo + hi) >> 1;
            if (slot_fp[mid] < fp) lo = mid + 1;
            else hi = mid;
        }
        *fp_at = lo < cap ? slot_fp[lo] : 1;
        return lo;
    } else {
        const u64 u = (u64)fp ^ HT_SIGN;
        const double frac = (double)(u * (u64)nb) * 5.421010862427522e-20;  // fraction in bucket
        i64 ws = base + (i64)(frac * (double)c) - W / 2;
        ws = ws < 0 ? 0 : ws;
        ws = ws > cap - W ? cap - W : ws;
        ws &= ~(i64)1;
        i64 v[W];
        int dir = 0;
        while (true) {
#pragma unroll
            for (int j = 0; j < W; j += 2) {
                const longlong2 t = *reinterpret_cast<const longlong2*>(slot_fp + ws + j);
                v[j] = t.x;
                v[j + 1] = t.y;
            }
            if (dir <= 0 && v[0] >= fp && ws > base) {
                dir = -1;
                ws = ws - W < base ? (base & ~(i64)1) : ws - W;
                continue;
            }
            if (dir >= 0 && v[W - 1] < fp && ws + W <= base + c && ws + W < cap) {
                dir = 1;
                ws = ws + W > cap - W ? cap - W : ws + W;
                continue;
            }
            break;
        }
        int cnt = 0;
        i64 at = 1;
#pragma unroll
        for (int j = 0; j < W; ++j) cnt += v[j] < fp ? 1 : 0;
#pragma unroll
        for (int j = 0; j < W; ++j) at = j == cnt ? v[j] : at;
        const i64 p = ws + cnt;
        if (cnt == W) at = p < cap ? slot_fp[p] : 1;
        *fp_at = at;
        return p;
    }
}

// Row of (key, tid) or -1: the lower bound, then the run of equal fingerprints (two stored
// pairs share one only when their mixes differ in the dropped lowest bit, or by chance across
// table ids), comparing the full pair like HashTable._row_match.
template <int W>
__device__ __forceinline__ i64 ht_locate(const i64* __restrict__ slot_fp,
                                         const i64* __restrict__ slot_row,
                                         const i64* __restrict__ row_key,
                                         const int* __restrict__ row_tid,
                                         const i64* __restrict__ bucket_count, i64 nb, i64 bc,
                                         i64 cap, int check_tid, i64 key, i64 tid, i64 fp) {
    const i64 b = ht_bucket(fp, nb);
    const i64 base = b * bc;
    i64 c = bucket_count[b];
    c = c > bc ? bc : c;
    i64 at;
    i64 p = ht_lower_bound<W>(slot_fp, fp, nb, base, c, cap, &at);
    while (at == fp) {
        const i64 r = slot_row[p];
        if (row_key[r] == key && (!check_tid || (i64)row_tid[r] == tid)) return r;
        if (++p >= cap) break;
        at = slot_fp[p];
    }
    return -1;
}

// rows[i], found[i] of keys[i] (table id tids[i] when has_tids, else 0).
template <int W>
__global__ void ht_find(const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids,
                        i64 n, const i64* __restrict__ slot_fp, const i64* __restrict__ slot_row,
                        const i64* __restrict__ row_key, const int* __restrict__ row_tid,
                        const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap,
                        int check_tid, i64* __restrict__ rows, bool* __restrict__ found) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 key = keys[i];
    const i64 tid = has_tids ? tids[i] : 0;
    const i64 r = ht_locate<W>(slot_fp, slot_row, row_key, row_tid, bucket_count, nb, bc, cap,
                               check_tid, key, tid, ht_fingerprint(key, tid));
    rows[i] = r;
    found[i] = r >= 0;
}

// ---------------------------------------------------------------- bulk build

// Count the keys of each of nb buckets; the first bc of a bucket are staged (input index) at
// stage[b * bc + arrival] (arrival order is arbitrary: the placement sorts).
extern "C" __global__ void ht_build_count(const i64* __restrict__ keys,
                                          const i64* __restrict__ tids, int has_tids, i64 n,
                                          i64 nb, i64 bc, u64* __restrict__ count,
                                          int* __restrict__ stage) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 b = ht_bucket(ht_fingerprint(keys[i], has_tids ? tids[i] : 0), nb);
    const u64 pos = atomicAdd(count + b, 1ULL);
    if ((i64)pos < bc) stage[b * bc + pos] = (int)i;
}

// One block per bucket: the staged keys go to slots base + rank by (fingerprint, input index),
// what HashTable._rebuild's stable sort by fingerprint gives; rows equal slots. The table's
// arrays come freshly allocated (sentinels, -1 keys, zero rows). dup_flag: two equal pairs.
extern "C" __global__ void ht_build_place(
    const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids,
    const i64* __restrict__ scores, int has_scores, const float* __restrict__ values,
    const float* __restrict__ accum_in, int has_accum, int dim, i64 bc,
    const i64* __restrict__ count, const int* __restrict__ stage, i64* __restrict__ slot_fp,
    i64* __restrict__ row_key, int* __restrict__ row_tid, i64* __restrict__ row_score,
    float* __restrict__ out_values, float* __restrict__ out_accum, int* __restrict__ dup_flag) {
    HT_SMEM(smem);
    i64* s_fp = reinterpret_cast<i64*>(smem);  // [bc]
    int* s_idx = reinterpret_cast<int*>(s_fp + bc);  // [bc] input index of each staged key
    int* s_src = s_idx + bc;  // [bc] input index of each slot
    const i64 b = blockIdx.x;
    const i64 base = b * bc;
    const i64 c = count[b];
    for (i64 t = threadIdx.x; t < c; t += blockDim.x) {
        const int j = stage[base + t];
        s_idx[t] = j;
        s_fp[t] = ht_fingerprint(keys[j], has_tids ? tids[j] : 0);
    }
    __syncthreads();
    for (i64 t = threadIdx.x; t < c; t += blockDim.x) {
        const i64 fp = s_fp[t];
        const int j = s_idx[t];
        const i64 key = keys[j];
        const i64 tid = has_tids ? tids[j] : 0;
        int rank = 0;
        for (i64 u = 0; u < c; ++u) {
            const i64 f = s_fp[u];
            if (f < fp || (f == fp && s_idx[u] < j)) ++rank;
            if (f == fp && u != t && keys[s_idx[u]] == key &&
                (has_tids ? tids[s_idx[u]] : 0) == tid)
                *dup_flag = 1;
        }
        const i64 slot = base + rank;
        slot_fp[slot] = fp;
        row_key[slot] = key;
        row_tid[slot] = (int)tid;
        row_score[slot] = has_scores ? scores[j] : 0;
        s_src[rank] = j;
    }
    __syncthreads();
    for (i64 e = threadIdx.x; e < c * dim; e += blockDim.x) {
        const i64 r = e / dim, d = e - r * dim;
        const i64 src = (i64)s_src[r] * dim + d;
        out_values[(base + r) * dim + d] = values[src];
        if (has_accum) out_accum[(base + r) * dim + d] = accum_in[src];
    }
}

// ---------------------------------------------------------------- insert_or_assign

// Per input key: its row if stored (win[row] = last input index using it), else staged in its
// bucket's list (stage[b * S + arrival], arrival order arbitrary; count past S means the caller
// falls back to the torch core).
template <int W>
__global__ void ht_insert_stage(const i64* __restrict__ keys, const i64* __restrict__ tids,
                                int has_tids, i64 n, const i64* __restrict__ slot_fp,
                                const i64* __restrict__ slot_row, const i64* __restrict__ row_key,
                                const int* __restrict__ row_tid,
                                const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap,
                                int check_tid, i64 S, i64* __restrict__ row_found,
                                int* __restrict__ win, u64* __restrict__ scount,
                                int* __restrict__ stage, u64* __restrict__ stats) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 key = keys[i];
    const i64 tid = has_tids ? tids[i] : 0;
    if (key < 0) atomicOr(stats + 1, 1ULL);  // the host raises HashTable's error
    if (tid < 0 || tid >= (1LL << 31)) atomicOr(stats + 2, 1ULL);
    const i64 fp = ht_fingerprint(key, tid);
    const i64 r = ht_locate<W>(slot_fp, slot_row, row_key, row_tid, bucket_count, nb, bc, cap,
                               check_tid, key, tid, fp);
    row_found[i] = r;
    if (r >= 0) {
        atomicMax(win + r, (int)i);
    } else {
        const i64 b = ht_bucket(fp, nb);
        const u64 pos = atomicAdd(scount + b, 1ULL);
        if ((i64)pos < S) stage[b * S + pos] = (int)i;
        else atomicAdd(stats + 0, 1ULL);  // the host falls back to the torch core
    }
}

// One block per bucket with staged new keys: deduplicate pairs (the last input occurrence
// represents the pair: rep_of[i]), order the representatives by (fingerprint, table id, key),
// the order HashTable._insert_new's stable sort of the unique pairs gives, and write them back
// to stage[b * S + rank]; nnew[b] = their number. stats: [3] a new pair has a non-zero table
// id, [4] new pairs, [5] max over buckets of stored + new, [6] buckets that overflow, [7] their
// new pairs.
extern "C" __global__ void ht_insert_plan(const i64* __restrict__ keys,
                                          const i64* __restrict__ tids, int has_tids, i64 S,
                                          const u64* __restrict__ scount, int* __restrict__ stage,
                                          const i64* __restrict__ bucket_count, i64 bc,
                                          int* __restrict__ rep_of, i64* __restrict__ nnew,
                                          u64* __restrict__ stats) {
    HT_SMEM(smem);
    i64* s_fp = reinterpret_cast<i64*>(smem);  // [S]
    i64* s_key = s_fp + S;  // [S]
    i64* s_tid = s_key + S;  // [S]
    int* s_idx = reinterpret_cast<int*>(s_tid + S);  // [S]
    int* s_rep = s_idx + S;  // [S] 1 if the entry represents its pair
    __shared__ int s_n, s_any_tid;
    const i64 b = blockIdx.x;
    const i64 k = (i64)scount[b];
    if (k == 0 || k > S) return;  // k > S: the host falls back to the torch core
    if (threadIdx.x == 0) s_n = s_any_tid = 0;
    for (i64 t = threadIdx.x; t < k; t += blockDim.x) {
        const int j = stage[b * S + t];
        s_idx[t] = j;
        s_key[t] = keys[j];
        s_tid[t] = has_tids ? tids[j] : 0;
        s_fp[t] = ht_fingerprint(s_key[t], s_tid[t]);
    }
    __syncthreads();
    for (i64 t = threadIdx.x; t < k; t += blockDim.x) {
        int rep = s_idx[t];
        for (i64 u = 0; u < k; ++u)
            if (s_fp[u] == s_fp[t] && s_key[u] == s_key[t] && s_tid[u] == s_tid[t] &&
                s_idx[u] > rep)
                rep = s_idx[u];
        rep_of[s_idx[t]] = rep;
        s_rep[t] = rep == s_idx[t];
        if (s_rep[t]) atomicAdd(&s_n, 1);
        if (s_rep[t] && s_tid[t] != 0) s_any_tid = 1;
    }
    __syncthreads();
    for (i64 t = threadIdx.x; t < k; t += blockDim.x) {
        if (!s_rep[t]) continue;
        const i64 fp = s_fp[t], key = s_key[t], tid = s_tid[t];
        int rank = 0;
        for (i64 u = 0; u < k; ++u) {
            if (!s_rep[u]) continue;
            const i64 f = s_fp[u];
            if (f < fp || (f == fp && (s_tid[u] < tid || (s_tid[u] == tid && s_key[u] < key))))
                ++rank;
        }
        stage[b * S + rank] = s_idx[t];
    }
    if (threadIdx.x == 0) {
        const u64 u = (u64)s_n, fill = (u64)bucket_count[b] + u;
        nnew[b] = (i64)u;
        if (s_any_tid) atomicOr(stats + 3, 1ULL);
        atomicAdd(stats + 4, u);
        atomicMax(stats + 5, fill);
        if ((i64)fill > bc) {
            atomicAdd(stats + 6, 1ULL);
            atomicAdd(stats + 7, u);
        }
    }
}

// Stored keys used by the call: the last occurrence's values, score (and accumulators).
extern "C" __global__ void ht_insert_assign(const i64* __restrict__ row_found,
                                            const int* __restrict__ win, i64 n,
                                            const float* __restrict__ values,
                                            const i64* __restrict__ scores,
                                            const float* __restrict__ accum_in, int has_accum,
                                            int dim, float* __restrict__ out_values,
                                            i64* __restrict__ row_score,
                                            float* __restrict__ out_accum) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 r = row_found[i];
    if (r < 0 || win[r] != (int)i) return;
    row_score[r] = scores[i];
    for (int d = 0; d < dim; ++d) out_values[r * dim + d] = values[i * dim + d];
    if (has_accum)
        for (int d = 0; d < dim; ++d) out_accum[r * dim + d] = accum_in[i * dim + d];
}

// One block per bucket whose new keys fit: the j-th new key (in stage order) takes the row of
// empty slot c + j; the c stored and the u new entries merge by fingerprint (stored first on
// ties), as the stable re-sort of HashTable._resort leaves them. rep_rows[i] = row of rep i.
extern "C" __global__ void ht_insert_merge(
    const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids,
    const float* __restrict__ values, const i64* __restrict__ scores,
    const float* __restrict__ accum_in, int has_accum, float accum_init, int dim, i64 bc, i64 S,
    const int* __restrict__ stage, const i64* __restrict__ nnew, i64* __restrict__ bucket_count,
    i64* __restrict__ slot_fp, i64* __restrict__ slot_row, i64* __restrict__ row_key,
    int* __restrict__ row_tid, i64* __restrict__ row_score, float* __restrict__ out_values,
    float* __restrict__ out_accum, int has_out_accum, i64* __restrict__ rep_rows) {
    HT_SMEM(smem);
    i64* e_fp = reinterpret_cast<i64*>(smem);  // [bc] stored fingerprints
    i64* e_row = e_fp + bc;  // [bc]
    i64* n_fp = e_row + bc;  // [bc] new fingerprints
    i64* n_row = n_fp + bc;  // [bc]
    int* n_idx = reinterpret_cast<int*>(n_row + bc);  // [bc] input index of each new key
    const i64 b = blockIdx.x;
    const i64 u = nnew[b];
    const i64 c = bucket_count[b];
    if (u == 0 || c + u > bc) return;
    const i64 base = b * bc;
    for (i64 t = threadIdx.x; t < c; t += blockDim.x) {
        e_fp[t] = slot_fp[base + t];
        e_row[t] = slot_row[base + t];
    }
    for (i64 j = threadIdx.x; j < u; j += blockDim.x) {
        const int i = stage[b * S + j];
        n_idx[j] = i;
        n_fp[j] = ht_fingerprint(keys[i], has_tids ? tids[i] : 0);
        n_row[j] = slot_row[base + c + j];
    }
    __syncthreads();
    for (i64 t = threadIdx.x; t < c; t += blockDim.x) {
        i64 pos = t;
        for (i64 j = 0; j < u; ++j) pos += n_fp[j] < e_fp[t] ? 1 : 0;
        slot_fp[base + pos] = e_fp[t];
        slot_row[base + pos] = e_row[t];
    }
    for (i64 j = threadIdx.x; j < u; j += blockDim.x) {
        i64 pos = j;
        for (i64 t = 0; t < c; ++t) pos += e_fp[t] <= n_fp[j] ? 1 : 0;
        const int i = n_idx[j];
        const i64 r = n_row[j];
        slot_fp[base + pos] = n_fp[j];
        slot_row[base + pos] = r;
        row_key[r] = keys[i];
        row_tid[r] = has_tids ? (int)tids[i] : 0;
        row_score[r] = scores[i];
        rep_rows[i] = r;
    }
    for (i64 e = threadIdx.x; e < u * dim; e += blockDim.x) {
        const i64 j = e / dim, d = e - j * dim;
        const i64 src = (i64)n_idx[j] * dim + d;
        out_values[n_row[j] * dim + d] = values[src];
        if (has_out_accum) out_accum[n_row[j] * dim + d] = has_accum ? accum_in[src] : accum_init;
    }
    __syncthreads();
    if (threadIdx.x == 0) bucket_count[b] = c + u;
}

// rows[i]: the stored row, or the row its pair's representative got (-1: refused);
// inserted[i]: the pair was new and is stored now.
extern "C" __global__ void ht_insert_rows(const i64* __restrict__ row_found,
                                          const int* __restrict__ rep_of,
                                          const i64* __restrict__ rep_rows, i64 n,
                                          i64* __restrict__ rows, bool* __restrict__ inserted) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 r = row_found[i];
    if (r >= 0) {
        rows[i] = r;
        inserted[i] = false;
    } else {
        const i64 q = rep_rows[rep_of[i]];
        rows[i] = q;
        inserted[i] = q >= 0;
    }
}
