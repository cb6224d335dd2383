"""Tensor parallelism over torch.distributed (EngineConfig.tensor_parallel_size = N).

The model is split Megatron-style over N ranks, one per GPU: each rank holds 1/N of the
attention heads (and of the KV cache), 1/N of the MLP, and the embedding and lm_head whole
or by vocabulary; its layers are built parallel (models/shard.py, models/parallel.py). Rank
0 is the engine's own process, the driver: its scheduler and its pools' bookkeeping are
the only ones, and it alone samples, accepts and verifies trees. Ranks 1..N-1 are worker
processes (the engine starts them, or torchrun did) that keep the KV of their heads under
a copy of the driver's block tables and run the forward part of each of its forward calls
on their shards, meeting it in the all-reduces (mirror.py, worker.py). The engine reaches
this package only through its executor factory (`engine.executor.factory.start_parallel`,
by module path).

    driver.py       starts and ends the worker ranks (no orphans: a worker exits when its
                    driver's pipe closes, even if the driver was killed)
    group.py        devices per rank, the process groups (NCCL or gloo + a gloo control group)
    protocol.py     the messages the driver sends (one a forward call, with the KV changes
                    since the last one)
    channel.py      how they travel (torch.distributed broadcasts)
    mirror.py       the driver's executor: forward functions run on every rank, pools whose
                    table changes and row moves go with the messages
    worker_pool.py  a worker's pool: the KV of its heads, the driver's block tables
    worker.py       a worker rank's loop
    one_shot.py     the one-shot all-reduce of small messages (tensor_parallel_all_reduce)
"""

from infer.distributed.driver import TensorParallelDriver, start_tensor_parallel

__all__ = ["TensorParallelDriver", "start_tensor_parallel"]
