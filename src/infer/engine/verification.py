"""Verification: one target forward over each request's draft, then the verifier.

A round's drafts share one shape (`speculative.tree`): a chain (`chain_shape(K)`, row b
using its first k_b nodes) or a static tree; or each row has its own dynamic tree
(`speculative.node_tree`: N nodes at most, per-row masks, eagerly). All run the same steps:

1. the block [g, draft nodes] per request goes through the target in one forward, written
   to the target's cache like a chunked prefill from position n on. A chain keeps its
   causal fast path: rows k_b + 1 wide, no tree mask (`ForwardFn.verify`); a tree is
   N + 1 wide with its tree mask (`ForwardFn.verify_tree`, `TreeChunk`; dynamic trees a
   `RowTreeChunk` of per-row masks, rotary offsets and the verifier's `TreeFrame`);
2. rows sampling with a temperature alone (greedy included) are verified by the forward
   function itself (a CUDA graph after the forward's on the GPU); rows with top-k, top-p or
   a repetition penalty, a structured output, or asking for log-probabilities, take the
   general pipeline: the target's distribution per block row after the request's grammar
   mask (row 0 at the grammar's state, row 1 + i after node i's path: a draft token the
   grammar forbids has target probability 0 and is rejected) and its sampling transforms
   (penalties over that row's own context: the request's tokens and the node's path), then
   the pure verifier (`speculative.verifier`);
3. one host sync reads the accepted tokens and, for a tree, the accepted node indices.

Uniforms come from each request's own generator, so a seeded request's draws never depend
on its batch: a chain row draws k_b + 1, a tree row U = sum(branching) + 1 (one when it
proposes nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from infer.cache.view import BatchLayout
from infer.engine.request import Request
from infer.logprobs import emitted_logprobs
from infer.sampling import logits_to_probs, round_uniforms, temperature_only
from infer.speculative.forward import ForwardFn
from infer.speculative.grammar_mask import allocate_bitmask, fill_row, mask_logits
from infer.speculative.node_tree import DynamicShape, NodeTree, RowTreeChunk, verification_chunk
from infer.speculative.tree import Draft, TreeChunk, TreeShape, stack_drafts
from infer.speculative.verifier import VerifyResult, unpack_rows, verify, verify_tree_nodes
from infer.transfer import to_device

Paths = list[list[int]]  # per request, the accepted node indices in depth order


def stack_draft_probs(drafts: Sequence[Draft], tokens: torch.Tensor, vocab: int,
                      device: torch.device) -> torch.Tensor | None:
    """[B, W, V] draft distributions on `device` for the first W nodes of each draft (tokens:
    [B, W] host): the draft's q where it reported one, a one-hot row at each present node's
    token where it is deterministic; None when every draft is (all one-hot q)."""
    if all(d.probs is None for d in drafts):
        return None
    b, width = tokens.shape
    out = torch.zeros((b, width, vocab), dtype=torch.float32, device=device)
    for i, d in enumerate(drafts):
        if d.probs is not None:
            m = min(width, d.probs.shape[0])
            out[i, :m] = d.probs[:m]
        else:
            present = [j for j in range(min(width, len(d.valid))) if d.valid[j]]
            if present:
                out[i, present, tokens[i, present]] = 1.0
    return out


def _grammar_masked_block(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Draft]
                          ) -> torch.Tensor:
    """logits [B, W, V] with each constrained request's block rows restricted to its grammar:
    row 0 at the grammar's current state, row 1 + i at the state after node i's path (a
    node the grammar refuses gets target probability 0 there and is rejected by the
    verifier). Rows past a request's proposed nodes are left as they are."""
    b, width, vocab = logits.shape
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return logits
    first = requests[constrained[0]].grammar
    assert first is not None
    bitmask = allocate_bitmask(len(constrained) * width, first.vocab_size)
    rows: list[int] = []
    for j, i in enumerate(constrained):
        r, d = requests[i], drafts[i]
        fill_row(r, bitmask, j * width)
        for node, path in enumerate(d.shape.paths[:width - 1]):
            if node < len(d.valid) and d.valid[node]:
                fill_row(r, bitmask, j * width + 1 + node, [d.token_ids[n] for n in path])
        rows += [i * width + w for w in range(width)]
    return mask_logits(logits.reshape(b * width, vocab), bitmask, rows).view(b, width, vocab)


class Verification:
    """Runs a round's verification for the runner (module docstring)."""

    def __init__(self, forward: ForwardFn, vocab_size: int, device: torch.device,
                 tree: TreeShape | DynamicShape | None) -> None:
        self.forward, self.vocab, self.device = forward, vocab_size, device
        self.tree = tree  # None: chains
        # a static tree's block (a dynamic tree's is made per round: `_block`)
        self.chunk = TreeChunk.verification(tree) if isinstance(tree, TreeShape) else None

    def run(self, requests: Sequence[Request], drafts: Sequence[Draft],
            while_gpu_runs: Callable[[], None]) -> tuple[VerifyResult, Paths]:
        """Verify every request's draft -> (tokens per request, accepted nodes per request).
        `while_gpu_runs` is called once the forward is queued (host work that hides under it)."""
        ids, layout, tokens, counts, chunk = self._block(requests, drafts)
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        draft_probs = stack_draft_probs(drafts, tokens, self.vocab, self.device)
        if all(temperature_only(p, self.vocab) and p.logprobs is None and p.structured is None for p in params):
            # the forward function verifies too (a CUDA graph on the GPU)
            uniforms = (torch.zeros((len(requests), self._num_uniforms(tokens)), dtype=torch.float64)
                        if all(greedy) else self._uniforms(requests, drafts, tokens))
            temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
            if chunk is None:
                packed = self.forward.verify(ids, layout, tokens, counts, draft_probs, temps, greedy, uniforms)
            else:
                packed = self.forward.verify_tree(ids, layout, chunk, tokens, counts, draft_probs, temps,
                                                  greedy, uniforms)
            while_gpu_runs()
            return self._unpack(packed.tolist())  # the one host sync of verification
        if chunk is None:
            logits = self.forward(ids, layout, all_logits=True)  # [B, K+1, V]
        else:
            logits = self.forward.tree(ids, layout, chunk)  # [B, N+1, V]
        while_gpu_runs()
        uniforms = to_device(self._uniforms(requests, drafts, tokens), self.device)
        target_probs = self._target_probs(requests, drafts, logits)
        if chunk is None:
            k = tokens.shape[1]
            result = verify(tokens, counts, draft_probs, target_probs, uniforms[:, :k], uniforms[:, k])
            paths = [list(range(a)) for a in result.num_accepted]
        else:
            assert chunk.shape is not None
            packed, nodes = verify_tree_nodes(chunk.shape, to_device(tokens, self.device), draft_probs,
                                              target_probs, uniforms, to_device(counts, self.device))
            result, paths = self._unpack(torch.cat([packed, nodes], dim=1).tolist())
        wanted = [p.logprobs for p in params]
        if any(c is not None for c in wanted):
            width = 1 + max(len(p) for p in paths)
            rows = [[0] + [1 + i for i in path] + [0] * (width - 1 - len(path)) for path in paths]
            path_logits = logits[torch.arange(len(requests))[:, None], torch.tensor(rows)]  # [B, L+1, V]
            result = replace(result, logprobs=emitted_logprobs(path_logits, result.tokens, wanted))
        return result, paths

    def _block(self, requests: Sequence[Request], drafts: Sequence[Draft]
               ) -> tuple[torch.Tensor, BatchLayout, torch.Tensor, list[int] | torch.Tensor,
                          TreeChunk | RowTreeChunk | None]:
        """(ids [B, W] CPU: g then the nodes, the layout, node tokens [B, W - 1] CPU, which
        nodes are present: a chain's counts k_b, a tree's flags [B, N] bool, and the tree's
        chunk: None for a chain, the static tree's, or this round's per-row trees')."""
        slots = [r.slot for r in requests]
        starts = [r.num_computed_tokens for r in requests]
        last = torch.tensor([[r.last_token_id] for r in requests])  # [B, 1]
        chunk: TreeChunk | RowTreeChunk | None = self.chunk
        if isinstance(self.tree, DynamicShape):
            n = self.tree.num_nodes
            trees = [d.shape for d in drafts]
            assert all(isinstance(t, NodeTree) for t in trees)
            chunk = verification_chunk(trees, n, self.tree.widths, self.device)  # type: ignore[arg-type]
        if chunk is not None:
            tokens, valid = stack_drafts(drafts, width=chunk.width - 1)  # [B, N]
            layout = BatchLayout.of(slots, starts, [d.rows_used for d in drafts], width=chunk.width)
            return torch.cat([last, tokens], dim=1), layout, tokens, valid, chunk
        counts = [d.num_proposed for d in drafts]
        k = max(counts)
        tokens = torch.tensor([d.token_ids[:k] for d in drafts], dtype=torch.long).view(len(drafts), k)  # [B, K]
        layout = BatchLayout.of(slots, starts, [c + 1 for c in counts])
        return torch.cat([last, tokens], dim=1), layout, tokens, counts, None

    def _num_uniforms(self, tokens: torch.Tensor) -> int:
        return tokens.shape[1] + 1 if self.tree is None else self.tree.num_uniforms

    def _uniforms(self, requests: Sequence[Request], drafts: Sequence[Draft], tokens: torch.Tensor) -> torch.Tensor:
        """CPU float64 [B, U]: a chain row draws one per draft, a tree row U - 1 when it
        proposes anything (the columns are fixed per depth and child), and one for its final
        token (the last column)."""
        width = self._num_uniforms(tokens) - 1
        counts = [d.num_proposed if self.tree is None else width if d.num_proposed else 0 for d in drafts]
        return round_uniforms([r.generator for r in requests], counts, width)

    def _target_probs(self, requests: Sequence[Request], drafts: Sequence[Draft],
                      logits: torch.Tensor) -> torch.Tensor:
        """The general pipeline per block row: [B, W, V]. Block row 0 reads the request's
        tokens, row 1 + i those extended by node i's path (the penalties' context)."""
        b, width, vocab = logits.shape
        contexts = None
        if any(r.sampling_params.penalized for r in requests):
            contexts = []
            for r, d in zip(requests, drafts, strict=True):
                base = r.all_token_ids
                contexts.append(base)
                paths = d.shape.paths[:width - 1]
                contexts += [base + [d.token_ids[j] for j in path] for path in paths]
                contexts += [base] * (width - 1 - len(paths))  # (rows past a dynamic tree's nodes)
        flat_params = [r.sampling_params for r in requests for _ in range(width)]
        flat = _grammar_masked_block(logits, requests, drafts).reshape(b * width, vocab)
        return logits_to_probs(flat, flat_params, contexts).view(b, width, vocab)

    def _unpack(self, rows: list[list[int]]) -> tuple[VerifyResult, Paths]:
        """The verifier's packed rows on the host: a chain's [K+2] (`unpack_rows`), a tree's
        [depth + 2] then its accepted nodes [depth] (-1 after the last)."""
        if self.tree is None:
            result = unpack_rows(rows)
            return result, [list(range(a)) for a in result.num_accepted]
        width = self.tree.depth + 2
        result = unpack_rows([row[:width] for row in rows])
        return result, [[i for i in row[width:] if i >= 0] for row in rows]
