"""Distributed training on torch.distributed (gloo on CPU, NCCL on GPU), launched by ``torchrun``.

- :mod:`.env`: the process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).
- :mod:`.comm`: all-to-all with per-step byte and time accounting (:class:`CommStats`).
- :mod:`.sharded_dynamic`: ROW_WISE dynamic tables (:class:`ShardedDynamicEmbedding`): key owner
  ``key % world_size``, keys and rows exchanged with all-to-all, gradients sent back to owners.
- :mod:`.replicated`: dense layers under DDP and replicated num_buckets tables
  (:class:`GradSync`), so that ``W`` ranks take the step one process takes on the global batch.

Example::

    torchrun --nproc_per_node 2 -m train train --config configs/multi_tower_din_taobao_dynamicemb.config \\
        --train data/small/samples/train --eval data/small/samples/eval --model-dir runs/dist
"""
