"""TreeSpeculativeRunner: tree speculation, chosen by the engine when `spec_tree` is set.

A decode step, for a static `TreeShape` (N nodes, depth D; see `speculative.tree`):

1. depth limits: the fixed policy's D per request, cut by the chain's length guards and by
   storage (`fit_depth`: a row of depth limit k writes positions n .. n + level_starts[k]);
   nobody drafting is exactly the plain decode step;
2. the proposer drafts a tree per request (`Proposer.propose_tree`: a draft model level by
   level, n-gram tables by their distinct continuations), no node deeper than its limit;
3. one target forward over the block [g, node_0..node_{N-1}] per request (`ForwardFn.tree`:
   node i stored at n + 1 + i, rotary position n + depth(i), visible: the context, g, its
   ancestors and itself; a CUDA graph per (batch bucket, tree) on the GPU), all logits;
4. the tree verifier: `verify_tree_greedy` for all-greedy batches, `verify_tree_logits` for
   rows sampling with a temperature alone, else the general pipeline (penalties over each
   node's own context, top-k, top-p) and `verify_tree_nodes`; uniforms from each request's
   generator, U = sum(branching) + 1 a row;
5. the accepted path's K/V rows move into sequence order (`cache.compaction`, target and
   draft), both caches are truncated to n + L + 1 (the draft: to what it was fed), and the
   tokens are emitted one by one, so a stop inside the path ends the request there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from infer.cache.compaction import PathMove, move_paths
from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.executor import ForwardFn
from infer.engine.executor.factory import LOCAL, Executor
from infer.engine.request import Request
from infer.engine.runner import ContinuousRunner
from infer.engine.speculative_runner import SpeculativeRunner, stack_draft_probs
from infer.logprobs import emitted_logprobs
from infer.models.llama import LlamaForCausalLM
from infer.sampling import logits_to_probs, round_uniforms, temperature_only
from infer.speculative.rejection import VerifyResult, unpack_rows
from infer.speculative.tree import TreeChunk, TreeDraft, TreeShape, stack_drafts
from infer.speculative.tree_verify import verify_tree_nodes
from infer.tokenization import Tokenizer
from infer.transfer import to_device


def fit_depth(shape: TreeShape, k: int, seq_len: int, max_seq_len: int) -> int:
    """The largest depth <= k whose block fits: positions seq_len .. seq_len + level_starts[depth]."""
    while k > 0 and seq_len + shape.level_starts[k] >= max_seq_len:
        k -= 1
    return k


class TreeSpeculativeRunner(SpeculativeRunner):
    draft_loop_rounds = False  # a draft model expands trees level by level (draft_tree.py)

    def __init__(self, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM | None,
                 tokenizer: Tokenizer | None, config: EngineConfig, eos_token_ids: tuple[int, ...],
                 executor: Executor = LOCAL) -> None:
        if config.spec_tree is None:
            raise ValueError("TreeSpeculativeRunner needs config.spec_tree")
        self.tree = TreeShape.parse(config.spec_tree)
        vocab = target_model.config.vocab_size
        if max(self.tree.branching) > vocab:
            raise ValueError(f"spec_tree {self.tree} asks for {max(self.tree.branching)} children of a node but "
                             f"the vocabulary has {vocab} tokens")
        super().__init__(target_model, draft_model, tokenizer, config, eos_token_ids, executor)
        self.verify_chunk = TreeChunk.verification(self.tree)
        modes = ("greedy", "one_hot") + (("draft_probs",) if self.draft is not None else ())
        self.forward.prepare_trees([self.verify_chunk], verify_modes=modes)
        if self.draft is not None:  # the draft's levels 1 .. D-1 (the deepest is never fed)
            self.draft.step_forward.prepare_trees([TreeChunk.level(self.tree, d) for d in range(1, self.tree.depth)])

    def _make_decode_forward(self) -> ForwardFn:
        # plain decode steps as the plain runner; the tree block is captured by `prepare_trees`
        return ContinuousRunner._make_decode_forward(self)

    def decode_demand(self, request: Request) -> int:
        # the whole block's N + 1 positions, never past max_seq_len (`fit_depth` shrinks it there)
        room = self.config.max_seq_len - request.num_computed_tokens
        need = self.tree.num_nodes + 1
        return need if room >= need else max(1, room)

    def tree_depths(self, requests: Sequence[Request]) -> list[int]:
        """Depth limit per request this step: the policy's, cut by the length guards and storage."""
        return [fit_depth(self.tree, k, r.num_computed_tokens, self.config.max_seq_len)
                for r, k in zip(requests, self._take_lengths(requests), strict=True)]

    def _decode(self, requests: Sequence[Request]) -> tuple[list[Request], torch.Tensor, list] | None:
        depths = self.tree_depths(requests)
        if not any(depths):  # nobody speculates this step: exactly the plain decode step
            return ContinuousRunner._decode(self, requests)
        drafts = self.proposer.propose_tree(requests, self.tree, depths)
        if not any(d.num_proposed for d in drafts):  # no proposals at all (n-gram found no match)
            for r, k in zip(requests, depths, strict=True):
                if k:
                    self.policy.update(r.request_id, 0, 0)
            return ContinuousRunner._decode(self, requests)
        result, paths = self._verify_tree(requests, drafts)
        self._accept_tree(requests, drafts, result, paths)
        return None  # (the round's tokens are accepted: none left in flight)

    # -- verification ------------------------------------------------------------------------
    def _verify_tree(self, requests: Sequence[Request], drafts: Sequence[TreeDraft]
                     ) -> tuple[VerifyResult, list[list[int]]]:
        """One target forward over each request's block, then the tree verifier -> (tokens
        per request as a VerifyResult, the accepted node indices per request)."""
        shape, batch = self.tree, len(requests)
        node_tokens, node_valid = stack_drafts(drafts)  # [B, N] CPU
        ids = torch.cat([torch.tensor([[r.last_token_id] for r in requests]), node_tokens], dim=1)  # [B, N+1]
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [d.rows_used for d in drafts], width=shape.num_nodes + 1)
        params = [r.sampling_params for r in requests]
        vocab = self.model.config.vocab_size
        draft_probs = stack_draft_probs([d.probs for d in drafts], node_tokens, [shape.num_nodes] * batch, vocab,
                                        self.device)
        greedy = [p.greedy for p in params]
        if all(temperature_only(p, vocab) and p.logprobs is None for p in params):
            # greedy and temperature-only rows: the forward function verifies too (a CUDA graph on the GPU)
            uniforms = (torch.zeros((batch, shape.num_uniforms), dtype=torch.float64) if all(greedy)
                        else self._uniforms(requests, drafts))  # [B, U]
            logits = None
            rows = self.forward.verify_tree(ids, layout, self.verify_chunk, node_tokens, node_valid, draft_probs,
                                            [1.0 if g else p.temperature for g, p in zip(greedy, params)], greedy,
                                            uniforms)  # [B, 2D+2]
            self._render_backlog()  # (the previous round's tokens, while the GPU verifies)
        else:
            logits = self.forward.tree(ids, layout, self.verify_chunk)  # [B, N+1, V]
            self._render_backlog()
            uniforms = to_device(self._uniforms(requests, drafts), self.device)  # [B, U]
            target_probs = self._tree_target_probs(requests, drafts, logits)
            packed, nodes = verify_tree_nodes(shape, to_device(node_tokens, self.device), draft_probs, target_probs,
                                              uniforms, to_device(node_valid, self.device))
            rows = torch.cat([packed, nodes], dim=1)
        host = rows.tolist()  # the one host sync of verification
        width = shape.depth + 2
        result = unpack_rows([row[:width] for row in host])
        paths = [[i for i in row[width:] if i >= 0] for row in host]
        counts = [p.logprobs for p in params]
        if logits is not None and any(c is not None for c in counts):
            blocks = [[0] + [1 + i for i in path] + [0] * (shape.depth - len(path)) for path in paths]
            path_logits = logits[torch.arange(batch)[:, None], torch.tensor(blocks)]  # [B, D+1, V]
            result = replace(result, logprobs=emitted_logprobs(path_logits, result.tokens, counts))
        return result, paths

    def _uniforms(self, requests: Sequence[Request], drafts: Sequence[TreeDraft]) -> torch.Tensor:
        """[B, U] uniforms: U from the generator of a request with a tree, one (its final
        token's, the last column) from that of a request without: a seeded request's draws
        depend on its own draft only, never on its batch."""
        counts = [self.tree.num_uniforms - 1 if d.num_proposed else 0 for d in drafts]
        return round_uniforms([r.generator for r in requests], counts, self.tree.num_uniforms - 1)

    def _tree_target_probs(self, requests: Sequence[Request], drafts: Sequence[TreeDraft],
                           logits: torch.Tensor) -> torch.Tensor:
        """The general pipeline per block row: [B, N+1, V]. Block row 0 reads the request's
        tokens, row 1 + i those extended by node i's path (the penalties' context)."""
        b, width, vocab = logits.shape
        contexts = None
        if any(r.sampling_params.penalized for r in requests):
            contexts = []
            for r, d in zip(requests, drafts, strict=True):
                base = r.all_token_ids
                contexts.append(base)
                contexts += [base + [d.token_ids[j] for j in path] for path in self.tree.paths]
        flat_params = [r.sampling_params for r in requests for _ in range(width)]
        return logits_to_probs(logits.reshape(b * width, vocab), flat_params, contexts).view(b, width, vocab)

    # -- acceptance --------------------------------------------------------------------------
    def _accept_tree(self, requests: Sequence[Request], drafts: Sequence[TreeDraft], result: VerifyResult,
                     paths: Sequence[Sequence[int]]) -> None:
        """Move the accepted paths into sequence order and roll both caches back, record
        metrics, accept the tokens in order (up to a finish their ids decide)."""
        slots = [r.slot for r in requests]
        assert all(s is not None for s in slots)
        move_paths(self.cache_pool, [PathMove(s, r.num_computed_tokens, tuple(p))
                                     for s, r, p in zip(slots, requests, paths, strict=True) if s is not None])
        self.proposer.on_tree_accepted(requests, paths)
        logprobs = result.logprobs or [[] for _ in requests]
        for r, d, tokens, a, row_lps in zip(requests, drafts, result.tokens, result.num_accepted, logprobs,
                                            strict=True):
            if r.is_finished:  # cut by a stop string rendered under this round: a wasted row
                continue
            n = r.num_computed_tokens
            self.cache_pool.truncate_to(r.slot, n + a + 1)
            r.num_computed_tokens = n + a + 1
            self.stats.record(d.num_proposed, a, self._emit_round(r, d.depth, a, tokens, row_lps), d.depth)
