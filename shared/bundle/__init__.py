"""The export bundle (train/ → serve/): RTP-style safetensors with ``is_hashmap`` tables.

Layout of a bundle directory (``N`` shards, ``N`` = 1 unless the tensors exceed the shard limit),
in the default naming, TorchEasyRec's (``C`` = the collection path, :data:`TZREC_COLLECTION`)::

    model-000000-of-00000N.safetensors  dense tables "C.embedding_bags.<table>.weight" float32
                                        [rows, dim]; dynamic tables, one pair per rank part R of
                                        W: "C.<table>.keys/part_R_W" int64 [n],
                                        "C.<table>.values/part_R_W" float32 [n, dim]
    model-000000-of-00000N.json         one entry per tensor group of that shard, keyed by the
                                        values (or weight) tensor name, as tzrec's RTP exporter
                                        writes it: name, dense, dimension, dtype, memory, shape,
                                        is_hashmap (+ hashmap_key, hashmap_value,
                                        hashmap_key_dtype)
    fg.json                             the FeatureSet (:mod:`shared.fg_spec`)
    dense.pt2                           torch.export program of the dense part (copied in as is)
    manifest.json                       format, format_version + naming, version, creation time,
                                        config digest, table summary, size + sha256 of every
                                        other file; written last

The naming (file and tensor names) is chosen once, by the writer's ``naming``
(:data:`TZREC_NAMING`, or :data:`DYNREC_NAMING`: format 1's ``model-00000-of-00001``,
``<table>.values/part_R_W``, ``<table>.weight``), recorded in the manifest, and detected once by
the reader, which reads both (:mod:`shared.bundle.naming`). ``"dense"`` follows RTP's meaning
(a parameter of the dense network), so it is ``false`` for every embedding table;
``is_hashmap`` tells dense tables from dynamic ones. Writing is atomic: everything goes to a
temporary directory beside the destination, the manifest last, then one rename (an exchange
when replacing, so readers never see a half state). Example::

    write_bundle(out, dense_tables={"pid_emb": w}, hash_tables={"user_id_emb": [(keys, values)]},
                 feature_set=fs, dense_program_path=tmp / "dense.pt2", config_digest=digest)
    b = read_bundle(out)            # validated; BundleError names the file, table and the fix
    b.hash_tables["user_id_emb"]    # (keys int64 [N], values float32 [N, dim]), parts concatenated
    b.naming                        # TZREC_NAMING (DYNREC_NAMING for a format 1 bundle)
"""

from shared.bundle.layout import BUNDLE_FORMAT, DEFAULT_MAX_SHARD_BYTES, BundleError
from shared.bundle.naming import (
    DYNREC_NAMING,
    TZREC_COLLECTION,
    TZREC_NAMING,
    BundleNaming,
    DynrecNaming,
    TzrecNaming,
)
from shared.bundle.reader import Bundle, load_dense_program, read_bundle, read_manifest
from shared.bundle.writer import write_bundle

__all__ = [
    "BUNDLE_FORMAT",
    "DEFAULT_MAX_SHARD_BYTES",
    "DYNREC_NAMING",
    "TZREC_NAMING",
    "TZREC_COLLECTION",
    "Bundle",
    "BundleError",
    "BundleNaming",
    "DynrecNaming",
    "TzrecNaming",
    "load_dense_program",
    "read_bundle",
    "read_manifest",
    "write_bundle",
]
