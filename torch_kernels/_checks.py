"""Input checks shared by every op: each error names the argument, what was expected and what came."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, value, *, ndim: int | None = None, dtypes=None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {value.dtype}")
    return value


def same_device(**tensors: torch.Tensor) -> None:
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} (as {first}), got {t.device}")


def size(name: str, dim: int, got: int, expected: int, what: str) -> None:
    if got != expected:
        raise ValueError(f"{name}: expected size {expected} in dimension {dim} ({what}), got {got}")


INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def int32_values(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    """``value`` (ids, lengths, rows) as a contiguous int32 tensor for a kernel. An int64 value
    outside int32's range is a ``ValueError`` naming ``name``: the cast would wrap it into another,
    valid-looking value (a padding row into row 0). Reads the values back only for int64 input."""
    if value is None:
        return None
    if value.dtype == torch.int64 and value.numel():
        low, high = torch.aminmax(value)
        if low.item() < INT32_MIN or high.item() > INT32_MAX:
            raise ValueError(f"{name}: expected values in int32's range [{INT32_MIN}, {INT32_MAX}], "
                             f"got {low.item()} .. {high.item()}")
    return value.to(torch.int32).contiguous()
