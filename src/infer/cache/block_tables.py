"""BlockTables: every slot's block table as one tensor on the pool's device, kept current by
changes rather than copies (`sync`). A tensor-parallel worker's copy follows the same changes
(`follow`, `take_changes`, `apply`). docs/architecture.md, "Model, kernels and attention".
"""

from __future__ import annotations

import numpy as np
import torch

from infer.transfer import to_device

Changes = np.ndarray  # [K, 3] int64 (slot, index, block), in the order they were made


class BlockTables:
    def __init__(self, num_slots: int, max_blocks: int, device: torch.device | str) -> None:
        self.host = np.zeros((num_slots, max_blocks), dtype=np.int64)  # [slots, max_blocks]
        self.device = torch.device(device)
        self.on_device = (torch.from_numpy(self.host) if self.device.type == "cpu"
                          else torch.zeros((num_slots, max_blocks), dtype=torch.long, device=self.device))
        self._changed: list[tuple[int, int, int]] = []  # (slot, index, block) not yet on the device
        self._followed: list[tuple[int, int, int]] | None = None  # not yet taken by the follower

    @property
    def max_blocks(self) -> int:
        return self.host.shape[1]

    def set(self, slot: int, start: int, blocks: list[int]) -> None:
        """Entries start.. of the slot's table are `blocks`."""
        if start + len(blocks) > self.max_blocks:
            raise RuntimeError(f"slot {slot}: {start + len(blocks)} blocks exceed the table's {self.max_blocks}")
        self.host[slot, start:start + len(blocks)] = blocks
        if self.device.type == "cpu" and self._followed is None:
            return
        changes = [(slot, start + i, b) for i, b in enumerate(blocks)]
        if self.device.type != "cpu":
            self._changed += changes
        if self._followed is not None:
            self._followed += changes

    def sync(self) -> torch.Tensor:
        """The device tables [slots, max_blocks], changes applied (one copy, queued)."""
        if self._changed:
            change = torch.from_numpy(last_writes(np.array(self._changed, dtype=np.int64), self.max_blocks))
            change = to_device(change, self.device)  # [K, 3] (pinned: no wait for the queued work)
            self.on_device[change[:, 0], change[:, 1]] = change[:, 2]
            self._changed.clear()
        return self.on_device

    # -- a follower's copy -----------------------------------------------------------------
    def follow(self) -> Changes:
        """Journal every change from now on for a follower; returns its starting point (the nonzero entries)."""
        self._followed = []
        slots, index = np.nonzero(self.host)
        return np.stack([slots, index, self.host[slots, index]], axis=1).astype(np.int64)

    def take_changes(self) -> Changes:
        """The changes made since `follow` or the last call (emptied)."""
        if self._followed is None:
            raise RuntimeError("these block tables have no follower: call follow() first")
        out = np.array(self._followed, dtype=np.int64).reshape(-1, 3)
        self._followed = []
        return out

    def apply(self, changes: Changes) -> None:
        """The follower's side: make the changes (in order: a later change of an entry wins)."""
        if not len(changes):
            return
        latest = last_writes(changes, self.max_blocks)
        self.host[latest[:, 0], latest[:, 1]] = latest[:, 2]
        if self.device.type != "cpu":
            self._changed += [(s, i, b) for s, i, b in latest.tolist()]


def last_writes(changes: Changes, max_blocks: int) -> Changes:
    """The changes with each (slot, index) once, at its last value."""
    key = changes[:, 0] * max_blocks + changes[:, 1]  # [K]
    _, last_reversed = np.unique(key[::-1], return_index=True)
    return changes[len(changes) - 1 - last_reversed]
