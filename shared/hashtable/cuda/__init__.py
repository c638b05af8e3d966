"""CuPy kernels for :class:`~shared.hashtable.table.HashTable` on CUDA (``kernels.cu``).

The torch core stays the reference and the CPU path; on a CUDA table ``find``,
``insert_or_assign`` and ``from_keys_values`` dispatch here when CuPy is installed, and give the
same rows, key sets and results (the GPU tests compare them on the device). The kernels read
the core's own arrays (``slot_fp``, ``slot_row``, ``row_key``, ...) through DLPack: no copies,
no second layout.

- find (``find.py``): one thread per key. The bucket is the high word of ``u * num_buckets``;
  fingerprints are uniform inside a bucket's range and its occupied slots are sorted, so the
  key's fraction of that range times the bucket's count guesses its slot; a window of 4 slots
  (two 16-byte loads) around the guess usually holds it, else the window moves. Then the
  slot's row and the row's key (and table id) confirm the match: four dependent loads a key
  (bucket count, window, slot row, row key). On the H200 the kernel finds 1M keys in ~48 us
  (~20 G keys/s); a Python call adds ~100-150 us of host work (see bench_gpu_hashtable).
- insert_or_assign (``insert.py``): stage, deduplicate and merge per bucket in kernels; growth
  and skewed batches go back to the torch core, full buckets through its eviction code.
- from_keys_values (``build.py``): count + stage per bucket, then a block per bucket ranks its
  keys by (fingerprint, input index): the slots the core's stable sort gives, without a sort.
- keyed initial rows and fingerprints (``keyed.py``, ``keyed.cu``): ``KeyedInitializer``,
  ``FusedStorage._fill`` (all member tables in one launch) and ``hashing.fingerprint`` on CUDA,
  bit for bit the torch code's float64 and splitmix64 arithmetic.

``runtime.disabled()`` forces the torch core on CUDA (the baseline in tests and benchmarks).
"""

from shared.hashtable.cuda.runtime import available, disabled, unavailable_reason

__all__ = ["available", "disabled", "unavailable_reason"]
