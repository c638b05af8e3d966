"""Regenerate the Python modules of the .proto files in this folder.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed, so a checkout works without a
build step (and on the GPU machine, which has no grpcio-tools). ``tests/protos/test_generated.py``
fails when they are stale; run ``python -m protos.build`` after editing a ``.proto``.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
# Protos whose package other installed libraries also register in protobuf's default descriptor
# pool: the Open Inference Protocol's `inference` package is Triton's (tritonclient.grpc) and
# KServe's too, under other file names, so both in one pool is "duplicate symbol" at import.
# Their modules build their messages in a pool of their own (``POOL``); the wire is the same.
PRIVATE_POOL = ("grpc_predict_v2_pb2.py",)
_DEFAULT_POOL_LINE = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto in ``protos/`` into ``out_dir``; return the written files."""
    import grpc_tools
    from grpc_tools import protoc  # only needed when regenerating

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    sources = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_DIR.parent}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR.parent)) for p in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in sources]}")
    written = sorted((out_dir / "protos").glob("*_pb2*.py*"))
    for path in written:
        # Drop the empty service stubs grpc_tools writes for messages-only protos.
        text = path.read_text()
        if path.name.endswith("_pb2_grpc.py") and not re.search(r"class \w+Stub", text):
            path.unlink()
        elif path.name in PRIVATE_POOL:
            if _DEFAULT_POOL_LINE not in text:
                raise RuntimeError(f"{path.name}: no '{_DEFAULT_POOL_LINE}' line to move")
            private = (
                "POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile("
            )
            path.write_text(text.replace(_DEFAULT_POOL_LINE, private, 1))
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = PROTO_DIR / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
