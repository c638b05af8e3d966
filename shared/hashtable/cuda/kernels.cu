// CUDA kernels for the slot layout of shared/hashtable/layout.py (see cuda/__init__.py).
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
// table ids), comparing the full pair like TorchBackend._row_match.
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
// what TorchBackend._rebuild's stable sort by fingerprint gives; rows equal slots. The table's
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
//
// insert.py's path (an earlier block-per-bucket version is in git history). Three launches
// (four for a table that may grow) on torch's stream and one host read (the stats, copied
// after place pass 0):
//
// 1. ht_ins2_stage_w<W> (a thread per key): locate; a stored key marks its row in win
//    (atomicMax: the last occurrence wins), a new occurrence is staged (input index) in its
//    bucket's list stage[b * S + arrival]. Counters are aggregated per warp (ballot) and per
//    block (shared memory): one global atomic per block and counter, not per key. With a
//    mask (insert.py's insert_selected, a captured step's call), an unselected key takes no
//    part: rows -1, inserted 0.
// 2. ht_ins2_place0 (a warp per bucket): rank the bucket's staged occurrences by (fingerprint,
//    table id, key, input index): a 32-bit key per entry (the high bits of its position in the
//    bucket's fingerprint range, its list index below) ranks them with one shared-memory load
//    and two compares per pair; the rare runs the key cannot order (equal high bits: duplicates
//    of one pair, or close fingerprints) are re-ranked with the full order. The last
//    occurrence of each pair represents it; count the pairs. When the stage counts rule out
//    growth (always at max capacity, and for any batch that cannot reach the load bound), the
//    warp finalizes at once: the new pairs take the rows of the empty slots, the slots stay
//    sorted, and the warp writes the new rows (key, table id, score; values and accumulators
//    with 2^gshift lanes a row and 16-byte copies): the rows of a bucket lie in its own row
//    range (contiguous for a fresh table), so these writes are coalesced, where a thread per
//    input key scatters partial-sector writes over the whole table.
// 3. ht_ins2_place1, launched only for a table that may grow: where growth looked possible
//    from the stage counts but the exact pair counts of pass 0 rule it out, the same finalize;
//    when pass 0 decided (fast or abort), every block returns after reading the stats.
// 4. ht_ins2_write (2^gshift threads per key): the last occurrence of each stored pair
//    (win[row] == i) assigns its row: score, values, accumulators when given; clears win.
//    New keys (inserted[i]) only cost the read of rows[i] and inserted[i].
//
// Every call leaves the scratch as it found it (scount 0, win -1, the other stats buffer 0),
// so the host allocates and clears nothing per call. When the call cannot finish here (growth,
// a bucket list overflow, invalid keys), no kernel writes to the table (decision 0 below) and
// the host hands the call to the torch backend.
//
// Expected times for 1M new keys, dim 16, load factor 0.5 (15625 buckets of 128) on an H200
// (measured before this version: write 263 us, place 2 x 65 us averaged, stage 37 us):
// - stage: ~37 us (unchanged).
// - place0: ~40-60 us. Ranking: 64 entries a bucket, 2 a lane, 64 iterations of one broadcast
//   load and two 32-bit compares (was 128 iterations of 64-bit compares with a tie branch).
//   Finalize: the gather of 64 MB of input rows (2 full sectors each) and 64 MB of contiguous
//   row writes, ~25 MB of row metadata, the occurrences' rows/inserted: ~150 MB, ~45 us of
//   bandwidth that overlaps the ranking of other warps.
// - place1: not launched for a table at max capacity (the benchmark's); otherwise ~3 us.
// - write: ~5 us when every key is new (rows and inserted read, coalesced); for 1M assigned
//   keys ~40-60 us (random 64-byte rows, now 4 threads a row: 16-byte accesses, a warp covers
//   8 whole rows).

#define HT_ST_STAGED_OVER 0  // new occurrences that found their bucket's list full (S)
#define HT_ST_NEG_KEY 1      // a key is negative
#define HT_ST_BAD_TID 2      // a table id is outside [0, 2**31)
#define HT_ST_MAYBE_FULL 3   // a bucket: stored + staged occurrences > bc
#define HT_ST_STAGED 4       // staged new occurrences (>= new pairs)
#define HT_ST_ANY_TID 5      // a new occurrence has a non-zero table id
#define HT_ST_NEW 6          // new pairs (place pass 0)
#define HT_ST_MAX_FILL 7     // max over buckets with new pairs of stored + new (pass 0)
#define HT_ST_N_OVER 8       // buckets whose new pairs do not fit (at max capacity; pass 0)
#define HT_ST_OVER_NEW 9     // their new pairs (pass 0)
#define HT_ST_OVER_CURSOR 10 // entries of over_list written
#define HT_ST_LEN 16

// What the call does, from the stats: 0 abort (the table stays untouched), 1 fast (the stage
// counts rule out growth: place pass 0 finalizes), 2 slow (pass 1 finalizes: growth was
// possible from the stage counts, the exact counts rule it out). exact = 0 (pass 0, the exact
// counts do not exist yet): 2 means "undecided, count only". Mirrors insert.py's decision.
// new_limit = floor(max_load_factor * nb * bc) - size: the most new pairs without growth.
__device__ __forceinline__ int ht_ins2_decide(const u64* st, int may_grow, i64 new_limit, i64 bc,
                                              int exact) {
    if (st[HT_ST_STAGED_OVER] | st[HT_ST_NEG_KEY] | st[HT_ST_BAD_TID]) return 0;
    if (!may_grow || (st[HT_ST_MAYBE_FULL] == 0 && (i64)st[HT_ST_STAGED] <= new_limit)) return 1;
    if (!exact) return 2;
    return ((i64)st[HT_ST_NEW] > new_limit || (i64)st[HT_ST_MAX_FILL] > bc) ? 0 : 2;
}

// s += the number of lanes of this warp with pred (whole warps must call it).
__device__ __forceinline__ void ht_ins2_count(unsigned int* s, bool pred) {
    const unsigned int m = __ballot_sync(0xffffffffu, pred);
    if ((threadIdx.x & 31) == 0 && m != 0) atomicAdd(s, (unsigned int)__popc(m));
}

// blockDim.x: a multiple of 32 (the ballots); no thread returns before the last barrier.
template <int W>
__device__ __forceinline__ void ht_ins2_stage(
    const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 n,
    const i64* __restrict__ slot_fp, const i64* __restrict__ slot_row,
    const i64* __restrict__ row_key, const int* __restrict__ row_tid,
    const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap, int check_tid, i64 S,
    i64* __restrict__ rows, unsigned char* __restrict__ inserted, int* __restrict__ win,
    unsigned int* __restrict__ scount, int* __restrict__ stage, u64* __restrict__ stats,
    const unsigned char* __restrict__ mask) {
    __shared__ unsigned int s_cnt[6];  // staged over, neg, bad tid, maybe full, staged, any tid
    if (threadIdx.x < 6) s_cnt[threadIdx.x] = 0;
    __syncthreads();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool over = false, neg = false, bad = false, full = false, staged = false, any_tid = false;
    if (i < n && mask != nullptr && !mask[i]) {  // a static call's unselected key: no part
        rows[i] = -1;
        inserted[i] = 0;
    } else if (i < n) {
        const i64 key = keys[i];
        const i64 tid = has_tids ? tids[i] : 0;
        neg = key < 0;
        bad = tid < 0 || tid >= (1LL << 31);
        const i64 fp = ht_fingerprint(key, tid);
        const i64 b = ht_bucket(fp, nb);
        const i64 c = bucket_count[b];
        const i64 r = c > 0 ? ht_locate<W>(slot_fp, slot_row, row_key, row_tid, bucket_count, nb,
                                           bc, cap, check_tid, key, tid, fp)
                            : -1;
        rows[i] = r;
        inserted[i] = 0;
        if (r >= 0) {
            atomicMax(win + r, (int)i);
        } else {
            const unsigned int pos = atomicAdd(scount + b, 1u);
            staged = true;
            any_tid = tid != 0;
            if ((i64)pos < S) stage[b * S + pos] = (int)i;
            else over = true;
            full = c + (i64)pos + 1 > bc;
        }
    }
    ht_ins2_count(s_cnt + 0, over);
    ht_ins2_count(s_cnt + 1, neg);
    ht_ins2_count(s_cnt + 2, bad);
    ht_ins2_count(s_cnt + 3, full);
    ht_ins2_count(s_cnt + 4, staged);
    ht_ins2_count(s_cnt + 5, any_tid);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_cnt[0]) atomicAdd(stats + HT_ST_STAGED_OVER, (u64)s_cnt[0]);
        if (s_cnt[1]) atomicOr(stats + HT_ST_NEG_KEY, 1ULL);
        if (s_cnt[2]) atomicOr(stats + HT_ST_BAD_TID, 1ULL);
        if (s_cnt[3]) atomicOr(stats + HT_ST_MAYBE_FULL, 1ULL);
        if (s_cnt[4]) atomicAdd(stats + HT_ST_STAGED, (u64)s_cnt[4]);
        if (s_cnt[5]) atomicOr(stats + HT_ST_ANY_TID, 1ULL);
    }
}

// One extern "C" kernel per probe window (no template name to register in runtime.py).
#define HT_INS2_STAGE(W)                                                                       \
    extern "C" __global__ void ht_ins2_stage_w##W(                                             \
        const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 n,       \
        const i64* __restrict__ slot_fp, const i64* __restrict__ slot_row,                     \
        const i64* __restrict__ row_key, const int* __restrict__ row_tid,                      \
        const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap, int check_tid, i64 S,   \
        i64* __restrict__ rows, unsigned char* __restrict__ inserted, int* __restrict__ win,   \
        unsigned int* __restrict__ scount, int* __restrict__ stage, u64* __restrict__ stats,  \
        const unsigned char* __restrict__ mask) {                                              \
        ht_ins2_stage<W>(keys, tids, has_tids, n, slot_fp, slot_row, row_key, row_tid,         \
                         bucket_count, nb, bc, cap, check_tid, S, rows, inserted, win, scount, \
                         stage, stats, mask);                                                  \
    }
HT_INS2_STAGE(0)
HT_INS2_STAGE(4)
HT_INS2_STAGE(8)
HT_INS2_STAGE(16)

// Order of staged entries a, b of one bucket: (fingerprint, table id, key, input index), the
// order TorchBackend._insert_new's stable sort by fingerprint of the (table id, key)-sorted unique
// pairs gives, with the input index last. Keys and table ids come from global memory (L2): only
// entries of equal fingerprint need them.
__device__ __forceinline__ bool ht_ins2_less(const i64* s_fp, const int* s_idx,
                                             const i64* __restrict__ keys,
                                             const i64* __restrict__ tids, int has_tids, int a,
                                             int b) {
    const i64 fa = s_fp[a], fb = s_fp[b];
    if (fa != fb) return fa < fb;
    const int ia = s_idx[a], ib = s_idx[b];
    if (has_tids) {
        const i64 ta = tids[ia], tb = tids[ib];
        if (ta != tb) return ta < tb;
    }
    const i64 ka = keys[ia], kb = keys[ib];
    if (ka != kb) return ka < kb;
    return ia < ib;
}

__device__ __forceinline__ bool ht_ins2_same_pair(const i64* s_fp, const int* s_idx,
                                                  const i64* __restrict__ keys,
                                                  const i64* __restrict__ tids, int has_tids,
                                                  int a, int b) {
    if (s_fp[a] != s_fp[b]) return false;
    const int ia = s_idx[a], ib = s_idx[b];
    return keys[ia] == keys[ib] && (!has_tids || tids[ia] == tids[ib]);
}

// Values (and accumulators) of a warp's new rows: row n_row[q] gets input row s_idx[n_t[q]],
// q < u; 2^gshift lanes a row (gshift <= 5), `units` elements of type T a row (float4 when
// vec4: dim % 4 == 0 and arrays 16-byte aligned, else float). Up to 4 rows a lane are loaded
// before they are stored.
template <typename T>
__device__ __forceinline__ void ht_ins2_copy_units(
    int lane, int gshift, int u, const i64* n_row, const short* n_t, const int* s_idx, int units,
    const T* __restrict__ vin, const T* __restrict__ ain, bool from_in, T init,
    T* __restrict__ vout, T* __restrict__ aout, bool acc) {
    const int G = 1 << gshift;
    const int sub = lane & (G - 1);
    const int step = 32 >> gshift;  // rows a warp covers at once
    for (int q0 = lane >> gshift; q0 < u; q0 += 4 * step) {
        for (int d = sub; d < units; d += G) {
            T v[4], a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int q = q0 + j * step;
                if (q < u) {
                    const i64 src = (i64)s_idx[n_t[q]] * units + d;
                    v[j] = vin[src];
                    a[j] = acc && from_in ? ain[src] : init;
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int q = q0 + j * step;
                if (q < u) {
                    const i64 dst = n_row[q] * units + d;
                    vout[dst] = v[j];
                    if (acc) aout[dst] = a[j];
                }
            }
        }
    }
}

__device__ __forceinline__ void ht_ins2_copy_new(
    int lane, int gshift, int u, const i64* n_row, const short* n_t, const int* s_idx, int dim,
    int vec4, const float* __restrict__ values, const float* __restrict__ accum_in,
    int has_accum, float accum_init, float* __restrict__ out_values,
    float* __restrict__ out_accum, int has_out_accum) {
    if (dim <= 0) return;
    const bool acc = has_out_accum != 0;
    const bool from_in = has_accum != 0;
    if (vec4) {
        ht_ins2_copy_units<float4>(
            lane, gshift, u, n_row, n_t, s_idx, dim >> 2,
            reinterpret_cast<const float4*>(values), reinterpret_cast<const float4*>(accum_in),
            from_in, make_float4(accum_init, accum_init, accum_init, accum_init),
            reinterpret_cast<float4*>(out_values), reinterpret_cast<float4*>(out_accum), acc);
    } else {
        ht_ins2_copy_units<float>(lane, gshift, u, n_row, n_t, s_idx, dim, values, accum_in,
                                  from_in, accum_init, out_values, out_accum, acc);
    }
}

// A warp per bucket b (blockDim.x = 32 * warps), `stride` bytes of dynamic shared memory per
// warp (insert.py's _place_stride: 30 * S rounded up to 16; S = 2 * bc, S <= 32767), in byte
// offsets of S:
//   [0, 8S) s_fp i64 | [8S, 16S) s_hk u32 (ranking) | [16S, 20S) free | [20S, 24S) s_idx int |
//   [24S, 26S) s_ord short | [26S, 28S) s_q short | [28S, 30S) n_t short
// s_hk[t]: the rank key of entry t; s_ord[p]: the entry at sorted position p; s_q[p]: the rank
// among the bucket's new pairs of the pair at p; n_t[q]: the entry representing new pair q.
// Once ranked, the merge reuses [8S, 16S) as e_fp [bc] + e_row [bc] (the stored slots) and
// [16S, 20S) as n_row [bc] (the rows the new pairs take: those of empty slots c, c + 1, ...).
//
// PASS 0: counts (stats NEW, MAX_FILL, N_OVER, OVER_NEW, block-aggregated) unless the call is
// aborted; finalizes when the decision is 1 (fast); clears scount[b] unless the decision is 2
// (undecided: pass 1 follows). PASS 1: only when pass 0 was undecided; finalizes when the
// exact decision is 2 (slow); clears scount[b].
// Finalize, with c stored and u new pairs: c + u <= bc: the j-th new pair (in the order above,
// TorchBackend._insert_new's) takes the row of empty slot c + j, and the c stored and u new
// entries merge by fingerprint (stored first on ties: the stable re-sort of TorchBackend._resort);
// the new rows get key, table id, score, values and accumulators of the pair's last
// occurrence; rows[i] / inserted[i] of every occurrence. c + u > bc (only at max capacity):
// over_list gets b, nnew[b] = u, stage[b * S + j] the j-th representative, and rep_of[i] every
// occurrence's representative, for ht_ins2_over (the eviction).
template <int PASS>
__device__ __forceinline__ void ht_ins2_place(
    const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 nb, i64 bc,
    i64 S, int stride, unsigned int* __restrict__ scount, int* __restrict__ stage,
    i64* __restrict__ bucket_count, i64* __restrict__ slot_fp, i64* __restrict__ slot_row,
    i64* __restrict__ rows, unsigned char* __restrict__ inserted, int* __restrict__ rep_of,
    i64* __restrict__ nnew, i64* __restrict__ over_list, u64* __restrict__ stats, int may_grow,
    i64 new_limit, const float* __restrict__ values, const i64* __restrict__ scores,
    const float* __restrict__ accum_in, int has_accum, float accum_init, int dim, int vec4,
    int gshift, i64* __restrict__ row_key, int* __restrict__ row_tid,
    i64* __restrict__ row_score, float* __restrict__ out_values, float* __restrict__ out_accum,
    int has_out_accum) {
    HT_SMEM(ht_ins2_smem);
    __shared__ unsigned long long s_stat[4];  // new pairs, max fill, buckets over, their pairs
    __shared__ int s_dec;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (threadIdx.x < 4) s_stat[threadIdx.x] = 0;
    if (threadIdx.x == 0) {
        const int d0 = ht_ins2_decide(stats, may_grow, new_limit, bc, 0);
        // pass 1: -1 when pass 0 decided (it finalized or aborted, and cleared scount)
        s_dec = PASS == 0 ? d0 : (d0 == 2 ? ht_ins2_decide(stats, may_grow, new_limit, bc, 1) : -1);
    }
    __syncthreads();
    const int dec = s_dec;
    if (PASS == 1 && dec < 0) return;  // the whole block: no barrier follows in pass 1
    const i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (b < nb) {
        const int k = (int)scount[b];  // the same for every lane: the branches below are warp-uniform
        const bool finalize = PASS == 0 ? dec == 1 : dec == 2;
        const bool plan = dec != 0 && k > 0 && (i64)k <= S;
        if (plan) {
            unsigned char* w = ht_ins2_smem + (i64)warp * stride;
            i64* s_fp = reinterpret_cast<i64*>(w);
            unsigned int* s_hk = reinterpret_cast<unsigned int*>(w + 8 * S);
            int* s_idx = reinterpret_cast<int*>(w + 20 * S);
            short* s_ord = reinterpret_cast<short*>(w + 24 * S);
            short* s_q = s_ord + S;
            short* n_t = s_q + S;
            const i64 base = b * bc;
            const i64 c = bucket_count[b];
            const int tb = 32 - __clz((int)S - 1);  // bits of a list index (S >= 2)
            for (int t = lane; t < k; t += 32) {
                const int idx = stage[b * S + t];
                const i64 fp = ht_fingerprint(keys[idx], has_tids ? tids[idx] : 0);
                // the position in the bucket's range, u * nb mod 2**64, is increasing in fp
                const unsigned int h = (unsigned int)((((u64)fp ^ HT_SIGN) * (u64)nb) >> 32);
                s_fp[t] = fp;
                s_idx[t] = idx;
                s_hk[t] = ((h >> tb) << tb) | (unsigned int)t;
            }
            __syncwarp();
            // rank by s_hk (distinct: a permutation of 0..k-1), two entries a lane per sweep
            for (int t0 = lane; t0 < k; t0 += 64) {
                const int t1 = t0 + 32;
                const unsigned int h0 = s_hk[t0];
                const unsigned int h1 = t1 < k ? s_hk[t1] : 0u;
                int r0 = 0, r1 = 0, v = 0;
#pragma unroll 2
                for (; v + 4 <= k; v += 4) {  // s_hk is 16-byte aligned: 4 keys a load
                    const uint4 h = reinterpret_cast<const uint4*>(s_hk)[v >> 2];
                    r0 += (h.x < h0) + (h.y < h0) + (h.z < h0) + (h.w < h0);
                    r1 += (h.x < h1) + (h.y < h1) + (h.z < h1) + (h.w < h1);
                }
                for (; v < k; ++v) {
                    const unsigned int h = s_hk[v];
                    r0 += h < h0 ? 1 : 0;
                    r1 += h < h1 ? 1 : 0;
                }
                s_ord[r0] = (short)t0;
                if (t1 < k) s_ord[r1] = (short)t1;
            }
            __syncwarp();
            // runs of equal high bits hold entries the key did not order (its fingerprint order
            // is right between runs): re-rank inside each run by the full order, through s_q
            bool runs = false;
            for (int p0 = 0; p0 < k; p0 += 32) {
                const int p = p0 + lane;
                const bool tie =
                    p + 1 < k && (s_hk[s_ord[p]] >> tb) == (s_hk[s_ord[p + 1]] >> tb);
                runs |= __any_sync(0xffffffffu, tie);
            }
            if (runs) {
                for (int p = lane; p < k; p += 32) {
                    const int t = s_ord[p];
                    const unsigned int hh = s_hk[t] >> tb;
                    int lo = p, hi = p + 1;
                    while (lo > 0 && (s_hk[s_ord[lo - 1]] >> tb) == hh) --lo;
                    while (hi < k && (s_hk[s_ord[hi]] >> tb) == hh) ++hi;
                    int dest = lo;
                    for (int q = lo; q < hi; ++q)
                        if (q != p && ht_ins2_less(s_fp, s_idx, keys, tids, has_tids, s_ord[q], t))
                            ++dest;
                    s_q[dest] = (short)t;
                }
                __syncwarp();
                for (int p = lane; p < k; p += 32) s_ord[p] = s_q[p];
                __syncwarp();
            }
            // the last entry of each run of one pair represents it; q: exclusive count of them
            int u = 0;
            for (int p0 = 0; p0 < k; p0 += 32) {
                const int p = p0 + lane;
                bool rep = false;
                if (p < k)
                    rep = p == k - 1 || !ht_ins2_same_pair(s_fp, s_idx, keys, tids, has_tids,
                                                           s_ord[p], s_ord[p + 1]);
                const unsigned int m = __ballot_sync(0xffffffffu, rep);
                const int q = u + __popc(m & ((1u << lane) - 1u));
                if (p < k) {
                    s_q[p] = (short)q;
                    if (rep) n_t[q] = s_ord[p];
                }
                u += __popc(m);
            }
            __syncwarp();
            if (PASS == 0 && lane == 0) {
                const u64 fill = (u64)c + (u64)u;
                atomicAdd(&s_stat[0], (unsigned long long)u);
                atomicMax(&s_stat[1], (unsigned long long)fill);
                if ((i64)fill > bc) {
                    atomicAdd(&s_stat[2], 1ULL);
                    atomicAdd(&s_stat[3], (unsigned long long)u);
                }
            }
            if (finalize && c + u <= bc) {
                i64* e_fp = reinterpret_cast<i64*>(w + 8 * S);  // s_hk is dead from here on
                i64* e_row = e_fp + bc;
                i64* n_row = reinterpret_cast<i64*>(w + 16 * S);
                for (int t = lane; t < c; t += 32) {
                    e_fp[t] = slot_fp[base + t];
                    e_row[t] = slot_row[base + t];
                }
                for (int q = lane; q < u; q += 32) n_row[q] = slot_row[base + c + q];
                __syncwarp();  // every read of the bucket's slots is done before the writes
                for (int t = lane; t < c; t += 32) {
                    const i64 f = e_fp[t];
                    int lo = 0, hi = u;  // new pairs with a smaller fingerprint
                    while (lo < hi) {
                        const int mid = (lo + hi) >> 1;
                        if (s_fp[n_t[mid]] < f) lo = mid + 1;
                        else hi = mid;
                    }
                    if (lo != 0) {
                        slot_fp[base + t + lo] = f;
                        slot_row[base + t + lo] = e_row[t];
                    }
                }
                for (int q = lane; q < u; q += 32) {
                    const int t = n_t[q];
                    const i64 f = s_fp[t];
                    int lo = 0, hi = (int)c;  // stored entries with a fingerprint <= f
                    while (lo < hi) {
                        const int mid = (lo + hi) >> 1;
                        if (e_fp[mid] <= f) lo = mid + 1;
                        else hi = mid;
                    }
                    const i64 r = n_row[q];
                    const int idx = s_idx[t];
                    slot_fp[base + q + lo] = f;
                    slot_row[base + q + lo] = r;
                    row_key[r] = keys[idx];
                    row_tid[r] = has_tids ? (int)tids[idx] : 0;
                    row_score[r] = scores[idx];
                }
                ht_ins2_copy_new(lane, gshift, u, n_row, n_t, s_idx, dim, vec4, values, accum_in,
                                 has_accum, accum_init, out_values, out_accum, has_out_accum);
                for (int p = lane; p < k; p += 32) {
                    const int i = s_idx[s_ord[p]];
                    rows[i] = n_row[s_q[p]];
                    inserted[i] = 1;
                }
                if (lane == 0) bucket_count[b] = c + u;
            } else if (finalize) {
                if (lane == 0) {
                    const u64 j = atomicAdd(stats + HT_ST_OVER_CURSOR, 1ULL);
                    over_list[j] = b;
                    nnew[b] = u;
                }
                for (int q = lane; q < u; q += 32) stage[b * S + q] = s_idx[n_t[q]];
                for (int p = lane; p < k; p += 32) rep_of[s_idx[s_ord[p]]] = s_idx[n_t[s_q[p]]];
            }
        }
        if (k != 0 && (PASS == 1 || dec != 2)) {
            __syncwarp();  // every lane has read scount[b]
            if (lane == 0) scount[b] = 0;
        }
    }
    if (PASS == 0) {
        __syncthreads();
        if (threadIdx.x == 0) {
            if (s_stat[0]) atomicAdd(stats + HT_ST_NEW, (u64)s_stat[0]);
            if (s_stat[1]) atomicMax(stats + HT_ST_MAX_FILL, (u64)s_stat[1]);
            if (s_stat[2]) atomicAdd(stats + HT_ST_N_OVER, (u64)s_stat[2]);
            if (s_stat[3]) atomicAdd(stats + HT_ST_OVER_NEW, (u64)s_stat[3]);
        }
    }
}

// Two kernels (two names in a profile): pass 0 and pass 1.
#define HT_INS2_PLACE(PASS)                                                                    \
    extern "C" __global__ void ht_ins2_place##PASS(                                            \
        const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 nb,      \
        i64 bc, i64 S, int stride, unsigned int* __restrict__ scount, int* __restrict__ stage, \
        i64* __restrict__ bucket_count, i64* __restrict__ slot_fp, i64* __restrict__ slot_row, \
        i64* __restrict__ rows, unsigned char* __restrict__ inserted,                          \
        int* __restrict__ rep_of, i64* __restrict__ nnew, i64* __restrict__ over_list,         \
        u64* __restrict__ stats, int may_grow, i64 new_limit, const float* __restrict__ values, \
        const i64* __restrict__ scores, const float* __restrict__ accum_in, int has_accum,     \
        float accum_init, int dim, int vec4, int gshift, i64* __restrict__ row_key,            \
        int* __restrict__ row_tid, i64* __restrict__ row_score,                                \
        float* __restrict__ out_values, float* __restrict__ out_accum, int has_out_accum) {    \
        ht_ins2_place<PASS>(keys, tids, has_tids, nb, bc, S, stride, scount, stage,            \
                            bucket_count, slot_fp, slot_row, rows, inserted, rep_of, nnew,     \
                            over_list, stats, may_grow, new_limit, values, scores, accum_in,   \
                            has_accum, accum_init, dim, vec4, gshift, row_key, row_tid,        \
                            row_score, out_values, out_accum, has_out_accum);                  \
    }
HT_INS2_PLACE(0)
HT_INS2_PLACE(1)

// 2^gshift threads per key (gshift <= 5: a group never straddles a warp; blockDim.x a multiple
// of 32, no thread returns before the shuffle): the group's first thread reads rows[i] and, for
// a stored key (inserted[i] == 0) whose last occurrence is i (win[row] == i), clears win[row]
// and hands the row to the group, which assigns it (score, values, accumulators when given)
// unless the call was aborted. New rows were written by place. Block 0 clears the next call's
// stats buffer. vec4: dim % 4 == 0 and the value arrays 16-byte aligned (float4 copies).
extern "C" __global__ void ht_ins2_write(
    i64 n, const float* __restrict__ values, const i64* __restrict__ scores,
    const float* __restrict__ accum_in, int has_accum, int dim, int vec4, int gshift,
    const i64* __restrict__ rows, const unsigned char* __restrict__ inserted,
    int* __restrict__ win, const u64* __restrict__ stats, u64* __restrict__ stats_next,
    int may_grow, i64 new_limit, i64 bc, float* __restrict__ out_values,
    i64* __restrict__ row_score, float* __restrict__ out_accum, int has_out_accum) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = ht_ins2_decide(stats, may_grow, new_limit, bc, 1) != 0;
    if (blockIdx.x == 0)
        for (int j = threadIdx.x; j < HT_ST_LEN; j += blockDim.x) stats_next[j] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int G = 1 << gshift;
    const int sub = lane & (G - 1);
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> gshift;
    i64 r = -1;
    if (sub == 0 && i < n) {
        const i64 found = rows[i];
        if (found >= 0 && inserted[i] == 0 && win[found] == (int)i) {
            win[found] = -1;  // only this thread reads win[found] as its own from here on
            r = found;
        }
    }
    r = __shfl_sync(0xffffffffu, r, lane & ~(G - 1));
    if (r < 0 || !s_ok) return;
    if (sub == 0) row_score[r] = scores[i];
    const bool acc = has_out_accum && has_accum;
    if (vec4) {
        const int nv = dim >> 2;
        const float4* vin = reinterpret_cast<const float4*>(values) + i * nv;
        float4* vout = reinterpret_cast<float4*>(out_values) + r * nv;
        for (int d = sub; d < nv; d += G) vout[d] = vin[d];
        if (acc) {
            const float4* ain = reinterpret_cast<const float4*>(accum_in) + i * nv;
            float4* aout = reinterpret_cast<float4*>(out_accum) + r * nv;
            for (int d = sub; d < nv; d += G) aout[d] = ain[d];
        }
    } else {
        const i64 src = i * dim, dst = r * dim;
        for (int d = sub; d < dim; d += G) out_values[dst + d] = values[src + d];
        if (acc)
            for (int d = sub; d < dim; d += G) out_accum[dst + d] = accum_in[src + d];
    }
}

// After the eviction pass (ht_ins2_over, buckets in over_list): the occurrences of their new
// pairs (rows[i] still -1) take their representative's row (-1: refused).
// mask (a static call's, else null): the selected keys; the others are left as they are.
extern "C" __global__ void ht_ins2_gather(const int* __restrict__ rep_of,
                                         const i64* __restrict__ rep_rows, i64 n,
                                         i64* __restrict__ rows, unsigned char* __restrict__ inserted,
                                         const unsigned char* __restrict__ mask) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || (mask != nullptr && !mask[i]) || rows[i] >= 0) return;
    const i64 q = rep_rows[rep_of[i]];
    rows[i] = q;
    inserted[i] = q >= 0;
}

// ---------------------------------------------------------------- insert_or_assign: full buckets
//
// At max capacity, the buckets whose new pairs do not fit (place pass 0 listed them in over_list
// with nnew[b] = u pairs, their representatives at stage[b * S + q] in (fingerprint, table id,
// key) order) keep their best bc entries: TorchBackend.insert_overflow's table and result, bit
// for bit, in three launches (insert.py's _overflow) and one host read.
//
// 1. ht_ins2_over (a block per listed bucket, the list sorted): with c stored entries (slots
//    0..c-1, sorted by fingerprint) and buckets.py's order (pinned first, higher score,
//    newcomer before a stored entry of equal score, lower fingerprint, then torch's stable
//    column order: the slot for stored entries, the pre-rank for newcomers):
//    - pre-step: newcomer q's pre-rank p = #{q': score > or (== and q' < q)}; p >= bc is
//      refused. Among newcomers the merge order is the pre-rank order (q is fingerprint order);
//    - stored among stored: (pinned, score desc, slot) (slot order is fingerprint order);
//    - stored s before newcomer n iff s is pinned (always under NO_EVICTION) or its score is
//      higher (newcomers win ties),
//    so an entry's rank R is its rank in its own group plus a count over the other; R < bc
//    stays. The freed rows (empty slots and evicted entries, in slot order) go to the kept
//    newcomers in rank order, the rest stay with the empty slots; the kept entries are written
//    sorted by (fingerprint, R) (torch's stable sort of the merge order), sentinels last. The
//    new rows get key, table id, score, values and accumulators; the evicted rows not reused
//    are freed (key -1, table id 0, score 0); rep_rows[i] of every representative i (-1:
//    refused). Each bucket's evicted keys and table ids (rank order) go to ev_key / ev_tid at a
//    base it reserves (stats[HT_ST_OV_EVICTED] is the cursor and the total); ev_meta[j] = that
//    base, ev_meta[n_over + j] = the count. The stored entries' ranks among themselves and the
//    slot order come from block sorts (bitonic, O(bc log^2 bc) a bucket: ht_block_sort); the
//    newcomers' ranks are counts (O(u^2) and O(c * u)). Counting all of it (O(bc^2) compares a
//    bucket) took ~0.43 ms a training step on the H200, most for the counter's buckets of 1024.
//    A full bucket with few newcomers (the steady state of training) takes a fast path that
//    needs neither sort (ht_over_fast_*: the same result).
// 2. ht_ins2_over_list (a warp per bucket): the evicted keys in bucket order (ends: the
//    inclusive cumsum of the counts), as the torch code returns them.
//
// blockDim.x of ht_ins2_over: a multiple of 32, at least 64 (warps 0 and 1 scan at once).
// Dynamic shared memory (insert.py's _over_smem: 69 * bc + 12 * S bytes, B = bc):
//   i64: e_fp [B] | e_row [B] | e_score [B] | k_fp [B] (first c_score) | k_row [B] | f_row [B] |
//        n_score [S];  int: n_idx [S] | by_rank [2B] | e_rank [B] | cand [B] | f_slot [B];
//   u8: e_pin [B].

// The order of ht_ins2_over's stored entries (slots a, b < c): pinned first, then higher
// score, then lower slot.
struct HtStoredOrder {
    const unsigned char* pin;
    const i64* score;
    __device__ __forceinline__ bool operator()(int a, int b) const {
        if (pin[a] != pin[b]) return pin[a] > pin[b];
        if (score[a] != score[b]) return score[a] > score[b];
        return a < b;
    }
};

// The order of ht_ins2_over's kept entries (ranks a, b < size) in the slots: fingerprint, then
// rank.
struct HtSlotOrder {
    const i64* fp;
    __device__ __forceinline__ bool operator()(int a, int b) const {
        return fp[a] != fp[b] ? fp[a] < fp[b] : a < b;
    }
};

#define HT_SORT_PAD 0x7fffffff  // a padding entry of ht_block_sort: after every real one

// buf[0 .. n) = 0 .. n - 1 sorted by the strict total order `before` (a bitonic sort over the
// next power of two p2 >= n, padded with HT_SORT_PAD; buf holds p2 ints, p2 < 2n for n >= 1).
// Every thread of the block calls it (barriers inside); it ends with a barrier.
template <typename Before>
__device__ __forceinline__ void ht_block_sort(int* buf, int n, Before before) {
    const int T = blockDim.x, tx = threadIdx.x;
    int p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (int i = tx; i < p2; i += T) buf[i] = i < n ? i : HT_SORT_PAD;
    __syncthreads();
    for (int k = 2; k <= p2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tx; i < p2; i += T) {
                const int l = i ^ j;
                if (l > i) {
                    const int a = buf[i], b = buf[l];
                    // ascending where (i & k) == 0: swap when b comes before a; else the reverse
                    const bool b_first = b != HT_SORT_PAD && (a == HT_SORT_PAD || before(b, a));
                    const bool a_first = a != HT_SORT_PAD && (b == HT_SORT_PAD || before(a, b));
                    if ((i & k) == 0 ? b_first : a_first) {
                        buf[i] = b;
                        buf[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

#define HT_ST_OV_EVICTED 11  // ht_ins2_over: stored entries evicted (the cursor of ev_key)
#define HT_ST_OV_REFUSED 12  // new pairs of the full buckets left out
#define HT_ST_OV_ADDED 13    // entries the full buckets gained
#define HT_ST_OV_FAST 14     // buckets ht_ins2_over took on its fast path (the tests look)

// ---- ht_ins2_over's fast path: a full bucket, few newcomers, distinct fingerprints
//
// A full bucket (c == B) that gets m <= HT_OVER_FAST_M newcomers past the pre-step evicts its
// nev <= m last stored entries in HtStoredOrder (an entry's merge rank grows with its stored
// rank, and only the last m stored ranks can reach B), and keeps the newcomers of pre-ranks
// 0 .. nev - 1, in the freed rows. When no two fingerprints of the merge are equal and the
// stored ones are strictly increasing in slot order (always, but for a 64-bit fingerprint
// collision), the kept entries' slots are the stored ones' order merged with the kept
// newcomers' by fingerprint: the general path's result without its two block sorts of the
// bucket (bitonic, O(B log^2 B) each: ~0.5 ms a training step on the H200 for the admission
// counter's buckets of 1024, bench_train_full_s13). Selecting the evicted entries takes at most
// m + 1 block reductions.

#define HT_OVER_FAST_M 64  // newcomers past the pre-step that the fast path takes

// Whether the fast path applies (the same answer in every thread: __syncthreads_or). On the
// way, for newcomer p < m: n_fp[p] its fingerprint, n_lb[p] the stored entries below it.
__device__ __forceinline__ bool ht_over_fast_applies(
    int B, int c, int m, const i64* __restrict__ keys, const i64* __restrict__ tids,
    int has_tids, const int* n_idx, const int* cand, const i64* e_fp, i64* n_fp, int* n_lb) {
    const int T = blockDim.x, tx = threadIdx.x;
    const bool full = c == B && m <= HT_OVER_FAST_M;
    int no = 0;
    if (full) {
        for (int t = tx + 1; t < c; t += T) no |= e_fp[t] <= e_fp[t - 1];
        for (int p = tx; p < m; p += T) {
            const int idx = n_idx[cand[p]];
            const i64 fp = ht_fingerprint(keys[idx], has_tids ? tids[idx] : 0);
            int lo = 0, hi = c;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (e_fp[mid] < fp) lo = mid + 1;
                else hi = mid;
            }
            no |= lo < c && e_fp[lo] == fp;
            n_fp[p] = fp;
            n_lb[p] = lo;
        }
    }
    __syncthreads();
    if (full)
        for (int p = tx; p < m; p += T)
            for (int v = 0; v < p; ++v) no |= n_fp[v] == n_fp[p];
    const int any = __syncthreads_or(no);
    return full && !any;
}

// The evicted entries: up to m times, the entry last in HtStoredOrder among those not taken
// (the k-th has stored rank c - 1 - k) is evicted if its merge rank reaches B, else the
// selection ends. taken[t] = 1 for an evicted slot t; picks[k] the k-th evicted slot; then
// f_slot / f_row the evicted slots in slot order and their rows (the freed rows); *s_nev =
// *s_nfree = nev. Ends with a barrier.
__device__ __forceinline__ void ht_over_fast_evict(int B, int c, int m, const unsigned char* e_pin,
                                                   const i64* e_score, const i64* c_score,
                                                   const i64* e_row, int* taken, int* picks,
                                                   i64* f_row, int* f_slot, int* s_nev,
                                                   int* s_nfree) {
    __shared__ int s_warp_pick[32];
    __shared__ int s_more;
    const int T = blockDim.x, tx = threadIdx.x;
    const int lane = tx & 31, warp = tx >> 5;
    const HtStoredOrder before{e_pin, e_score};
    for (int t = tx; t < c; t += T) taken[t] = 0;
    if (tx == 0) *s_nev = 0;
    __syncthreads();
    for (int k = 0; k < m; ++k) {
        int last = -1;  // this thread's entry last in the stored order
        for (int t = tx; t < c; t += T)
            if (!taken[t] && (last < 0 || before(last, t))) last = t;
        for (int off = 16; off > 0; off >>= 1) {
            const int o = __shfl_down_sync(0xffffffffu, last, off);
            if (o >= 0 && (last < 0 || before(last, o))) last = o;
        }
        if (lane == 0) s_warp_pick[warp] = last;
        __syncthreads();
        if (warp == 0) {
            last = lane < (T >> 5) ? s_warp_pick[lane] : -1;
            for (int off = 16; off > 0; off >>= 1) {
                const int o = __shfl_down_sync(0xffffffffu, last, off);
                if (o >= 0 && (last < 0 || before(last, o))) last = o;
            }
            if (lane == 0) {
                int r = c - 1 - k;  // its merge rank: its stored rank + the newcomers before it
                if (!e_pin[last]) {
                    const i64 s = e_score[last];
                    for (int p = 0; p < m; ++p) r += c_score[p] >= s ? 1 : 0;
                }
                s_more = r >= B;
                if (r >= B) {
                    taken[last] = 1;
                    picks[k] = last;
                    *s_nev = k + 1;
                }
            }
        }
        __syncthreads();
        if (!s_more) break;
    }
    const int nev = *s_nev;
    for (int e = tx; e < nev; e += T) {
        const int v = picks[e];
        int at = 0;
        for (int e2 = 0; e2 < nev; ++e2) at += picks[e2] < v ? 1 : 0;
        f_slot[at] = v;
        f_row[at] = e_row[v];
    }
    if (tx == 0) *s_nfree = nev;
    __syncthreads();
}

// The evicted keys and table ids in merge-rank order (picks reversed) at a base this bucket
// reserves, as the general path's warp 1 writes them (read before any row is written).
__device__ __forceinline__ void ht_over_fast_evicted(i64 j, int nev, const int* picks,
                                                     const i64* e_row,
                                                     const i64* __restrict__ row_key,
                                                     const int* __restrict__ row_tid,
                                                     i64* __restrict__ ev_key,
                                                     i64* __restrict__ ev_tid,
                                                     i64* __restrict__ ev_meta, i64 n_over,
                                                     u64* __restrict__ stats) {
    __shared__ i64 s_at;
    const int T = blockDim.x, tx = threadIdx.x;
    if (tx == 0) {
        const i64 at = nev > 0 ? (i64)atomicAdd(stats + HT_ST_OV_EVICTED, (u64)nev) : 0;
        ev_meta[j] = at;
        ev_meta[n_over + j] = nev;
        s_at = at;
    }
    __syncthreads();
    const i64 at = s_at;
    for (int e = tx; e < nev; e += T) {
        const i64 row = e_row[picks[nev - 1 - e]];
        ev_key[at + e] = row_key[row];
        ev_tid[at + e] = (i64)row_tid[row];
    }
}

// The slots of the fast path: the kept stored entries (not taken) and the kept newcomers
// (pre-ranks p < n_new, in rows f_row[p]) merged by fingerprint; the bucket stays full.
__device__ __forceinline__ void ht_over_fast_slots(int c, int n_new, i64 base, const i64* e_fp,
                                                   const i64* e_row, const int* taken,
                                                   const i64* n_fp, const int* n_lb,
                                                   const i64* f_row, const int* f_slot,
                                                   i64* __restrict__ slot_fp,
                                                   i64* __restrict__ slot_row) {
    const int T = blockDim.x, tx = threadIdx.x;
    // a full bucket: the n_new freed (evicted) slots f_slot each go to a kept newcomer
    for (int t = tx; t < c; t += T) {
        if (taken[t]) continue;
        int at = t;
        for (int i = 0; i < n_new; ++i) at -= f_slot[i] < t ? 1 : 0;
        for (int p = 0; p < n_new; ++p) at += n_fp[p] < e_fp[t] ? 1 : 0;
        slot_fp[base + at] = e_fp[t];
        slot_row[base + at] = e_row[t];
    }
    for (int p = tx; p < n_new; p += T) {
        const int lb = n_lb[p];
        int at = lb;
        for (int i = 0; i < n_new; ++i) at -= f_slot[i] < lb ? 1 : 0;
        for (int v = 0; v < n_new; ++v) at += n_fp[v] < n_fp[p] ? 1 : 0;
        slot_fp[base + at] = n_fp[p];
        slot_row[base + at] = f_row[p];
    }
}

extern "C" __global__ void ht_ins2_over(
    const i64* __restrict__ over, i64 bc, i64 S, const int* __restrict__ stage,
    const i64* __restrict__ nnew, const i64* __restrict__ keys, const i64* __restrict__ tids,
    int has_tids, const i64* __restrict__ scores, const float* __restrict__ values,
    const float* __restrict__ accum_in, int has_accum, float accum_init, int dim, int vec4,
    const unsigned char* __restrict__ pinned, int pin_mode, const i64* __restrict__ sentinel,
    i64* __restrict__ bucket_count, i64* __restrict__ slot_fp, i64* __restrict__ slot_row,
    i64* __restrict__ row_key, int* __restrict__ row_tid, i64* __restrict__ row_score,
    float* __restrict__ out_values, float* __restrict__ out_accum, int has_out_accum,
    i64* __restrict__ rep_rows, i64* __restrict__ ev_key, i64* __restrict__ ev_tid,
    i64* __restrict__ ev_meta, i64 n_over, u64* __restrict__ stats) {
    HT_SMEM(smem);
    __shared__ int s_nfree, s_nev;
    const int B = (int)bc;
    const int T = blockDim.x, tx = threadIdx.x;
    const int lane = tx & 31, warp = tx >> 5;
    const unsigned int below = (1u << lane) - 1u;
    const i64 j = blockIdx.x;
    const i64 b = over[j];
    if (b < 0) {  // past the listed buckets of a static call (its list padded with -1)
        if (tx == 0) {
            ev_meta[j] = 0;
            ev_meta[n_over + j] = 0;
        }
        return;  // the whole block, before any barrier
    }
    const i64 base = b * bc;
    const i64 c64 = bucket_count[b];
    const int c = (int)(c64 > bc ? bc : c64);
    const int u = (int)nnew[b];
    const int m = u < B ? u : B;  // newcomers past the pre-step
    i64* e_fp = reinterpret_cast<i64*>(smem);
    i64* e_row = e_fp + B;
    i64* e_score = e_row + B;
    i64* k_fp = e_score + B;
    i64* c_score = k_fp;  // until the ranks are done: the score of the newcomer of pre-rank p
    i64* k_row = k_fp + B;
    i64* f_row = k_row + B;
    i64* n_score = f_row + B;
    int* n_idx = reinterpret_cast<int*>(n_score + S);
    int* by_rank = n_idx + S;  // entry of rank R: a slot t < B, or B + p for newcomer p
    int* e_rank = by_rank + 2 * B;
    int* cand = e_rank + B;  // newcomer (q) of pre-rank p
    int* f_slot = cand + B;
    unsigned char* e_pin = reinterpret_cast<unsigned char*>(f_slot + B);
    if (tx == 0) s_nev = 0;
    for (int t = tx; t < B; t += T) {
        const i64 r = slot_row[base + t];
        e_row[t] = r;
        if (t < c) {
            e_fp[t] = slot_fp[base + t];
            e_score[t] = row_score[r];
            e_pin[t] = pin_mode == 2 ? 1 : (pin_mode == 1 && pinned[r] ? 1 : 0);
        }
    }
    for (int q = tx; q < u; q += T) {
        const int idx = stage[b * S + q];
        n_idx[q] = idx;
        n_score[q] = scores[idx];
    }
    __syncthreads();
    // pre-ranks of the newcomers, ranks of the stored entries among themselves
    for (int q = tx; q < u; q += T) {
        const i64 s = n_score[q];
        int p = 0;
        for (int v = 0; v < u; ++v) {
            const i64 w = n_score[v];
            p += (w > s || (w == s && v < q)) ? 1 : 0;
        }
        if (p < B) {
            cand[p] = q;
            c_score[p] = s;
        } else {
            rep_rows[n_idx[q]] = -1;  // refused by the pre-step
        }
    }
    __syncthreads();
    const bool fast = ht_over_fast_applies(B, c, m, keys, tids, has_tids, n_idx, cand, e_fp,
                                           k_row, by_rank);
    if (fast) {
        // by_rank: [0, m) the newcomers' n_lb, [B, B + m) the evicted slots as picked
        ht_over_fast_evict(B, c, m, e_pin, e_score, c_score, e_row, e_rank, by_rank + B, f_row,
                           f_slot, &s_nev, &s_nfree);
        ht_over_fast_evicted(j, s_nev, by_rank + B, e_row, row_key, row_tid, ev_key, ev_tid,
                             ev_meta, n_over, stats);
    } else {
        // the stored entries' ranks among themselves: a block sort in by_rank (free until the
        // merge ranks below; 2B ints, enough for c <= B padded to a power of two)
        ht_block_sort(by_rank, c, HtStoredOrder{e_pin, e_score});
        for (int p = tx; p < c; p += T) e_rank[by_rank[p]] = p;
        __syncthreads();
        // ranks in the merge
        for (int p = tx; p < m; p += T) {
            const i64 s = c_score[p];
            int r = p;
            for (int v = 0; v < c; ++v) r += (e_pin[v] || e_score[v] > s) ? 1 : 0;
            by_rank[r] = B + p;
        }
        for (int t = tx; t < c; t += T) {
            int r = e_rank[t];
            if (!e_pin[t]) {
                const i64 s = e_score[t];
                for (int p = 0; p < m; ++p) r += c_score[p] >= s ? 1 : 0;
            }
            by_rank[r] = t;
            e_rank[t] = r;
            if (r >= B) atomicAdd(&s_nev, 1);
        }
        __syncthreads();
        if (warp == 0) {
            // freed rows in slot order: empty slots and evicted entries
            int nf = 0;
            for (int t0 = 0; t0 < B; t0 += 32) {
                const int t = t0 + lane;
                const bool fr = t < B && (t >= c || e_rank[t] >= B);
                const unsigned int mk = __ballot_sync(0xffffffffu, fr);
                if (fr) {
                    const int i = nf + __popc(mk & below);
                    f_row[i] = e_row[t];
                    f_slot[i] = t;
                }
                nf += __popc(mk);
            }
            if (lane == 0) s_nfree = nf;
        } else if (warp == 1) {
            // the evicted keys and table ids in rank order, read before any row is written
            const int nev = s_nev;
            i64 at = 0;
            if (lane == 0 && nev > 0) at = (i64)atomicAdd(stats + HT_ST_OV_EVICTED, (u64)nev);
            at = __shfl_sync(0xffffffffu, at, 0);
            if (lane == 0) {
                ev_meta[j] = at;
                ev_meta[n_over + j] = nev;
            }
            const int total = c + m;
            int e = 0;
            for (int r0 = B; r0 < total; r0 += 32) {
                const int r = r0 + lane;
                const bool ev = r < total && by_rank[r] < B;
                const unsigned int mk = __ballot_sync(0xffffffffu, ev);
                if (ev) {
                    const i64 row = e_row[by_rank[r]];
                    const i64 dst = at + e + __popc(mk & below);
                    ev_key[dst] = row_key[row];
                    ev_tid[dst] = (i64)row_tid[row];
                }
                e += __popc(mk);
            }
        }
    }
    __syncthreads();
    const int nfree = s_nfree;
    const int size = c + m < B ? c + m : B;
    const int n_new = size - (B - nfree);  // kept newcomers: pre-ranks 0 .. n_new - 1
    for (int p = tx; p < m; p += T) {
        const int idx = n_idx[cand[p]];
        if (p < n_new) {
            const i64 r = f_row[p];
            row_key[r] = keys[idx];
            row_tid[r] = has_tids ? (int)tids[idx] : 0;
            row_score[r] = scores[idx];
            rep_rows[idx] = r;
        } else {
            rep_rows[idx] = -1;  // lost in the merge
        }
    }
    for (int i = n_new + tx; i < nfree; i += T) {
        const int t = f_slot[i];
        if (t < c) {  // an evicted entry whose row no newcomer takes
            const i64 r = e_row[t];
            row_key[r] = -1;
            row_tid[r] = 0;
            row_score[r] = 0;
        }
    }
    if (dim > 0 && n_new > 0) {
        const bool acc = has_out_accum != 0;
        const bool from_in = has_accum != 0;
        const int units = vec4 ? dim >> 2 : dim;
        const int total = n_new * units;
        for (int e = tx; e < total; e += T) {
            const int p = e / units;
            const int d = e - p * units;
            const i64 src = (i64)n_idx[cand[p]] * units + d;
            const i64 dst = f_row[p] * units + d;
            if (vec4) {
                reinterpret_cast<float4*>(out_values)[dst] =
                    reinterpret_cast<const float4*>(values)[src];
                if (acc)
                    reinterpret_cast<float4*>(out_accum)[dst] =
                        from_in ? reinterpret_cast<const float4*>(accum_in)[src]
                                : make_float4(accum_init, accum_init, accum_init, accum_init);
            } else {
                out_values[dst] = values[src];
                if (acc) out_accum[dst] = from_in ? accum_in[src] : accum_init;
            }
        }
    }
    __syncthreads();
    if (fast) {
        ht_over_fast_slots(c, n_new, base, e_fp, e_row, e_rank, k_row, by_rank, f_row, f_slot,
                           slot_fp, slot_row);
    } else {
        // the kept entries by rank: fingerprints and rows
        for (int r = tx; r < size; r += T) {
            const int id = by_rank[r];
            if (id < B) {
                k_fp[r] = e_fp[id];
                k_row[r] = e_row[id];
            } else {
                const int p = id - B;
                const int idx = n_idx[cand[p]];
                k_fp[r] = ht_fingerprint(keys[idx], has_tids ? tids[idx] : 0);
                k_row[r] = f_row[p];
            }
        }
        __syncthreads();
        // the slots: kept entries by (fingerprint, rank), a block sort in by_rank (read no more),
        // then the sentinels with the unused rows
        ht_block_sort(by_rank, size, HtSlotOrder{k_fp});
        for (int p = tx; p < size; p += T) {
            const int r = by_rank[p];
            slot_fp[base + p] = k_fp[r];
            slot_row[base + p] = k_row[r];
        }
        const i64 sent = sentinel[b];
        for (int i = size + tx; i < B; i += T) {
            slot_fp[base + i] = sent;
            slot_row[base + i] = f_row[n_new + i - size];
        }
    }
    if (tx == 0) {
        if (fast) atomicAdd(stats + HT_ST_OV_FAST, 1ULL);
        bucket_count[b] = size;
        if (u > n_new) atomicAdd(stats + HT_ST_OV_REFUSED, (u64)(u - n_new));
        if (size > c) atomicAdd(stats + HT_ST_OV_ADDED, (u64)(size - c));
    }
}

// A warp per bucket j of the sorted over list: its ev_meta[n_over + j] evicted keys and table
// ids, at ev_meta[j] in ev_key / ev_tid, go to out_key / out_tid from ends[j] - count.
extern "C" __global__ void ht_ins2_over_list(i64 n_over, const i64* __restrict__ ev_meta,
                                             const i64* __restrict__ ends,
                                             const i64* __restrict__ ev_key,
                                             const i64* __restrict__ ev_tid,
                                             i64* __restrict__ out_key, i64* __restrict__ out_tid) {
    const i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (j >= n_over) return;
    const int lane = threadIdx.x & 31;
    const i64 at = ev_meta[j], cnt = ev_meta[n_over + j];
    const i64 dst = ends[j] - cnt;
    for (i64 e = lane; e < cnt; e += 32) {
        out_key[dst + e] = ev_key[at + e];
        out_tid[dst + e] = ev_tid[at + e];
    }
}

// ---------------------------------------------------------------- erase
//
// HashTable.erase on CUDA (insert.py's erase): two launches on torch's stream and one host read
// (the stats, copied after the mark kernel). The scratch is the insert's (win, scount, over_list,
// the stats buffers), left as found.
//
// 1. ht_erase_mark_w<W> (a thread per key): validate and locate; a found row is marked in win
//    (atomicCAS -1 -> input index: duplicates of a pair mark and count it once) and its bucket
//    is listed once (scount[b] as the flag, over_list the list).
// 2. ht_erase_apply (a warp per listed bucket): unless a key was invalid (the host then raises
//    the torch core's error, the table untouched), the bucket's occupied slots are partitioned
//    stably: kept entries first (still sorted), then the erased ones in slot order (fingerprint
//    = the bucket's sentinel, rows freed: key -1, table id 0, score 0), then the empty slots as
//    they were: what HashTable.erase's stable re-sort of the bucket gives (the sentinel is odd,
//    above every fingerprint of the bucket). Clears the marks either way.
// For n keys over a table of nb buckets: mark ~ a find (~50 us for 1M keys on an H200), apply
// ~ 2 KB read and written a listed bucket of 128 slots.

#define HT_ER_NEG_KEY 0  // a key is negative
#define HT_ER_BAD_TID 1  // a table id is outside [0, 2**31)
#define HT_ER_ERASED 2   // distinct stored pairs found (erased unless a key is invalid)
#define HT_ER_LISTED 3   // buckets listed in over_list

// blockDim.x: a multiple of 32 (the ballots); no thread returns before the last barrier.
template <int W>
__device__ __forceinline__ void ht_erase_mark(
    const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 n,
    const i64* __restrict__ slot_fp, const i64* __restrict__ slot_row,
    const i64* __restrict__ row_key, const int* __restrict__ row_tid,
    const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap, int check_tid,
    int* __restrict__ win, unsigned int* __restrict__ scount, i64* __restrict__ list,
    u64* __restrict__ stats) {
    __shared__ unsigned int s_cnt[3];  // negative keys, bad table ids, erased pairs
    if (threadIdx.x < 3) s_cnt[threadIdx.x] = 0;
    __syncthreads();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool neg = false, bad = false, erased = false;
    if (i < n) {
        const i64 key = keys[i];
        const i64 tid = has_tids ? tids[i] : 0;
        neg = key < 0;
        bad = tid < 0 || tid >= (1LL << 31);
        const i64 fp = ht_fingerprint(key, tid);
        const i64 b = ht_bucket(fp, nb);
        const i64 r = bucket_count[b] > 0
                          ? ht_locate<W>(slot_fp, slot_row, row_key, row_tid, bucket_count, nb,
                                         bc, cap, check_tid, key, tid, fp)
                          : -1;
        if (r >= 0 && atomicCAS(win + r, -1, (int)i) == -1) {
            erased = true;
            if (atomicCAS(scount + b, 0u, 1u) == 0u)
                list[atomicAdd(stats + HT_ER_LISTED, 1ULL)] = b;
        }
    }
    ht_ins2_count(s_cnt + 0, neg);
    ht_ins2_count(s_cnt + 1, bad);
    ht_ins2_count(s_cnt + 2, erased);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_cnt[0]) atomicOr(stats + HT_ER_NEG_KEY, 1ULL);
        if (s_cnt[1]) atomicOr(stats + HT_ER_BAD_TID, 1ULL);
        if (s_cnt[2]) atomicAdd(stats + HT_ER_ERASED, (u64)s_cnt[2]);
    }
}

#define HT_ERASE_MARK(W)                                                                       \
    extern "C" __global__ void ht_erase_mark_w##W(                                             \
        const i64* __restrict__ keys, const i64* __restrict__ tids, int has_tids, i64 n,       \
        const i64* __restrict__ slot_fp, const i64* __restrict__ slot_row,                     \
        const i64* __restrict__ row_key, const int* __restrict__ row_tid,                      \
        const i64* __restrict__ bucket_count, i64 nb, i64 bc, i64 cap, int check_tid,         \
        int* __restrict__ win, unsigned int* __restrict__ scount, i64* __restrict__ list,      \
        u64* __restrict__ stats) {                                                             \
        ht_erase_mark<W>(keys, tids, has_tids, n, slot_fp, slot_row, row_key, row_tid,         \
                         bucket_count, nb, bc, cap, check_tid, win, scount, list, stats);      \
    }
HT_ERASE_MARK(0)
HT_ERASE_MARK(4)
HT_ERASE_MARK(8)
HT_ERASE_MARK(16)

// A warp per listed bucket (grid-stride over the list; blockDim.x = 32 * warps), `stride` bytes
// of dynamic shared memory a warp (16 * bc: the bucket's fingerprints and rows). Block 0 clears
// the next call's stats buffer.
extern "C" __global__ void ht_erase_apply(
    i64 bc, int stride, unsigned int* __restrict__ scount, int* __restrict__ win,
    const i64* __restrict__ list, const u64* __restrict__ stats, u64* __restrict__ stats_next,
    const i64* __restrict__ sentinel, i64* __restrict__ bucket_count, i64* __restrict__ slot_fp,
    i64* __restrict__ slot_row, i64* __restrict__ row_key, int* __restrict__ row_tid,
    i64* __restrict__ row_score) {
    HT_SMEM(smem);
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = (stats[HT_ER_NEG_KEY] | stats[HT_ER_BAD_TID]) == 0;
    if (blockIdx.x == 0)
        for (int j = threadIdx.x; j < HT_ST_LEN; j += blockDim.x) stats_next[j] = 0;
    __syncthreads();
    const bool ok = s_ok != 0;
    const i64 listed = (i64)stats[HT_ER_LISTED];
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const unsigned int below = (1u << lane) - 1u;
    i64* s_fp = reinterpret_cast<i64*>(smem + (i64)(threadIdx.x >> 5) * stride);
    i64* s_row = s_fp + bc;  // a row, or ~row (negative) when it is erased
    for (i64 j = (i64)blockIdx.x * warps + (threadIdx.x >> 5); j < listed;
         j += (i64)gridDim.x * warps) {
        const i64 b = list[j];
        const i64 base = b * bc;
        i64 c64 = bucket_count[b];
        const int c = (int)(c64 > bc ? bc : c64);
        int e = 0;  // erased entries of the bucket
        for (int p0 = 0; p0 < c; p0 += 32) {
            const int p = p0 + lane;
            bool er = false;
            if (p < c) {
                const i64 r = slot_row[base + p];
                er = win[r] != -1;
                s_fp[p] = slot_fp[base + p];
                s_row[p] = er ? ~r : r;
            }
            e += __popc(__ballot_sync(0xffffffffu, er));
        }
        __syncwarp();  // every slot is read before any is written
        const int kept = c - e;
        const i64 sent = sentinel[b];
        int nk = 0, ne = 0;  // kept / erased entries placed so far
        for (int p0 = 0; p0 < c; p0 += 32) {
            const int p = p0 + lane;
            const bool has = p < c;
            const i64 sr = has ? s_row[p] : 0;
            const bool er = has && sr < 0;
            const unsigned int me = __ballot_sync(0xffffffffu, er);
            const unsigned int mk = __ballot_sync(0xffffffffu, has && !er);
            if (er) {
                const i64 r = ~sr;
                win[r] = -1;
                if (ok) {
                    const i64 dst = base + kept + ne + __popc(me & below);
                    slot_fp[dst] = sent;
                    slot_row[dst] = r;
                    row_key[r] = -1;
                    row_tid[r] = 0;
                    row_score[r] = 0;
                }
            } else if (has && ok) {
                const i64 dst = base + nk + __popc(mk & below);
                if (dst != base + p) {
                    slot_fp[dst] = s_fp[p];
                    slot_row[dst] = sr;
                }
            }
            ne += __popc(me);
            nk += __popc(mk);
        }
        if (lane == 0) {
            scount[b] = 0;
            if (ok) bucket_count[b] = kept;
        }
        __syncwarp();  // the shared arrays are reused by the warp's next bucket
    }
}
