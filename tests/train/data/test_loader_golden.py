"""Golden batches: the loader's output on the tiny synthetic samples, tensor for tensor.

The digests were taken before the loader's and feature generation's speed-ups (issue #18):
any change to how a batch is built must leave every tensor, key and count as it was (training
order, resume and the train/serve contract depend on it). A digest covers, per batch in order,
each KeyedJaggedTensor's keys, stride, per-key lengths, values and lengths (dtype and bytes),
``user_index``, ``labels``, ``oracle`` and ``rows_are_users``, then the epoch's FgStats.
If a change is meant to alter batches, say so in its description and update the digests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch
from shared.features import FeatureSet, feature_set_from_text
from train.data import synthetic, taobao
from train.data.loader import Loader

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"
SEED_TEXT = (CONFIGS / "multi_tower_din_taobao_dynamicemb.config").read_text()
TZREC_TEXT = SEED_TEXT.replace("data_config {\n", "data_config {\ndynrec_id_mode: TZREC\n", 1)

GOLDEN = {
    "shuffled": "ec1c6bcbe62269dbf7072d228b2cdcb82ab239b8a2e3640f4d6ec213a5e350d7",
    "workers": "5d360772d9a61234e6191103ef5c424becba6c5ebef833228911ed5bf5232b8c",
    "rank": "bb4ebfc540ef9a60decd6ad8da66ddfe5041564937b30c7ef58c1a234166a8e8",
    "eval": "ad99258bc091070b45097842d09d5bda4c514a9f6c66d975a40a1d55cc358fff",
    # shuffle off, 2 workers: the digest of one worker's batches before issue #55 (file order)
    "in_order": "279137ecb12c0c8283e80c90ffdf44a9c789006a61be0a9a748f0c98f11160b7",
    "tzrec": "ff01d398072349ffc24320dd8aa468c97453fa44bd838ae66a6a96334cda8e3e",
}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    synthetic.generate("tiny", out, seed=0)
    fs = feature_set_from_text(SEED_TEXT, "seed")
    taobao.build_samples(out / "raw", out / "samples", fs, rows_per_part=1500, row_group_rows=300)
    return out / "samples"


def _update_kjt(h: hashlib._Hash, kjt: KeyedJaggedTensor) -> None:
    h.update(repr((kjt.keys(), kjt.stride(), kjt.length_per_key())).encode())
    for t in (kjt.values(), kjt.lengths()):
        _update_tensor(h, t)


def _update_tensor(h: hashlib._Hash, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(b"none")
        return
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.contiguous().numpy().tobytes())


def digest(loader: Loader, epoch: int) -> str:
    h = hashlib.sha256()
    batches: list[Batch] = list(loader.epoch(epoch))
    for b in batches:
        for kjt in (b.user, b.item, b.sequence):
            _update_kjt(h, kjt)
        for t in (b.user_index, b.labels, b.oracle):
            _update_tensor(h, t)
        h.update(repr(b.rows_are_users).encode())
    h.update(json.dumps(loader.stats.as_dict(), sort_keys=True).encode())
    return h.hexdigest()


def _loaders(train: Path, evaluation: Path) -> dict[str, tuple[Loader, int]]:
    fs: FeatureSet = feature_set_from_text(SEED_TEXT, "seed")
    tzrec = feature_set_from_text(TZREC_TEXT, "seed, TorchEasyRec ids")
    common = {"batch_size": 512, "seed": 7, "shuffle_rows": 900, "pin_memory": False}
    return {
        "shuffled": (Loader(train, fs, **common), 1),  # type: ignore[arg-type]
        "workers": (Loader(train, fs, num_workers=2, **common), 0),  # type: ignore[arg-type]
        "rank": (Loader(train, fs, rank=1, world_size=3, **common), 0),  # type: ignore[arg-type]
        "eval": (Loader(evaluation, fs, batch_size=300, shuffle=False, pin_memory=False), 0),
        "in_order": (
            Loader(
                train,
                fs,
                batch_size=512,
                shuffle=False,
                num_workers=2,
                shuffle_rows=600,
                message_rows=1024,
                pin_memory=False,
            ),
            1,
        ),
        "tzrec": (Loader(train, tzrec, **common), 0),  # type: ignore[arg-type]
    }


@pytest.mark.parametrize("name", list(GOLDEN))
def test_batches_equal_the_golden_digests(samples: Path, name: str) -> None:
    loader, epoch = _loaders(samples / "train", samples / "eval")[name]
    assert digest(loader, epoch) == GOLDEN[name], name
