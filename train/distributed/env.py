"""The process group of a ``torchrun`` launch: who this rank is, its device and its groups."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. ``sparse_group`` carries the embedding all-to-alls, which
    run inside backward while DDP all-reduces on the default group: separate groups keep the
    two streams of collectives from having to interleave in the same order on every rank."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    sparse_group: dist.ProcessGroup

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (pickled; for small host-side results)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum of float ``values`` over ranks (one small collective on the default group)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_reduce_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun (1 when started without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: str) -> DistEnv | None:
    """Join the job torchrun started (env:// rendezvous); None when WORLD_SIZE is 1 or unset.

    ``device`` "cuda" (or "cuda:N", the index is ignored) puts rank ``r`` on GPU LOCAL_RANK with
    NCCL; "cpu" uses gloo. Multi-node works as torchrun arranges it (``--nnodes``,
    ``--rdzv-endpoint``); checkpoints and exports then need a directory every node sees.
    """
    world = launched_world_size()
    if world <= 1:
        return None
    missing = [
        v for v in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
            "(torchrun --nproc_per_node N -m train train ...)"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    kind = torch.device(device).type
    if kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                "use --nproc_per_node <= the number of GPUs"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif kind == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"--device {device!r}: distributed training runs on cpu or cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    sparse_group = dist.new_group(backend=backend)
    log.info("rank %d of %d (local %d) on %s over %s", rank, world, local_rank, dev, backend)
    return DistEnv(rank, world, local_rank, dev, backend, sparse_group)


def shutdown(env: DistEnv | None) -> None:
    if env is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
