"""The CUDA backend of :class:`~shared.hashtable.table.HashTable`: CuPy kernels (``kernels.cu``,
``keyed.cu``) on the table's own arrays.

:class:`~shared.hashtable.cuda.backend.CudaBackend` (``backend.py``) is what a CUDA table gets
when CuPy is installed (``shared.hashtable.backend.backend_for``); it derives from the torch
backend and gives the same rows, key sets and results (the GPU tests compare them on the
device). The kernels read the layout's own arrays (``slot_fp``, ``slot_row``, ``row_key``, ...)
by data pointer: no copies, no second layout. Nothing here imports the table module.

- find (``find.py``): one thread per key. The bucket is the high word of ``u * num_buckets``;
  fingerprints are uniform inside a bucket's range and its occupied slots are sorted, so the
  key's fraction of that range times the bucket's count guesses its slot; a window of 4 slots
  (two 16-byte loads) around the guess usually holds it, else the window moves. Then the
  slot's row and the row's key (and table id) confirm the match: four dependent loads a key
  (bucket count, window, slot row, row key). On the H200 the kernel finds 1M keys in ~48 us
  (~20 G keys/s); a Python call adds ~100-150 us of host work (see bench_gpu_hashtable).
- insert_or_assign and erase (``insert.py``): stage, deduplicate and merge per bucket in
  kernels; growth and skewed batches go to the torch algorithms, full buckets through their
  eviction code.
- bulk build (``build.py``): count + stage per bucket, then a block per bucket ranks its keys
  by (fingerprint, input index): the slots the torch backend's stable sort gives, without a
  sort.
- keyed initial rows and fingerprints (``keyed.py``, ``keyed.cu``): the backend's
  ``keyed_rows`` (all member tables of a fused storage in one launch) and ``fingerprint``, bit
  for bit the torch code's float64 and splitmix64 arithmetic.
- unique of (table id, key) pairs (``unique.py``, ``unique.cu``): the backend's
  ``unique_pairs``, torch's stable sorts and three kernels, one host read.
- launches (``runtime.py``): compiled once per device, launched through the driver from
  parameter buffers.
"""

from shared.hashtable.cuda.runtime import unavailable_reason

__all__ = ["unavailable_reason"]
