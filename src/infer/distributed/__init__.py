"""Tensor parallelism over torch.distributed (EngineConfig.tensor_parallel_size = N).

The model is split Megatron-style over N ranks, one per GPU: each rank holds 1/N of the
attention heads (and of the KV cache), 1/N of the MLP, and the embedding and lm_head whole
or by vocabulary (sharding.py, layers.py). Rank 0 is the engine's own process, the driver:
its scheduler is the only one, and it alone samples, accepts and verifies trees. Ranks
1..N-1 are worker processes (the engine starts them, or torchrun did) that mirror the
driver's KV pools and run the forward part of each of its forward calls on their shards,
meeting it in the all-reduces (mirror.py, worker.py). The engine reaches this package only
through its executor factory (`engine.executor.factory.start_parallel`, by module path).

    driver.py     starts and ends the worker ranks (no orphans: a worker exits when its
                  driver's pipe closes, even if the driver was killed)
    group.py      devices per rank, the process groups (NCCL or gloo + a gloo control group)
    protocol.py   the messages the driver sends (one `Invoke` per forward call)
    channel.py    how they travel (torch.distributed broadcasts)
    mirror.py     the driver's pools and forward functions, mirrored on every rank
    worker.py     a worker rank's loop
    sharding.py   which part of each checkpoint tensor a rank reads; its model
    layers.py     row-parallel and vocabulary-parallel layers and their collectives
"""

from infer.distributed.driver import TensorParallelDriver, start_tensor_parallel
from infer.distributed.sharding import TensorParallelShard

__all__ = ["TensorParallelDriver", "TensorParallelShard", "start_tensor_parallel"]
