// Rows of a page-locked host matrix mapped into the device's address space (UVA), read and
// written by the device directly (see cuda/host_rows.py): the host tier of a CACHING training
// storage. No copy is launched and nothing waits on the host: the kernels run on torch's
// current stream like any other.
//
// One thread per 16 bytes of a row (VEC floats): VEC 4 when the row width is a multiple of 4
// (rows 16-byte aligned, read and written with float4 accesses), else 1. Consecutive threads
// cover one row, so a row moves over PCIe in full 16-byte (and, 8 threads together, 128-byte)
// requests, not element-wise ones. Values are copied, never computed: bit-equal to
// index_select / index_copy_ on the host.

typedef long long i64;

// f(t, i, j) for every 16 bytes (VEC floats) of n rows of width floats: piece t is piece j of
// row i. A grid-stride loop: consecutive threads cover one row.
template <int VEC, typename F>
__device__ void each_piece(i64 n, int width, F f) {
  const int per_row = width / VEC;
  const i64 total = n * per_row;
  for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < total;
       t += (i64)gridDim.x * blockDim.x) {
    const i64 i = t / per_row;
    f(t, i, (i64)(t - i * per_row), (i64)per_row);
  }
}

// out[i] = host[rows[i]], a zero row where rows[i] < 0.
template <typename V, int VEC>
__device__ void host_gather(const V* __restrict__ host, const i64* __restrict__ rows,
                            V* __restrict__ out, i64 n, int width) {
  each_piece<VEC>(n, width, [&](i64 t, i64 i, i64 j, i64 per_row) {
    const i64 r = rows[i];
    out[t] = r < 0 ? V{} : host[r * per_row + j];
  });
}

// host[rows[i]] = payload[i] where rows[i] >= 0 and (no mask, or mask[i]); rows distinct.
template <typename V, int VEC>
__device__ void host_scatter(V* __restrict__ host, const i64* __restrict__ rows,
                             const V* __restrict__ payload, const bool* __restrict__ mask, i64 n,
                             int width) {
  each_piece<VEC>(n, width, [&](i64 t, i64 i, i64 j, i64 per_row) {
    const i64 r = rows[i];
    if (r >= 0 && (mask == nullptr || mask[i])) host[r * per_row + j] = payload[t];
  });
}

// host[write_rows[i]] = out[i] where write_rows[i] >= 0, then in[i] = host[read_rows[i]] (a zero
// row where read_rows[i] < 0): a cache's write-back of evicted lines and the read of the rows
// that take them, in one pass. A store is posted (the thread does not wait for it), so the
// writes to the host and the reads from it cross PCIe at the same time, one each way. The rows
// read must not be among the rows written (the cache's are not: evicted rows had lines,
// missed rows had none).
template <typename V, int VEC>
__device__ void host_swap(V* host, const i64* __restrict__ write_rows, const V* __restrict__ out,
                          const i64* __restrict__ read_rows, V* __restrict__ in, i64 n,
                          int width) {
  each_piece<VEC>(n, width, [&](i64 t, i64 i, i64 j, i64 per_row) {
    const i64 w = write_rows[i];
    if (w >= 0) host[w * per_row + j] = out[t];
    const i64 r = read_rows[i];
    in[t] = r < 0 ? V{} : host[r * per_row + j];
  });
}

template <typename V>
__device__ V splat(float x);
template <>
__device__ float splat<float>(float x) {
  return x;
}
template <>
__device__ float4 splat<float4>(float x) {
  return make_float4(x, x, x, x);
}

// A cache's device slots take their payload in place (the static resolve's line fill): slot
// slots[i] (< 0: nothing) of the lines values and accum ([*, dim] each: a host row's two halves,
// dim / VEC pieces each) first writes the payload it holds back to host row back[i] (if >= 0),
// then takes init[i] and the initial accumulator (fresh[i]: a new key's row) or host row
// read[i] (if >= 0). fresh (with init) and read may be null: the slots only written back.
// Positions without a slot cost one load and return: no staging tensor of every position's
// payload, no scatter of the unused ones to a sink. The slots are distinct and the rows read
// are not among the rows written (as in host_swap). The piece a thread writes back is the
// piece it then overwrites: the write-back reads the old payload. back may be null too (nothing
// written back). order (may be null: 0..n-1) is the positions in the order the threads take
// them: the i-th row of threads works on position order[i], so that, with order sorting the host
// rows a launch touches, neighbouring threads touch neighbouring host pages (random rows of a
// large host tier cost the device about the same each, likely its address translation: 5.7x
// slower at 128-B rows on the H100, bench_host_pages).
template <typename V, int VEC>
__device__ void fill_slots(V* host, const i64* __restrict__ order, const i64* __restrict__ back,
                           const i64* __restrict__ read, const i64* __restrict__ slots,
                           const bool* __restrict__ fresh, const V* __restrict__ init,
                           float initial, V* __restrict__ values, V* __restrict__ accum, i64 n,
                           int dim) {
  const i64 half = dim / VEC;
  each_piece<VEC>(n, 2 * dim, [&](i64 t, i64 at, i64 j, i64 per_row) {
    const i64 i = order == nullptr ? at : order[at];
    const i64 s = slots[i];
    if (s < 0) return;
    const bool first = j < half;
    const i64 k = first ? j : j - half;
    V* line = (first ? values : accum) + s * half + k;
    const i64 w = back == nullptr ? -1 : back[i];
    if (w >= 0) host[w * per_row + j] = *line;
    if (fresh != nullptr && fresh[i]) {
      *line = first ? init[i * half + k] : splat<V>(initial);
    } else if (read != nullptr) {
      const i64 r = read[i];
      if (r >= 0) *line = host[r * per_row + j];
    }
  });
}

extern "C" __global__ void hr_gather4(const float4* host, const i64* rows, float4* out, i64 n,
                                      int width) {
  host_gather<float4, 4>(host, rows, out, n, width);
}

extern "C" __global__ void hr_gather1(const float* host, const i64* rows, float* out, i64 n,
                                      int width) {
  host_gather<float, 1>(host, rows, out, n, width);
}

extern "C" __global__ void hr_scatter4(float4* host, const i64* rows, const float4* payload,
                                       const bool* mask, i64 n, int width) {
  host_scatter<float4, 4>(host, rows, payload, mask, n, width);
}

extern "C" __global__ void hr_scatter1(float* host, const i64* rows, const float* payload,
                                       const bool* mask, i64 n, int width) {
  host_scatter<float, 1>(host, rows, payload, mask, n, width);
}

extern "C" __global__ void hr_swap4(float4* host, const i64* write_rows, const float4* out,
                                    const i64* read_rows, float4* in, i64 n, int width) {
  host_swap<float4, 4>(host, write_rows, out, read_rows, in, n, width);
}

extern "C" __global__ void hr_swap1(float* host, const i64* write_rows, const float* out,
                                    const i64* read_rows, float* in, i64 n, int width) {
  host_swap<float, 1>(host, write_rows, out, read_rows, in, n, width);
}

extern "C" __global__ void hr_fill4(float4* host, const i64* order, const i64* back,
                                    const i64* read, const i64* slots, const bool* fresh,
                                    const float4* init, float initial, float4* values,
                                    float4* accum, i64 n, int dim) {
  fill_slots<float4, 4>(host, order, back, read, slots, fresh, init, initial, values, accum, n,
                        dim);
}

extern "C" __global__ void hr_fill1(float* host, const i64* order, const i64* back,
                                    const i64* read, const i64* slots, const bool* fresh,
                                    const float* init, float initial, float* values, float* accum,
                                    i64 n, int dim) {
  fill_slots<float, 1>(host, order, back, read, slots, fresh, init, initial, values, accum, n,
                       dim);
}
