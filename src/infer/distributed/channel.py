"""ControlChannel: the driver's messages to its worker ranks, over torch.distributed.

A message is pickled and broadcast from rank 0 on the gloo control group (a HEADER_BYTES broadcast, a second for a
longer message); CPU tensors travel as numpy arrays, tensors on the rank's device are broadcast after it on the
default group. The peers are trusted: the bytes are unpickled.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from infer.distributed.protocol import Message, WorkerReport

HEADER_BYTES = 4096
_LENGTH = 8  # bytes of the header that hold the message's length
# the dtypes a wire tensor may have, by name
WIRE_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.uint8, torch.bool,
                                                          torch.float32, torch.float64, torch.float16, torch.bfloat16)}


class _Encoder(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays; tensors of a `wire` device type become slots
    (index, shape, dtype) whose data is sent separately."""

    def __init__(self, file: io.BytesIO, wire_types: frozenset[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.wire_types = wire_types
        self.wire: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:  # noqa: ANN401 - pickle's hook
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.device.type in self.wire_types:
            if obj.dtype not in WIRE_DTYPES.values():
                raise ValueError(f"cannot send a {obj.dtype} tensor to the workers")
            self.wire.append(obj.contiguous())
            return _wire_tensor, (len(self.wire) - 1, tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
        if obj.device.type != "cpu":
            raise ValueError(f"cannot send a tensor on {obj.device} to the workers")
        if obj.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            return NotImplemented  # (numpy has no such dtypes: torch's own pickling)
        return torch.from_numpy, (obj.detach().numpy(),)


def _wire_tensor(index: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    raise RuntimeError("wire tensors are created by _Decoder")  # (a name _Decoder.find_class maps)


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file)
        self.device = device
        self.wire: list[torch.Tensor] = []

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401 - pickle's hook
        if module == __name__ and name == _wire_tensor.__name__:
            return self._make_wire
        return super().find_class(module, name)

    def _make_wire(self, index: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        if index != len(self.wire):
            raise ValueError(f"wire tensor {index} out of order")
        self.wire.append(torch.empty(shape, dtype=WIRE_DTYPES[dtype], device=self.device))
        return self.wire[-1]


def encode(obj: object, wire_types: frozenset[str]) -> tuple[bytes, list[torch.Tensor]]:
    """(pickled bytes, the tensors to send after them, in order)."""
    buf = io.BytesIO()
    encoder = _Encoder(buf, wire_types)
    encoder.dump(obj)
    return buf.getvalue(), encoder.wire


def decode(data: bytes, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """(the object, its wire tensors: empty, allocated on `device`, to be received into)."""
    decoder = _Decoder(io.BytesIO(data), device)
    return decoder.load(), decoder.wire


class ControlChannel:
    """Rank 0 sends, the other ranks receive, in the same order on every rank. `device`: where
    wire tensors are received; `before_send` runs before each message."""

    def __init__(self, control: dist.ProcessGroup, rank: int, device: torch.device,
                 before_send: Callable[[], None] | None = None) -> None:
        self.control, self.rank, self.device = control, rank, device
        self.wire_types = frozenset({device.type}) if device.type != "cpu" else frozenset()
        self.before_send = before_send
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self._header_np = self._header.numpy()  # (shares the tensor's memory)
        self.messages = self.bytes_sent = self.largest = 0  # sent (rank 0): count, bytes, the longest

    def send(self, message: Message) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends control messages")
        if self.before_send is not None:
            self.before_send()
        data, wire = encode(message, self.wire_types)
        n = len(data)
        first = min(n, HEADER_BYTES - _LENGTH)
        self._header_np[:_LENGTH] = np.frombuffer(n.to_bytes(_LENGTH, "little"), dtype=np.uint8)
        self._header_np[_LENGTH:_LENGTH + first] = np.frombuffer(data, dtype=np.uint8, count=first)
        dist.broadcast(self._header, src=0, group=self.control)
        if n > first:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), src=0, group=self.control)
        for tensor in wire:
            dist.broadcast(tensor, src=0)
        self.messages += 1
        self.bytes_sent += n
        self.largest = max(self.largest, n)

    def recv(self) -> Message:
        dist.broadcast(self._header, src=0, group=self.control)
        n = int.from_bytes(self._header_np[:_LENGTH].tobytes(), "little")
        first = min(n, HEADER_BYTES - _LENGTH)
        data = self._header_np[_LENGTH:_LENGTH + first].tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.control)
            data += rest.numpy().tobytes()
        message, wire = decode(data, self.device)
        for tensor in wire:
            dist.broadcast(tensor, src=0)
        if not isinstance(message, Message):
            raise TypeError(f"expected a control Message, got {type(message).__name__}")
        return message

    def gather_reports(self, report: WorkerReport | None) -> list[WorkerReport]:
        """Every worker's report at rank 0 (the driver passes None); [] on the workers."""
        out: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(report, out, dst=0, group=self.control)
        return [r for r in out or [] if isinstance(r, WorkerReport)]
