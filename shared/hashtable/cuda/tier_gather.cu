// Rows of a two-tier table, gathered in one launch (see cuda/tier_gather.py): position i of
// the lookup has row rows[i] (-1: no key, a zero row); a row with an HBM line
// (line_of_row[row] >= 0) is read from the HBM matrix hot, any other from the host tier, every
// row's values in page-locked host memory mapped into the device's address space (UVA), read
// straight by the kernel: no copy launched, no host round trip, capturable in a CUDA graph.
// The host rows' address is read from a device cell (host_at[0]), not passed as a value: a
// graph captures the cell, so the rows can be swapped for others (serve.tiers' copy-on-write)
// by writing the cell, with no new capture.
//
// One thread per 16 bytes of a row (VEC floats): a row is read with vectorized loads, VEC 4
// when the dim is a multiple of 4 (rows 16-byte aligned), else 1. The values are copied, never
// computed: the output is bit-equal to a gather from one all-in-HBM matrix.

typedef long long i64;

template <typename V, int VEC>
__device__ void tier_gather(const V* __restrict__ hot, const i64* __restrict__ host_at,
                            const i64* __restrict__ rows, const int* __restrict__ line_of_row,
                            V* __restrict__ out, i64 n, int dim) {
  const V* __restrict__ host = reinterpret_cast<const V*>(host_at[0]);
  const int per_row = dim / VEC;
  const i64 total = n * per_row;
  for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < total;
       t += (i64)gridDim.x * blockDim.x) {
    const i64 i = t / per_row;
    const int j = (int)(t - i * per_row);
    const i64 r = rows[i];
    V v;
    if (r < 0) {
      v = V{};  // zero-initialized (float or float4)
    } else {
      const int line = line_of_row[r];
      v = line >= 0 ? hot[(i64)line * per_row + j] : host[r * per_row + j];
    }
    out[t] = v;
  }
}

extern "C" __global__ void tg_gather4(const float4* hot, const i64* host_at, const i64* rows,
                                      const int* line_of_row, float4* out, i64 n, int dim) {
  tier_gather<float4, 4>(hot, host_at, rows, line_of_row, out, n, dim);
}

extern "C" __global__ void tg_gather1(const float* hot, const i64* host_at, const i64* rows,
                                      const int* line_of_row, float* out, i64 n, int dim) {
  tier_gather<float, 1>(hot, host_at, rows, line_of_row, out, n, dim);
}
