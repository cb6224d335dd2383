"""One forward pass of a model through a KV pool (eager): `EagerForward`, the `ForwardFn`
(`speculative/forward.py`) that the runner and the draft proposer call, so CUDA graphs
(executor/graphs.py) replace exactly this computation and are tested equal to it on the GPU."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, BlockMask, CacheView, pack_rows
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.speculative.forward import ForwardFn
from infer.speculative.node_tree import RowTreeChunk, TreeFrame
from infer.speculative.tree import TreeChunk, TreeShape
from infer.speculative.verifier import verify_greedy_logits, verify_logits, verify_tree_greedy, verify_tree_logits
from infer.transfer import tensor_on, to_device


def sample_logits(logits: torch.Tensor, temperatures: Sequence[float], uniforms: torch.Tensor,
                  greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling of last-token logits [n, V] on their device: (ids [n], probs
    [n, V]). temperatures: per row (1.0 for greedy rows); uniforms: CPU float64 [n]; greedy
    rows take the argmax (one-hot probs). The sampling half of `ForwardFn.sample`."""
    device = logits.device
    temps = tensor_on(list(temperatures), device, torch.float32)
    probs = temperature_probs(logits, temps, tensor_on(list(greedy), device, torch.bool))
    return sample_from_probs(probs, to_device(uniforms, device)), probs


def verify_on_logits(logits: torch.Tensor, draft_tokens: torch.Tensor, counts: Sequence[int],
                     draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
                     uniforms: torch.Tensor) -> torch.Tensor:
    """Rejection sampling on a verification step's logits [n, K+1, V] (rows sampled with a
    temperature alone, greedy included): [n, K+2] long on their device. The acceptance half
    of `ForwardFn.verify` (its arguments as there)."""
    device = logits.device
    tokens, num = to_device(draft_tokens, device), tensor_on(list(counts), device, torch.long)
    if all(greedy):
        return verify_greedy_logits(logits, tokens, num)
    return verify_logits(logits, tensor_on(list(temperatures), device, torch.float32),
                         tensor_on(list(greedy), device, torch.bool), tokens, num, draft_probs,
                         to_device(uniforms, device))


@functools.lru_cache(maxsize=256)
def _static_chunk_tensors(chunk: TreeChunk, device: torch.device) -> tuple[BlockMask, torch.Tensor]:
    return BlockMask(chunk.mask(device), chunk.first_row), chunk.rotary_offsets(device)


def chunk_tensors(chunk: TreeChunk | RowTreeChunk, device: torch.device) -> tuple[BlockMask, torch.Tensor]:
    """The device tensors of a tree chunk: (its BlockMask, rotary offsets [width], or [B,
    width] per row); a static chunk's are made once."""
    if isinstance(chunk, RowTreeChunk):
        return chunk.tensors(device)
    return _static_chunk_tensors(chunk, device)


def verify_on_tree_logits(shape: TreeShape | TreeFrame, logits: torch.Tensor, node_tokens: torch.Tensor,
                          node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                          greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
    """The tree verifier on a verification step's logits [n, N+1, V] (rows sampled with a
    temperature alone, greedy included): [n, 2 * depth + 2] long on their device, packed
    rows (`verify_tree_nodes`) then accepted nodes. node_tokens, node_valid: CPU [n, N];
    draft_probs: [n, N, V] on the device or None (deterministic proposals); temperatures:
    per row (1.0 for greedy rows); uniforms: CPU float64 [n, U] (unread when all greedy)."""
    device = logits.device
    tokens, valid = to_device(node_tokens, device), to_device(node_valid, device)
    if all(greedy):
        packed, nodes = verify_tree_greedy(shape, logits, tokens, valid)
    else:
        packed, nodes = verify_tree_logits(shape, logits, tensor_on(list(temperatures), device, torch.float32),
                                           tensor_on(list(greedy), device, torch.bool), tokens, draft_probs,
                                           to_device(uniforms, device), valid)
    return torch.cat([packed, nodes], dim=1)


def check_tree_layout(layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> None:
    if layout.width != chunk.width:
        raise ValueError(f"a tree chunk of {chunk.width} rows needs a layout {chunk.width} wide, got {layout.width}")


def draft_steps(forward: ForwardFn, ids: torch.Tensor, layout: BatchLayout, steps: int,
                temperatures: Sequence[float], uniforms: torch.Tensor,
                greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ForwardFn.draft_loop` as `steps` calls of `forward` (every row greedy: the logits'
    argmax) or `forward.sample`, step 1 feeding ids (CPU [n, w]), each later step the token
    the step before chose (staying on the device); see `EagerForward.draft_loop`."""
    n, width = ids.shape
    if layout.chunk_lens != (width + steps - 1,) * n:
        raise ValueError(f"draft_loop: every row of the layout must be {width + steps - 1} wide "
                         f"(ids width {width} + {steps - 1} steps), got {layout.chunk_lens}")
    tokens, probs = [], []
    step_ids = ids
    for s in range(steps):
        offset, w = (0, width) if s == 0 else (width + s - 1, 1)
        step = BatchLayout.of(layout.slots, [p + offset for p in layout.start_positions], [w] * n)
        if all(greedy):
            new = greedy_tokens(forward(step_ids, step, all_logits=False))  # [n]
        else:
            new, p = forward.sample(step_ids, step, temperatures, uniforms[:, s], greedy)  # [n], [n, V]
            probs.append(p)
        tokens.append(new)
        step_ids = new[:, None]
    return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)


class EagerForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, kernels: Kernels = EAGER) -> None:
        self.model, self.pool, self.kernels = model, pool, kernels
        self.device = next(model.parameters()).device

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        """Logits of ids [B, T] (CPU or device): [B, T, V], or [B, V] of each row's last
        token. A packed layout runs the valid tokens alone, as one row (last-token logits)."""
        if layout.packed and all_logits:
            raise ValueError("a packed layout gives each row's last-token logits only: call with all_logits=False")
        view = self.pool.view(layout)
        ids, positions = to_device(ids, self.device), layout.positions(self.device)  # [B, T] each
        if layout.packed:  # [1, N]; the row index 0 broadcasts over `last` [B] in the model
            packing = layout.packing(self.device)
            ids, positions = pack_rows(ids, packing), pack_rows(positions, packing)
        last = None if all_logits else layout.last_token_indices(self.device)
        logits = self.model(ids, positions, view, logits_indices=last, kernels=self.kernels)
        view.commit()
        return logits

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """A last-token step, then temperature sampling: (ids [n], probs [n, V]) on the device.

        temperatures: per row (1.0 for greedy rows); uniforms: CPU float64 [n]; greedy rows
        take the argmax (one-hot probs). CUDA graphs capture this same function."""
        return sample_logits(self(ids, layout, all_logits=False), temperatures, uniforms, greedy)

    def draft_loop(self, ids: torch.Tensor, layout: BatchLayout, steps: int, temperatures: Sequence[float],
                   uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's round: `steps` calls of `sample` (every row greedy: the logits'
        argmax, no probabilities), step 1 feeding ids (CPU [n, w]), each later step the token
        the step before chose (staying on the device).

        layout: the union of the steps, every row `w + steps - 1` wide (the positions step 1
        fills, then one per later step; the last token chosen is not fed); uniforms: CPU
        float64 [n, steps] (unread when every row is greedy). Returns (ids [n, steps], probs
        [n, steps, V] or None) on the device; the pool ends committed to the union. CUDA
        graphs capture this whole loop as one replay."""
        return draft_steps(self, ids, layout, steps, temperatures, uniforms, greedy)

    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> torch.Tensor:
        """A tree chunk through gather + SDPA with the chunk's block mask (per row for a
        `RowTreeChunk`): logits [B, width, V]."""
        check_tree_layout(layout, chunk)
        block, offsets = chunk_tensors(chunk, self.device)
        indices = self.pool.indices(layout).to(self.device)
        view = CacheView(self.pool.k_cache, self.pool.v_cache, indices, block=block)
        positions = indices.q_pos[:, :1] + offsets  # [B, width] rotary positions
        logits = self.model(to_device(ids, self.device), positions, view, logits_indices=None, kernels=self.kernels)
        self.pool.commit(layout)
        return logits

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk,
                    node_tokens: torch.Tensor, node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                    greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        """`tree`, then `verify_on_tree_logits`; CUDA graphs capture the same function."""
        assert chunk.shape is not None  # (a draft level's chunk is never verified)
        return verify_on_tree_logits(chunk.shape, self.tree(ids, layout, chunk), node_tokens, node_valid,
                                     draft_probs, temperatures, greedy, uniforms)

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        return False

    def prepare_draft_loops(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        pass

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        pass

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        """A verification step (all logits of [g, t_1..t_K] per row), then rejection sampling
        for rows whose only sampling transform is a temperature: [n, K+2] long on the device
        (`verifier.verify_tensors`' rows). draft_tokens: CPU [n, K]; counts: drafts per row;
        draft_probs: [n, K, V] on the device or None (deterministic proposals); temperatures:
        per row (1.0 for greedy rows); uniforms: CPU float64 [n, K+1]. CUDA graphs capture
        the same function."""
        logits = self(ids, layout, all_logits=True)  # [n, K+1, V]
        return verify_on_logits(logits, draft_tokens, counts, draft_probs, temperatures, greedy, uniforms)
