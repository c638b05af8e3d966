"""Training data: the Taobao raw files (:mod:`.taobao`), a synthetic generator with a known oracle
(:mod:`.synthetic`), and the Parquet batch loader (:mod:`.loader`). CLI: ``python -m train.data``."""
