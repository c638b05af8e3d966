"""Migration and operations tools (``python -m train.tools <cmd>``; issue 12).

- ``init-ckpt``: an ``init_table`` (Parquet/CSV) → a dynamicemb-layout initial checkpoint
  (:mod:`train.tools.init_table`), which ``python -m train train --fine_tune_checkpoint`` loads.
- ``convert``: a num_buckets checkpoint → a dynamic one, eval AUC of both (:mod:`.convert`).
- ``inspect``: table statistics of a checkpoint or a running server (:mod:`.inspection`).
- ``delta-export`` / ``delta-apply``: rows changed since a bundle, applied to a running server
  without a restart (:mod:`.delta`, :mod:`shared.delta`, :mod:`serve.admin`).
"""
