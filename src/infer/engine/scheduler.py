"""Scheduler: waiting and running queues, admission, chunked-prefill budgeting, preemption.

FIFO. Decode rows take one token each of `max_num_batched_tokens` first (a round's drafts ride beyond the budget),
prefill chunks the rest. Short of KV memory the newest running request is preempted; a request alone gets a smaller
round, down to a plain step. docs/architecture.md, "One engine step".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer.engine.kv_manager import KVManager
from infer.engine.parts import SchedulerConfig
from infer.engine.request import Request, RequestState


@dataclass(slots=True)
class ScheduleDecision:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    decode_room: list[int] = field(default_factory=list)  # positions reserved for each decode row's step
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it, freeing its memory."""
        if request in self.running:
            self.running.remove(request)
            self.kv.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def retire(self) -> list[Request]:
        """Take the finished requests out of the queues, freeing their memory (a request preempted
        with a token in flight may finish while waiting)."""
        done = [r for r in self.running if r.is_finished]
        for r in done:
            self.running.remove(r)
            self.kv.release(r)
        waited = [r for r in self.waiting if r.is_finished]
        for r in waited:
            self.waiting.remove(r)  # (its memory went at the preemption)
        return done + waited

    def admit(self) -> list[Request]:
        if self.config.batching_mode == "static" and self.running:
            return []  # a static batch runs to completion before the next one forms
        admitted = []
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            if not self.kv.can_admit(request):
                break
            self.waiting.popleft()
            self.kv.allocate(request)
            request.state = RequestState.RUNNING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def schedule(self) -> ScheduleDecision:
        """Admit, then split the running requests into decodes and prefill chunks (oldest first)."""
        self.admit()
        decision = ScheduleDecision()
        # (a request whose finish is decided but not rendered, or whose tokens in flight reach its limits, waits)
        decoding = [r for r in self.running if not r.in_prefill and r.can_decode(self.config.max_seq_len)]
        decision.decode, decision.decode_room, decision.preempted = self._reserve_decode(decoding)
        budget = self.config.max_num_batched_tokens - len(decision.decode)
        for request in self.running:
            if request.in_prefill and budget > 0:
                chunk = min(request.prefill_target - request.num_computed_tokens, budget)
                budget -= chunk
                decision.prefill.append((request, chunk))
        return decision

    def _reserve_decode(self, decoding: Sequence[Request]) -> tuple[list[Request], list[int], list[Request]]:
        """Room for each decoding request's step, oldest first -> (ready, their room, preempted).
        Short of memory the newest running request is preempted; alone, the largest step that fits."""
        ready: list[Request] = []
        room: dict[str, int] = {}
        preempted: list[Request] = []
        queue = list(decoding)
        widths_of = self.kv.decode_widths(len(decoding))
        while queue:
            request = queue.pop(0)
            widths = widths_of(request)
            while not self.kv.ensure_capacity(request, request.num_computed_tokens + widths[0]):
                if len(widths) > 1 and all(r is request for r in self.running):  # no one left to preempt
                    widths = widths[1:]
                    continue
                victim = self._newest_running(exclude=preempted)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                if victim in queue:
                    queue.remove(victim)
                if victim in ready:
                    ready.remove(victim)
            else:
                ready.append(request)
                room[request.request_id] = widths[0]
        return ready, [room[r.request_id] for r in ready], preempted

    def _newest_running(self, exclude: Sequence[Request]) -> Request:
        candidates = [r for r in self.running if r not in exclude]
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request)
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
