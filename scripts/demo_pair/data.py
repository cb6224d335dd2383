"""Token streams cut into training batches and validation chunks.

The corpus is one stream of ids (BOS + file + EOS, files concatenated). Training draws
sequences of `seq_len + 1` tokens (inputs and next-token labels) that start every
`seq_len` tokens from a random offset in [0, seq_len), drawn once per epoch, and visits
them in a shuffled order; both come from a seeded generator, so the batches are the same
on every run. Validation uses fixed, non-overlapping chunks that predict every token of the
stream after the first exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def num_sequences(stream_len: int, seq_len: int) -> int:
    """Sequences per epoch (the smallest count over the possible epoch offsets)."""
    return max((stream_len - seq_len) // seq_len, 0)


def training_batches(stream: torch.Tensor, seq_len: int, batch_size: int,
                     generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches [batch_size, seq_len + 1] of `stream` [N], epoch after epoch."""
    count = num_sequences(stream.numel(), seq_len)
    if count < batch_size:
        raise ValueError(f"the training stream ({stream.numel()} tokens) holds {count} sequences "
                         f"of {seq_len + 1} tokens, fewer than batch_size={batch_size}: use more "
                         "files, a smaller batch or a shorter sequence")
    window = torch.arange(seq_len + 1)  # [S + 1]
    while True:
        offset = int(torch.randint(0, seq_len, (1,), generator=generator))
        starts = offset + seq_len * torch.randperm(count, generator=generator)  # [count]
        for i in range(0, count - batch_size + 1, batch_size):
            yield stream[starts[i:i + batch_size, None] + window]  # [B, S + 1]


def validation_chunks(stream: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Chunks [<= seq_len + 1] at stride seq_len; consecutive chunks share one token."""
    chunks = []
    for start in range(0, max(stream.numel() - 1, 0), seq_len):
        chunk = stream[start:start + seq_len + 1]
        if chunk.numel() >= 2:
            chunks.append(chunk)
    return chunks


def batch_chunks(chunks: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Stack chunks of equal length into batches [b, L]; a shorter last chunk comes alone."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    group: list[torch.Tensor] = []
    for chunk in chunks:
        if group and chunk.numel() != group[0].numel():
            yield torch.stack(group)
            group = []
        group.append(chunk)
        if len(group) == batch_size:
            yield torch.stack(group)
            group = []
    if group:
        yield torch.stack(group)


def read_texts(paths: list[Path]) -> list[str]:
    """File contents as str (UTF-8, universal newlines), in the order given."""
    texts = []
    for path in paths:
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text ({exc.reason}); pass only files that "
                             "stdlib_files() returns") from exc
    return texts
