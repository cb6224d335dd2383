"""Tensor parallelism over torch.distributed (EngineConfig.tensor_parallel_size = N).

The model is split Megatron-style over N ranks, one per GPU: each rank holds 1/N of the
attention heads (and of the KV cache), 1/N of the MLP, and the embedding and lm_head whole
or by vocabulary (models/layers/shard.py, models/layers/parallel.py). Rank 0 is the engine's own process,
the driver: it alone schedules, keeps the pools' bookkeeping, samples and verifies. Ranks
1..N-1 are worker processes (worker.py) that keep the KV of their heads under a copy of the
driver's block tables and run each of its forward calls on their shards (tp_executor.py). The
engine reaches this package only through `engine.executor.factory.start_parallel`. The
files, one job each: docs/architecture.md, "Tensor parallelism".
"""

from infer.distributed.driver import TensorParallelDriver, start_tensor_parallel

__all__ = ["TensorParallelDriver", "start_tensor_parallel"]
