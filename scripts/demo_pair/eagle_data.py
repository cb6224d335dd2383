"""Training data of the demo EAGLE-3 head: the frozen demo target's features over the corpus.

The teacher is the shipped demo target, run through infer's own `LlamaForCausalLM` with a
`HiddenCapture` (models/capture.py) at the head's three layer inputs and at the final normed
output, so the head learns the very features the engine hands it when it drafts. One pass
over the training windows is kept in memory (and, with `eagle_head --cache`, on disk):
per position the three captured layers [3H] and the final hidden state [H] (bf16), from
which the target's next-token distribution is recomputed at each training step (the
target's lm_head over the draft vocabulary), instead of storing V probabilities a position.

Besides corpus windows, the windows can hold the target's own continuations of short corpus
prompts (`generated_windows`, through the engine), greedy and sampled at T=1: the text the
head meets when it drafts at T=0 (where a small target's text is far more regular than the
corpus: it loops) and at T=1.

The draft vocabulary (EAGLE-3's reduced lm_head) is the `draft_vocab_size` most frequent
tokens of the training stream, in id order: `d2t[j] = target id - j`, `t2d` marks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.llm import LLM
from infer.models.capture import HiddenCapture
from infer.models.layers.attention import NoCacheView
from infer.models.llama import LlamaForCausalLM
from infer.sampling import SamplingParams

FEATURE_DTYPE = torch.bfloat16
EXTRACT_BATCH = 8
GENERATE_BATCH = 128  # sequences the engine decodes together for `generated_windows`


@dataclass
class HeadData:
    """Cached teacher features of `n` windows of `seq_len` tokens."""

    ids: torch.Tensor  # [n, S] token ids
    aux: torch.Tensor  # [n, S, 3H] the target's captured layer inputs (bf16)
    final: torch.Tensor  # [n, S, H] the target's final normed hidden states (bf16)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [B] -> (ids [B, S], aux [B, S, 3H] float32, final [B, S, H] float32)."""
        return self.ids[index], self.aux[index].float(), self.final[index].float()


def draft_vocabulary(stream: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of `stream` [N] (ties: lower id), sorted: [size]."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = torch.bincount(stream, minlength=vocab_size).double()  # [V]
    counts -= torch.arange(vocab_size, dtype=torch.double) / (2 * vocab_size)  # tie-break by id
    return torch.sort(torch.topk(counts, size).indices).values


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted draft ids [D] -> (d2t [D] int64: target id - draft id, t2d [V] bool)."""
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def coverage(stream: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of the tokens of `stream` [N] that the draft vocabulary [D] holds."""
    counts = torch.bincount(stream, minlength=vocab_size)
    return float(counts[draft_ids].sum()) / max(stream.numel(), 1)


def sample_windows(stream: torch.Tensor, seq_len: int, count: int, seed: int) -> torch.Tensor:
    """`count` non-overlapping windows [count, seq_len] of `stream` [N], chosen with `seed`."""
    available = stream.numel() // seq_len
    if available < count:
        raise ValueError(f"the stream holds {available} windows of {seq_len} tokens, fewer than the "
                         f"{count} asked for: lower num_sequences or seq_len")
    starts = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:count] * seq_len
    return stream[starts[:, None] + torch.arange(seq_len)]  # [count, S]


def generated_windows(target_dir: str, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0,
                      seed: int = 0) -> torch.Tensor:
    """The target's own continuations through the engine (CPU, EOS ignored, so every window
    is full), greedy at temperature 0, else sampled (request i seeded `seed + i`):
    prompts [n, P] -> windows [n, P + new_tokens]."""
    if new_tokens <= 0:
        raise ValueError(f"generated continuations need new_tokens > 0, got {new_tokens}")
    params = [SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=seed + i)
              for i in range(prompts.shape[0])]
    with LLM(target_dir, device="cpu", max_batch_size=min(GENERATE_BATCH, prompts.shape[0])) as llm:
        outs = llm.generate(prompt_token_ids=prompts.tolist(), sampling_params=params)
    continuations = torch.tensor([o.outputs[0].token_ids for o in outs], dtype=torch.long)  # [n, new_tokens]
    return torch.cat([prompts, continuations], dim=1)


@torch.inference_mode()
def extract_features(target: LlamaForCausalLM, windows: torch.Tensor, aux_layers: tuple[int, ...],
                     log_every: int = 0) -> HeadData:
    """Run the frozen target over windows [n, S] (positions 0..S-1) and keep its features."""
    layers = target.config.num_hidden_layers
    previous = target.capture
    target.capture = HiddenCapture(points=(*aux_layers, layers))
    h = target.config.hidden_size
    aux, final = [], []
    try:
        for i in range(0, windows.shape[0], EXTRACT_BATCH):
            ids = windows[i:i + EXTRACT_BATCH]
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            target.hidden_states(ids, positions, NoCacheView())
            last = target.capture.last  # [b, S, 4H]
            assert last is not None
            aux.append(last[..., :3 * h].to(FEATURE_DTYPE))
            final.append(last[..., 3 * h:].to(FEATURE_DTYPE))
            if log_every and (i // EXTRACT_BATCH) % log_every == 0:
                print(f"[eagle3] target features {i + ids.shape[0]}/{windows.shape[0]} windows", flush=True)
    finally:
        target.capture = previous
    return HeadData(ids=windows.clone(), aux=torch.cat(aux), final=torch.cat(final))
