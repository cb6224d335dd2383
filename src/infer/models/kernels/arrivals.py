"""Arrival counters: int32 zeros that tell the last program of a split-KV launch to combine the
partials (it resets them). A KV pool owns one `ArrivalCounters`; captured graphs hold their
address, so a larger set is added beside the old ones, never swapped in."""

from __future__ import annotations

import torch

MIN_COUNTERS = 1 << 18  # the first set (1 MB: a batch of 256 x 128 tokens x 8 KV heads), so a capture rarely allocates


class ArrivalCounters:
    """The arrival counters of one owner's launches on `device`."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._kept: list[torch.Tensor] = []  # every set made, the largest last (graphs may hold the others)

    def take(self, n: int) -> torch.Tensor:
        """At least n int32 counters, all zero between launches."""
        if not self._kept or self._kept[-1].numel() < n:
            self._kept.append(torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=self.device))
        return self._kept[-1]
