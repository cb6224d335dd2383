"""Tensor parallelism over torch.distributed (EngineConfig.tensor_parallel_size = N).

The model is split Megatron-style over N ranks, one per GPU. Rank 0, the engine's process, alone schedules,
samples and verifies; ranks 1..N-1 are worker processes running each forward call on their shards.
Reached only through `engine.executor.factory.start_parallel`. docs/architecture.md, "Tensor parallelism".
"""

from infer.distributed.driver import TensorParallelDriver, start_tensor_parallel

__all__ = ["TensorParallelDriver", "start_tensor_parallel"]
