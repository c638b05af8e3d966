"""Training data: the Taobao raw files (:mod:`.taobao`), a synthetic generator with a known oracle
(:mod:`.synthetic`), and the Parquet batch loader (:mod:`.loader`; its parts: :mod:`.plan`,
:mod:`.streams`, :mod:`.in_order`, :mod:`.messages`, :mod:`.workers`). CLI:
``python -m train.data``."""
