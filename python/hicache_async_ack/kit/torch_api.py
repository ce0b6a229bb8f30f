"""The slice of torch the collectives use, as Protocols: torch is imported only where a
collective runs (never by the protocol, never at plugin load), and what it returns is
typed here rather than ``Any``."""

from __future__ import annotations

import importlib
from typing import Optional, Protocol, Sequence, cast


class Tensor(Protocol):
    dtype: object

    def tolist(self) -> list[int]: ...

    def numpy(self) -> "Buffer": ...

    def dim(self) -> int: ...

    def numel(self) -> int: ...

    def copy_(self, other: "Tensor") -> "Tensor": ...

    def __getitem__(self, index: slice) -> "Tensor": ...


class Buffer(Protocol):
    """A tensor's numpy view: filled in place."""

    def __setitem__(self, index: slice, values: Sequence[int]) -> None: ...


class Work(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class ReduceOps(Protocol):
    MIN: object


class Dist(Protocol):
    """``torch.distributed``."""

    ReduceOp: ReduceOps

    def all_reduce(self, tensor: Tensor, op: object = ..., group: object = ...,
                   async_op: bool = ...) -> Optional[Work]: ...  # fmt: skip

    def get_world_size(self, group: object = ...) -> int: ...

    def get_rank(self, group: object = ...) -> int: ...

    def get_process_group_ranks(self, group: object) -> list[int]: ...

    def all_gather_object(self, out: list[object], obj: object, group: object = ...) -> None: ...


class Torch(Protocol):
    int64: object
    int32: object

    def zeros(self, n: int, dtype: object = ...) -> Tensor: ...

    def tensor(self, values: Sequence[int], dtype: object = ...) -> Tensor: ...

    def cat(self, tensors: Sequence[Tensor]) -> Tensor: ...


def torch() -> Torch:
    return cast(Torch, importlib.import_module("torch"))


def dist() -> Dist:
    return cast(Dist, importlib.import_module("torch.distributed"))


__all__ = ["Buffer", "Dist", "Tensor", "Torch", "Work", "dist", "torch"]
