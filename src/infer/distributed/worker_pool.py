"""A worker rank's KV pool: the keys and values of its heads, and a copy of the driver's block tables.

The driver keeps every pool's bookkeeping; a worker's pool holds its heads' KV over the
driver's rows, its tables kept current by each message's `PoolChanges`. `table_digest` is
what the ranks compare in reports.
"""

from __future__ import annotations

import hashlib

import torch

from infer.cache.block_tables import BlockTables
from infer.cache.row_pool import RowPool
from infer.distributed.protocol import PoolChanges, PoolShape
from infer.models.kernels.arrivals import ArrivalCounters
from infer.models.llama import LlamaForCausalLM


class WorkerPool(RowPool):
    """What a forward function needs of a pool, for the heads of `model` (a rank's shard), laid out as `shape`."""

    def __init__(self, model: LlamaForCausalLM, shape: PoolShape) -> None:
        config, device = model.config, next(model.parameters()).device
        self.max_batch_size, self.max_seq_len = shape.max_batch_size, shape.max_seq_len
        self.block_size, self.scratch_row = shape.block_size, shape.rows - 1
        kv = (config.num_hidden_layers, shape.rows, config.num_key_value_heads, config.head_dim)
        self.k_cache = torch.zeros(kv, dtype=shape.dtype, device=device)  # [L, rows, Hkv, D]
        self.v_cache = torch.zeros(kv, dtype=shape.dtype, device=device)  # [L, rows, Hkv, D]
        self.tables = BlockTables(shape.max_batch_size, shape.max_blocks, device)
        self.arrivals = ArrivalCounters(device)  # (allocated at the first split-KV pass)

    def set_length(self, slot: int, length: int) -> None:
        """(Lengths are the driver's: a plan carries its rows' context lengths.)"""

    def apply(self, changes: PoolChanges) -> None:
        """The driver's changes since the last message: table entries, then row moves."""
        self.tables.apply(changes.tables)
        for src, dst in changes.moves:
            self.move_rows(src, dst)


def table_digest(tables: BlockTables) -> str:
    """A digest of every entry of the tables (equal on every rank while they agree)."""
    return hashlib.blake2b(tables.host.tobytes(), digest_size=16).hexdigest()
