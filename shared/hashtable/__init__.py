"""Dynamic hash-table embeddings (dynamicemb semantics): vectorized torch, CuPy kernels on CUDA.

- :class:`HashTable` (``table.py``): int64 keys → rows; find / insert_or_assign / erase /
  export, growth, eviction by score, NO_EVICTION refusals, bulk ``from_keys_values``. Its
  arrays are a ``TableLayout`` (``layout.py``); its operations are those of the backend it
  gets once, when made (``backend.py``): ``TorchBackend`` (``torch_backend.py``, any device,
  the reference) or ``CudaBackend`` (``cuda/``, CuPy kernels, the default on CUDA).
- :class:`StaticLookupTable` (``lookup.py``): the read-only table serving builds at startup.
- :class:`KeyedInitializer` (``initializers.py``): new rows as a function of (seed, table, key).
- :class:`FrequencyCounter` (``admission.py``): bounded counters for frequency admission.
- :class:`DynamicEmbeddingCollection` (``embedding.py``): the training module (table fusion,
  admission, scores, sparse Adagrad in backward, stats).
- ``checkpoint.py``: :func:`save` / :func:`load` in dynamicemb's file layout (TorchEasyRec's
  directories); :func:`~shared.hashtable.checkpoint.open_checkpoint` picks the reader of a
  checkpoint's layout (``checkpoint_dynamicemb.py``, ``checkpoint_v1.py``: our first one).
"""

from shared.hashtable.admission import FrequencyCounter
from shared.hashtable.checkpoint import load, save
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.initializers import KeyedInitializer
from shared.hashtable.lookup import StaticLookupTable
from shared.hashtable.table import ExportedRows, HashTable, InsertResult

__all__ = [
    "DynamicEmbeddingCollection",
    "ExportedRows",
    "FrequencyCounter",
    "HashTable",
    "InsertResult",
    "KeyedInitializer",
    "StaticLookupTable",
    "load",
    "save",
]
