"""BlockTables: every slot's block table as one tensor on the pool's device, kept current by
changes rather than copies.

A pool's slots own block tables (the block id of each `block_size` positions). A forward
pass reads them on the device as `tables[row_slots]`; the host's copy is changed as blocks
are taken or swapped (a prefix-cache hit), and the changes reach the device in one small
copy before the next pass (`sync`), so a step moves a few integers, not B x max_blocks.
Entries past a slot's length are never read (keys there are masked), so freeing and
truncating change nothing.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, num_slots: int, max_blocks: int, device: torch.device | str) -> None:
        self.host = np.zeros((num_slots, max_blocks), dtype=np.int64)  # [slots, max_blocks]
        self.device = torch.device(device)
        self.on_device = (torch.from_numpy(self.host) if self.device.type == "cpu"
                          else torch.zeros((num_slots, max_blocks), dtype=torch.long, device=self.device))
        self._changed: list[tuple[int, int, int]] = []  # (slot, index, block) not yet on the device

    @property
    def max_blocks(self) -> int:
        return self.host.shape[1]

    def set(self, slot: int, start: int, blocks: list[int]) -> None:
        """Entries start.. of the slot's table are `blocks`."""
        if start + len(blocks) > self.max_blocks:
            raise RuntimeError(f"slot {slot}: {start + len(blocks)} blocks exceed the table's {self.max_blocks}")
        self.host[slot, start:start + len(blocks)] = blocks
        if self.device.type != "cpu":
            self._changed += [(slot, start + i, b) for i, b in enumerate(blocks)]

    def sync(self) -> torch.Tensor:
        """The device tables [slots, max_blocks], changes applied (one copy, queued)."""
        if self._changed:
            change = torch.tensor(self._changed, dtype=torch.long).to(self.device, non_blocking=True)  # [K, 3]
            self.on_device[change[:, 0], change[:, 1]] = change[:, 2]
            self._changed.clear()
        return self.on_device
