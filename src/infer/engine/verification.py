"""Verification: each request's draft as rows of the step's one forward, then the verifier.

`Verification.block` makes each request's block [g, draft nodes] one row of the flat batch; `queue` runs the fused
acceptance on temperature-only rows (a `Verdict` read by `collect`: one host sync), `general` the full sampling
pipeline and the pure verifier. docs/speculation.md, "A round's verification".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from infer.cache.forward_batch import DeviceIds, Row, RowTree
from infer.engine.executor.forward import verify_on_logits, verify_on_tree_logits
from infer.engine.request import Request
from infer.logprobs import emitted_logprobs
from infer.sampling import logits_to_probs, round_uniforms, temperature_only
from infer.speculative.grammar_mask import allocate_bitmask, fill_row, mask_logits
from infer.speculative.node_tree import DynamicShape, NodeTree, TreeFrame, frame_of_trees, round_widths
from infer.speculative.tree import Draft, RoundTokens, TreeShape, stack_drafts
from infer.speculative.verifier import VerifyResult, unpack_rows, verify, verify_tree_nodes
from infer.transfer import HostCopy, tensor_on, to_device

Paths = list[list[int]]  # per request, the accepted node indices in depth order


def stack_draft_probs(drafts: Sequence[Draft], tokens: torch.Tensor, vocab: int,
                      device: torch.device) -> torch.Tensor | None:
    """[B, W, V] draft distributions on `device` for the first W nodes of each draft (tokens:
    [B, W] host): the draft's q, or one-hot rows for a deterministic draft; None when all are."""
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
    row 0 at its current state, row 1 + i after node i's path."""
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


def block_row(request: Request, draft: Draft, placed: bool = False) -> Row:
    """The request's block [g, draft nodes up to the last present] as one row of the step's
    batch, every token's logits wanted; a tree's with its rule. `placed`: device tokens get
    placeholders that `chain_tokens` fills."""
    used = draft.rows_used
    nodes = (0,) * (used - 1) if placed and draft.host_ids is None else draft.token_ids[:used - 1]
    ids = [request.last_token_id, *nodes]
    shape = draft.shape
    if isinstance(shape, TreeShape) and shape.is_chain:
        return Row(request.slot, request.num_computed_tokens, ids, logits=used)
    bits = [1] + [1 | sum(1 << (1 + j) for j in shape.paths[i]) for i in range(used - 1)]
    offsets = [0, *shape.depths[:used - 1]]
    return Row(request.slot, request.num_computed_tokens, ids, logits=used,
               tree=RowTree(bits, offsets, base_offset=0, width=used))


def device_rounds(drafts: Sequence[Draft]) -> list[RoundTokens]:
    """The rounds whose tokens the drafts left on the device, in order of first use."""
    rounds = {id(d.on_device[0]): d.on_device[0] for d in drafts if d.host_ids is None and d.on_device is not None}
    return list(rounds.values())


def chain_tokens(drafts: Sequence[Draft], rows: Sequence[Row], k: int, device: torch.device,
                 sources: Sequence[RoundTokens]) -> tuple[torch.Tensor, DeviceIds | None]:
    """Chain drafts' first k node tokens [B, k] and, for drafts left on the device by `sources`,
    where their tokens go in the flat batch of `rows` (None with no source: tokens on the host)."""
    if not sources:
        return torch.tensor([d.token_ids[:k] for d in drafts], dtype=torch.long).view(len(drafts), k), None
    on_device = [(b, d.on_device) for b, d in enumerate(drafts) if d.host_ids is None and d.on_device is not None]
    batch_rows = [b for b, _ in on_device]
    in_order = len(sources) == 1 and batch_rows == [j for _, (_, j) in on_device] and len(batch_rows) == len(drafts)
    if in_order:  # (every row drafted, in order, in one round: its first rows as they are)
        tokens = sources[0].tokens[:len(drafts), :k]
    else:
        host = [d.host_ids[:k] if d.host_ids is not None else (0,) * k for d in drafts]
        tokens = tensor_on(host, device, torch.long).view(len(drafts), k)
        for source in sources:
            mine = [(b, j) for b, (r, j) in on_device if r is source]
            width = min(k, source.tokens.shape[1])
            tokens[tensor_on([b for b, _ in mine], device, torch.long), :width] = \
                source.tokens[tensor_on([j for _, j in mine], device, torch.long), :width]
    starts = [0, *itertools.accumulate(len(r.ids) for r in rows)]
    counts = [drafts[b].num_proposed for b in batch_rows]
    at = [starts[b] + 1 + t for b, n in zip(batch_rows, counts, strict=True) for t in range(n)]
    if len(batch_rows) == len(drafts) and all(n == k for n in counts) \
            and all(len(r.ids) == k + 1 for r in rows):  # (every row k drafts: a grid)
        return tokens, DeviceIds(tuple(at), tokens.reshape(-1), grid=(k + 1, 1, k))
    picked = [b * k + t for b, n in zip(batch_rows, counts, strict=True) for t in range(n)]
    return tokens, DeviceIds(tuple(at), tokens.reshape(-1)[tensor_on(picked, device, torch.long)])


def following(requests: Sequence[Request], drafts: Sequence[Draft], follows: Follows) -> Block:
    """The rows of a round that follows the round in flight: every draft a chain of k on the
    device, planned as if every draft of the round in flight were accepted (`Follows` shifts them)."""
    sources = device_rounds(drafts)
    k = drafts[0].num_proposed
    if len(sources) != 1 or any(d.num_proposed != k or d.on_device is None or d.on_device[1] != b
                                for b, d in enumerate(drafts)):
        raise RuntimeError("a round following the round in flight needs every row's chain of one length drafted "
                           "ahead, in order, in one round")
    b = len(drafts)
    rows = [Row(r.slot, r.num_computed_tokens, (0,) * (k + 1), logits=k + 1) for r in requests]  # type: ignore[arg-type]
    tokens = sources[0].tokens[:b, :k]  # [B, k]
    ids = torch.cat([follows.first[:, None], tokens], dim=1)  # [B, k + 1]
    placed = DeviceIds(tuple(range(b * (k + 1))), ids.reshape(-1), grid=(k + 1, 0, k + 1), shift=follows.shift)
    return Block(rows, tokens, [k] * b, None, k + 1, placed)


@dataclass(frozen=True)
class Follows:
    """A round queued before the host has the verdict of the round in flight: each row's first
    token (the verdict's final one) and its start shift (-(k - accepted)), both on the device."""

    first: torch.Tensor  # [B] long
    shift: torch.Tensor  # [B] long, <= 0

    @classmethod
    def of(cls, packed: torch.Tensor) -> Follows:
        """From a round of chains' verdict [B, K + 2] on the device; a NO_TOKEN row feeds 0."""
        k = packed.shape[1] - 2
        return cls(packed[:, k + 1].clamp(min=0), packed[:, k] - k)


@dataclass(frozen=True)
class Verdict:
    """A round's verification queued on the device, its copy to the host under way."""

    packed: torch.Tensor  # [B, K + 2] (chains) or a tree's rows, on the device
    host: HostCopy
    block: Block


@dataclass(frozen=True)
class Block:
    """A round's verification rows and what the verifier reads of them."""

    rows: list[Row]  # one per request, in order
    tokens: torch.Tensor  # [B, W - 1] CPU: node tokens (a chain's first k_b, a tree's N)
    present: list[int] | torch.Tensor  # a chain's counts k_b, or a tree's flags [B, N] bool
    frame: TreeShape | TreeFrame | None  # the tree the verifier walks (None: chains)
    width: int  # W: block rows per request as the verifier reads them
    device_ids: DeviceIds | None = None  # the rows' draft tokens left on the device (their places in the batch)

    @property
    def num_logits(self) -> int:
        return sum(r.logits for r in self.rows)


class Verification:
    """Builds a round's verification rows and verifies their logits."""

    def __init__(self, vocab_size: int, device: torch.device, tree: TreeShape | DynamicShape | None) -> None:
        self.vocab, self.device = vocab_size, device
        self.tree = tree  # None: chains

    def block(self, requests: Sequence[Request], drafts: Sequence[Draft], follows: Follows | None = None) -> Block:
        """The round's rows; `follows`: the round in flight's verdict they follow (`following`)."""
        if follows is not None:
            return following(requests, drafts, follows)
        if self.tree is None or self._chains(drafts):
            sources = device_rounds(drafts)
            rows = [block_row(r, d, placed=bool(sources)) for r, d in zip(requests, drafts, strict=True)]
            counts = [d.num_proposed for d in drafts]
            tokens, device_ids = chain_tokens(drafts, rows, max(counts), self.device, sources)
            return Block(rows, tokens, counts, None, max(counts) + 1, device_ids)
        rows = [block_row(r, d) for r, d in zip(requests, drafts, strict=True)]
        if isinstance(self.tree, DynamicShape):
            n = self.tree.num_nodes
            trees = [d.shape for d in drafts]
            assert all(isinstance(t, NodeTree) for t in trees)
            frame: TreeShape | TreeFrame = frame_of_trees(trees, n, round_widths(trees), self.device)  # type: ignore[arg-type]
            tokens, valid = stack_drafts(drafts, width=n)
        else:
            frame, n = self.tree, self.tree.num_nodes
            tokens, valid = stack_drafts(drafts)
        return Block(rows, tokens, valid, frame, n + 1)

    def _chains(self, drafts: Sequence[Draft]) -> bool:
        """Whether a dynamic round's drafts are all chains (verified as chains)."""
        return isinstance(self.tree, DynamicShape) and all(isinstance(d.shape, TreeShape) and d.shape.is_chain
                                                           for d in drafts)

    def queue(self, requests: Sequence[Request], drafts: Sequence[Draft], block: Block, logits: torch.Tensor,
              queued: Callable[[torch.Tensor], None] | None = None) -> Verdict | None:
        """The fused acceptance on the rows' logits [sum of widths, V] when every row is
        temperature-only (else None), its copy to the host queued. `queued` gets a round of
        chains' verdict [B, K + 2] on the device."""
        params = [r.sampling_params for r in requests]
        if not all(temperature_only(p, self.vocab) and p.logprobs is None and p.structured is None for p in params):
            return None
        logits = self._padded(logits, block)  # [B, W, V]
        greedy = [p.greedy for p in params]
        tokens = block.tokens
        draft_probs = stack_draft_probs(drafts, tokens, self.vocab, self.device)
        uniforms = (torch.zeros((len(requests), self._num_uniforms(block)), dtype=torch.float64)
                    if all(greedy) else self._uniforms(requests, drafts, block))
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        if block.frame is None:
            assert isinstance(block.present, list)
            packed = verify_on_logits(logits, tokens, block.present, draft_probs, temps, greedy, uniforms)
        else:
            assert isinstance(block.present, torch.Tensor)
            packed = verify_on_tree_logits(block.frame, logits, tokens, block.present, draft_probs, temps,
                                           greedy, uniforms)
        verdict = Verdict(packed, HostCopy(packed), block)
        if queued is not None and block.frame is None:
            queued(packed)
        return verdict

    def collect(self, verdict: Verdict) -> tuple[VerifyResult, Paths]:
        """A queued verdict on the host (the one host sync of verification)."""
        return self._unpack(verdict.host.tolist(), verdict.block)

    def verify(self, requests: Sequence[Request], drafts: Sequence[Draft], block: Block, logits: torch.Tensor,
               while_gpu_runs: Callable[[], None]) -> tuple[VerifyResult, Paths]:
        """Every request's draft verified on its rows' logits [sum of widths, V] -> (tokens per
        request, accepted nodes per request). `while_gpu_runs` is called once the work is queued."""
        verdict = self.queue(requests, drafts, block, logits)
        if verdict is not None:
            while_gpu_runs()
            return self.collect(verdict)
        return self.general(requests, drafts, block, logits, while_gpu_runs)

    def general(self, requests: Sequence[Request], drafts: Sequence[Draft], block: Block, logits: torch.Tensor,
                while_gpu_runs: Callable[[], None]) -> tuple[VerifyResult, Paths]:
        """`verify` for rows `queue` does not take (a grammar, penalties, top-k / top-p, logprobs)."""
        logits = self._padded(logits, block)  # [B, W, V]
        params = [r.sampling_params for r in requests]
        tokens = block.tokens
        draft_probs = stack_draft_probs(drafts, tokens, self.vocab, self.device)
        while_gpu_runs()
        uniforms = to_device(self._uniforms(requests, drafts, block), self.device)
        target_probs = self._target_probs(requests, drafts, logits)
        if block.frame is None:
            k = tokens.shape[1]
            result = verify(tokens, block.present, draft_probs, target_probs, uniforms[:, :k], uniforms[:, k])
            paths = [list(range(a)) for a in result.num_accepted]
        else:
            packed, nodes = verify_tree_nodes(block.frame, to_device(tokens, self.device), draft_probs,
                                              target_probs, uniforms, to_device(block.present, self.device))
            result, paths = self._unpack(torch.cat([packed, nodes], dim=1).tolist(), block)
        wanted = [p.logprobs for p in params]
        if any(c is not None for c in wanted):
            width = 1 + max(len(p) for p in paths)
            rows = [[0] + [1 + i for i in path] + [0] * (width - 1 - len(path)) for path in paths]
            path_logits = logits[torch.arange(len(requests))[:, None], torch.tensor(rows)]  # [B, L+1, V]
            result = replace(result, logprobs=emitted_logprobs(path_logits, result.tokens, wanted))
        return result, paths

    def _padded(self, logits: torch.Tensor, block: Block) -> torch.Tensor:
        """The rows' logits [sum of widths, V] as [B, W, V] (missing rows repeat a row's last, unread)."""
        if all(r.logits == block.width for r in block.rows):  # (every row full: a view)
            return logits.view(len(block.rows), block.width, logits.shape[-1])
        index, at = [], 0
        for r in block.rows:
            index.append([at + min(t, r.logits - 1) for t in range(block.width)])
            at += r.logits
        return logits[tensor_on(index, logits.device)]

    def _num_uniforms(self, block: Block) -> int:
        return block.width if block.frame is None else block.frame.num_uniforms

    def _uniforms(self, requests: Sequence[Request], drafts: Sequence[Draft], block: Block) -> torch.Tensor:
        """CPU float64 [B, U]: a chain row draws one per draft, a tree row U - 1 when it proposes
        anything, and one for its final token (last column). A dynamic round's row draws the
        shape's U whatever its frame, so its tokens never depend on its batch."""
        generators = [r.generator for r in requests]
        tree = self.tree
        if tree is None or isinstance(tree, TreeShape):
            width = block.width - 1 if tree is None else tree.num_uniforms - 1
            counts = [d.num_proposed if tree is None else width if d.num_proposed else 0 for d in drafts]
            return round_uniforms(generators, counts, width)
        width = tree.num_uniforms - 1
        uniforms = round_uniforms(generators, [width if d.num_proposed else 0 for d in drafts], width)
        widths = (1,) * (block.width - 1) if block.frame is None else block.frame.widths
        return uniforms[:, [d * tree.branch + c for d, w in enumerate(widths) for c in range(w)] + [width]]

    def _target_probs(self, requests: Sequence[Request], drafts: Sequence[Draft],
                      logits: torch.Tensor) -> torch.Tensor:
        """Target probabilities per block row [B, W, V]; row 1 + i's penalty context ends with node i's path."""
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

    def _unpack(self, rows: list[list[int]], block: Block) -> tuple[VerifyResult, Paths]:
        """The verifier's packed rows on the host: a chain's [K+2] (`unpack_rows`), a tree's
        [depth + 2] then its accepted nodes [depth] (-1 after the last)."""
        if block.frame is None:
            result = unpack_rows(rows)
            return result, [list(range(a)) for a in result.num_accepted]
        width = block.frame.depth + 2
        result = unpack_rows([row[:width] for row in rows])
        return result, [[i for i in row[width:] if i >= 0] for row in rows]
