"""``torch_kernels::reshape_and_cache`` and ``torch_kernels::ragged_paged_attention``.

vLLM's flash layout: caches ``[num_blocks, block_size, Hkv, D]``, a slot is
``block * block_size + offset``, sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``
and reads its pages through ``block_table[s]``. Both ops are inference-only and mutate the caches
in place (declared in their schemas, so torch.compile functionalizes them).

The caches may be any views whose last dimension is contiguous and whose entries do not share
memory (``is_cache_layout``): the halves of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]``
tensor permuted to this shape, in any physical order, slices of a larger buffer. Every backend
reads and writes them in place and writes nothing but the written slots' entries.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Sequence

import torch

from .. import _checks, backends
from .._library import define, register_cost, tensor_bytes
from .._memo import LastBatch
from ..families import Case
from ..reference import paged_attention as reference

__all__ = ["reshape_and_cache", "ragged_paged_attention"]

WRITE_OP = "reshape_and_cache"
OP = "ragged_paged_attention"
OUT_OP = "ragged_paged_attention_out"  # OP writing into a given buffer; it runs OP's backends

backends.register(WRITE_OP, "reference", reference.reshape_and_cache)
backends.register(WRITE_OP, "triton", "triton_impl.paged_attention:reshape_and_cache")
backends.register(WRITE_OP, "pallas", "torch_kernels.pallas.paged_attention:pallas_reshape_and_cache")
backends.register(WRITE_OP, "sycl", "oneapi_impl.paged_attention:reshape_and_cache")
backends.register(OP, "reference", reference.ragged_paged_attention)
backends.register(OP, "triton", "triton_impl.paged_attention:ragged_paged_attention")
backends.register(OP, "pallas", "torch_kernels.pallas.paged_attention:pallas_ragged_paged_attention")
backends.register(OP, "sycl", "oneapi_impl.paged_attention:ragged_paged_attention")
# the deferred value checks of a batch's lengths and block table in one launch
BATCH_CHECK = "paged_attention.check_batch"
backends.register(BATCH_CHECK, "triton", "triton_impl.paged_attention:check_batch")

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPE = torch.int32
# int64 as vLLM passes it; int32 as it arrives through torchax (jax without x64). Kernels get int64.
SLOT_DTYPES = (torch.int64, torch.int32)
FLOAT32_MAX = torch.finfo(torch.float32).max


def is_cache_layout(cache: torch.Tensor) -> bool:
    """Whether the kernels can read and write ``cache`` in place: its last dimension has stride 1
    and its other strides are any that keep distinct entries apart in memory (a view of a larger
    tensor, such as one half of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache, permuted).
    Overlap is judged by ``reference.entries_apart``, a sufficient test every slice and permutation
    of a tensor passes."""
    return (cache.shape[-1] == 1 or cache.stride(-1) == 1) and reference.entries_apart(cache)


def _check_cache_pair(key_cache, value_cache, query_dtype) -> None:
    _checks.tensor("key_cache", key_cache, ndim=4)
    _checks.tensor("value_cache", value_cache, ndim=4)
    allowed = (query_dtype, *reference.QUANTIZED_DTYPES)
    _checks.tensor("key_cache", key_cache, dtypes=allowed)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: expected dtype {key_cache.dtype} (as key_cache), got {value_cache.dtype}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: expected shape {tuple(key_cache.shape)} (as key_cache), "
                         f"got {tuple(value_cache.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not is_cache_layout(cache):  # a copy would lose the write
            raise ValueError(f"{name}: expected a stride-1 last dimension and no two entries sharing memory (it is "
                             f"written in place), got strides {cache.stride()} for shape {tuple(cache.shape)}")
    if min(key_cache.shape) == 0:
        raise ValueError(f"key_cache: expected no empty dimension, got shape {tuple(key_cache.shape)}")


def _check_scale(name: str, scale, num_kv_heads: int) -> None:
    if scale is None:
        return
    _checks.tensor(name, scale, dtypes=(torch.float32,))
    if scale.numel() not in (1, num_kv_heads) or scale.dim() > 1:
        raise ValueError(f"{name}: expected one float32 scale or one per kv head ([{num_kv_heads}]), "
                         f"got shape {tuple(scale.shape)}")


def _check_new_tokens(key, value, slot_mapping, num_tokens, key_cache, dtypes) -> None:
    _checks.tensor("key", key, ndim=3, dtypes=dtypes)
    _checks.tensor("value", value, ndim=3, dtypes=(key.dtype,))
    _checks.tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES)
    _, _, num_kv_heads, head_size = key_cache.shape
    expected = (num_tokens, num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} (tokens, key_cache's kv heads and head size), "
                             f"got {tuple(t.shape)}")
    _checks.size("slot_mapping", 0, slot_mapping.shape[0], num_tokens, "tokens")


@_checks.remembers_layouts
def check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Shapes, dtypes and devices of a ``reshape_and_cache`` call (no data read)."""
    _checks.tensor("key", key, ndim=3, dtypes=QUERY_DTYPES)
    _check_cache_pair(key_cache, value_cache, key.dtype)
    _check_new_tokens(key, value, slot_mapping, key.shape[0], key_cache, QUERY_DTYPES)
    _check_scale("k_scale", k_scale, key_cache.shape[2])
    _check_scale("v_scale", v_scale, key_cache.shape[2])
    _checks.same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                        slot_mapping=slot_mapping, **_present(k_scale=k_scale, v_scale=v_scale))


def _present(**tensors):
    return {name: t for name, t in tensors.items() if t is not None}


@_checks.remembers_layouts
def check_inputs(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                 sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None, value=None,
                 slot_mapping=None) -> None:
    """Shapes, dtypes, devices and scalars of a ``ragged_paged_attention`` call (no data read)."""
    _checks.tensor("query", query, ndim=3, dtypes=QUERY_DTYPES)
    _check_cache_pair(key_cache, value_cache, query.dtype)
    num_tokens, num_q_heads, head_size = query.shape
    _, _, num_kv_heads, cache_head_size = key_cache.shape
    _checks.size("key_cache", 3, cache_head_size, head_size, "head size D of query")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: expected a number of heads divisible by key_cache's {num_kv_heads} kv heads, "
                         f"got {num_q_heads}")
    _checks.tensor("cu_q_lens", cu_q_lens, ndim=1, dtypes=(INDEX_DTYPE,))
    _checks.tensor("kv_lens", kv_lens, ndim=1, dtypes=(INDEX_DTYPE,))
    _checks.tensor("block_table", block_table, ndim=2, dtypes=(INDEX_DTYPE,))
    num_seqs = kv_lens.shape[0]
    _checks.size("cu_q_lens", 0, cu_q_lens.shape[0], num_seqs + 1, "sequences S of kv_lens, plus one")
    _checks.size("block_table", 0, block_table.shape[0], num_seqs, "sequences S of kv_lens")
    check_scalars(sm_scale, sliding_window, soft_cap)
    _check_scale("k_scale", k_scale, num_kv_heads)
    _check_scale("v_scale", v_scale, num_kv_heads)
    given = [t is not None for t in (key, value, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError("key, value, slot_mapping: expected all three (to write new tokens first) or none, "
                         f"got key={'given' if given[0] else None}, value={'given' if given[1] else None}, "
                         f"slot_mapping={'given' if given[2] else None}")
    if key is not None:
        _check_new_tokens(key, value, slot_mapping, num_tokens, key_cache, (query.dtype,))
    _checks.same_device(query=query, key_cache=key_cache, value_cache=value_cache, cu_q_lens=cu_q_lens,
                        kv_lens=kv_lens, block_table=block_table,
                        **_present(k_scale=k_scale, v_scale=v_scale, key=key, value=value, slot_mapping=slot_mapping))


def _is_real(x) -> bool:
    kind = type(x)  # float and int first: an ABC's isinstance costs microseconds
    return kind is float or kind is int or (isinstance(x, numbers.Real) and kind is not bool)


def check_scalars(sm_scale, sliding_window=None, soft_cap=None) -> None:
    """Types first (``TypeError``), then values (``ValueError``); kernels compute in float32."""
    if not _is_real(sm_scale):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__} {sm_scale!r}")
    if sliding_window is not None and not (isinstance(sliding_window, numbers.Integral)
                                           and not isinstance(sliding_window, bool)):
        raise TypeError(f"sliding_window: expected None or an int, got {type(sliding_window).__name__} "
                        f"{sliding_window!r}")
    if soft_cap is not None and not _is_real(soft_cap):
        raise TypeError(f"soft_cap: expected None or a float, got {type(soft_cap).__name__} {soft_cap!r}")
    if not (math.isfinite(sm_scale) and 0 < sm_scale <= FLOAT32_MAX):
        raise ValueError(f"sm_scale: expected a finite number > 0 (float32: at most {FLOAT32_MAX:.4g}), got {sm_scale!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and not (math.isfinite(soft_cap) and 0 < soft_cap <= FLOAT32_MAX):
        raise ValueError(f"soft_cap: expected None or a finite number > 0 (float32: at most {FLOAT32_MAX:.4g}), "
                         f"got {soft_cap!r}")


def scale_checks(checks: _checks.ValueChecks, **scales) -> dict[str, torch.Tensor | None]:
    """Each given scale finite and > 0 (a cache entry means entry * scale); returns the scales, in
    deferred mode with a bad entry made NaN (so the rows it touches follow the NaN policy): one
    launch each where the planned backend has the shared check (``_checks.SCALES_CHECK``)."""
    safe = {}
    for name, scale in scales.items():
        if scale is not None:
            message = _scale_message(name)
            if (device_check := checks.device_check(_checks.SCALES_CHECK, (message,))) is not None:
                scale = device_check(scale)
            else:
                bad = ~(torch.isfinite(scale) & (scale > 0))
                checks.add(bad, message,
                           lambda scale=scale, bad=bad: f"got {scale.reshape(-1)[bad.reshape(-1)][0].item()}")
                if checks.deferred:
                    scale = torch.where(bad, torch.nan, scale)
        safe[name] = scale
    return safe


@functools.lru_cache(maxsize=16)
def _scale_message(name: str) -> str:
    return f"{name}: expected finite scales > 0 (a cache entry means entry * scale)"


def _first_bad(values, bad) -> str:
    index = int(bad.nonzero()[0, 0])
    return f"{int(values[index])} at index {index}"


@functools.lru_cache(maxsize=1024)  # a server's batches take a few shapes: formatted once each
def _lengths_messages(num_tokens: int, num_blocks: int, block_size: int, max_blocks: int) -> tuple[str, ...]:
    """check_lengths's messages, in the order its device checks count them."""
    return ("cu_q_lens: expected to start at 0",
            "cu_q_lens: expected non-decreasing offsets",
            f"cu_q_lens: expected to end at the number of query tokens {num_tokens}",
            "kv_lens: expected lengths >= 0",
            "kv_lens: expected each sequence's kv length to count its new query tokens too",
            f"kv_lens: expected at most {max_blocks * block_size} tokens (block_table's {max_blocks} pages of "
            f"{block_size})",
            f"block_table: expected block ids in [0, {num_blocks}) for the pages a sequence uses")


@functools.lru_cache(maxsize=64)
def _slots_messages(capacity: int) -> tuple[str, ...]:
    """check_slots's messages, in the order its device checks count them."""
    return (f"slot_mapping: expected -1 (padding) or a slot in [0, {capacity}) (num_blocks * block_size)",
            "slot_mapping: expected each slot at most once")


def check_slots(slot_mapping, key_cache, checks: _checks.ValueChecks | None = None) -> torch.Tensor:
    """Every slot is -1 (padding) or inside the cache, and no two tokens share one. Returns the
    slots to write: in deferred mode an out-of-range slot becomes -1 (skipped), in one launch where
    the planned backend has the shared index check (``_checks.INDICES_CHECK``). Without ``checks``,
    checks fully now."""
    own = checks is None
    checks = checks or _checks.ValueChecks(slot_mapping.device, "full")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    messages = _slots_messages(capacity)
    if (device_check := checks.device_check(_checks.INDICES_CHECK, messages)) is not None:
        return device_check(slot_mapping, capacity, only_minus_one_pads=True, with_bad=False)[0]
    out_of_range = (slot_mapping < -1) | (slot_mapping >= capacity)
    ordered = torch.where(slot_mapping >= 0, slot_mapping, -1).sort().values
    shared = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    checks.add(out_of_range, messages[0], lambda: f"got {_first_bad(slot_mapping, out_of_range)}")
    checks.add(shared, messages[1],  # a duplicate stays in bounds: not made safe
               lambda: f"got slot {int(ordered[1:][shared][0])} twice")
    if own:
        checks.finish()
    if checks.deferred:
        return torch.where(out_of_range, -1, slot_mapping)
    return slot_mapping


def check_lengths(query, key_cache, cu_q_lens, kv_lens, block_table,
                  checks: _checks.ValueChecks | None = None) -> tuple[torch.Tensor, ...]:
    """Lengths add up, every query row has its key, and every page read is inside the cache.

    Returns ``(cu_q_lens, kv_lens, block_table, bad_rows)`` for the kernels: as given in full mode
    (``bad_rows`` None); in deferred mode made safe: a sequence with a bad length or page id attends
    to its own new rows over page 0 (the block table widened if its rows could not hold them), and
    ``bad_rows`` ``[T]`` marks the query rows whose output must be NaN (the backends' ``bad_rows``);
    every row belongs to some sequence (where the planned backend has its own one-launch check,
    ``BATCH_CHECK``, the same but that bad offsets give every row to sequence 0: all rows NaN
    either way). Without ``checks``, checks fully now."""
    own = checks is None
    checks = checks or _checks.ValueChecks(cu_q_lens.device, "full")
    num_tokens = query.shape[0]
    num_blocks, block_size = key_cache.shape[:2]
    num_seqs, max_blocks = block_table.shape
    messages = _lengths_messages(num_tokens, num_blocks, block_size, max_blocks)
    if (device_check := checks.device_check(BATCH_CHECK, messages)) is not None:
        return device_check(cu_q_lens, kv_lens, block_table, num_tokens, num_blocks, block_size)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pages = (kv_lens.long() + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=block_table.device) < pages[:, None]
    bad_entry = (block_table < 0) | (block_table >= num_blocks)
    bad_block = used & bad_entry
    # each mask made once: the deferred mode's safe inputs below reuse them
    decreasing, negative, short, too_long = q_lens < 0, kv_lens < 0, q_lens > kv_lens, pages > max_blocks
    starts_off = checks.add(cu_q_lens[0] != 0, messages[0], lambda: f"got {int(cu_q_lens[0])}")
    decreases = checks.add(decreasing, messages[1], lambda: f"got a decrease at {_first_bad(cu_q_lens[1:], decreasing)}")
    ends_off = checks.add(cu_q_lens[-1] != num_tokens, messages[2], lambda: f"got {int(cu_q_lens[-1])}")
    checks.add(negative, messages[3], lambda: f"got {_first_bad(kv_lens, negative)}")
    checks.add(short, messages[4], lambda: f"got kv length {_first_bad(kv_lens, short)} below its query length "
                                           f"{int(q_lens[short.nonzero()[0, 0]])}")
    checks.add(too_long, messages[5], lambda: f"got {_first_bad(kv_lens, too_long)}")
    checks.add(bad_block, messages[6],
               lambda: f"got {int(block_table[bad_block][0])} for sequence {int(bad_block.nonzero()[0, 0])}")
    if own:
        checks.finish()
    if not checks.deferred:
        return cu_q_lens, kv_lens, block_table, None
    # any bad offset makes every sequence bad: their rows cannot be told apart
    offsets_bad = starts_off | ends_off | decreases
    safe_cu = _checks.safe_offsets(cu_q_lens, num_tokens)
    safe_q = safe_cu[1:] - safe_cu[:-1]
    seq_bad = offsets_bad | negative | short | too_long | bad_block.any(1)
    safe_kv = torch.where(seq_bad, safe_q, kv_lens)
    safe_table = torch.where(seq_bad[:, None] | bad_entry, 0, block_table)
    width = max(max_blocks, -(-num_tokens // block_size))  # pages enough for a bad sequence's own rows
    if width > max_blocks:
        safe_table = torch.nn.functional.pad(safe_table, (0, width - max_blocks))
    rows = torch.arange(num_tokens, device=cu_q_lens.device, dtype=safe_cu.dtype)
    seq = torch.searchsorted(safe_cu[1:], rows, right=True)
    if num_seqs == 0:
        bad_rows = torch.ones(num_tokens, dtype=torch.bool, device=cu_q_lens.device)
    else:
        bad_rows = (seq >= num_seqs) | seq_bad[seq.clamp(max=num_seqs - 1)]
    return safe_cu, safe_kv.to(kv_lens.dtype), safe_table, bad_rows


nan_rows = reference.nan_rows


# full-mode checks skipped for a batch equal to the last that passed (a model's layers repeat one
# batch description per step); on the CPU, where reading tensors on the host is free
_lengths_passed, _slots_passed = LastBatch(), LastBatch()


def _memo_key_lengths(query, key_cache, cu_q_lens, kv_lens, block_table):
    return (query.shape[0], *key_cache.shape[:2]), (cu_q_lens, kv_lens, block_table)


def _checked_lengths(checks, query, key_cache, cu_q_lens, kv_lens, block_table):
    """check_lengths, skipped in full mode on the CPU for the batch that passed last."""
    memo = not checks.deferred and cu_q_lens.is_cpu
    if memo:
        scalars, tensors = _memo_key_lengths(query, key_cache, cu_q_lens, kv_lens, block_table)
        if _lengths_passed.get(scalars, *tensors):
            return cu_q_lens, kv_lens, block_table, None
    checked = check_lengths(query, key_cache, cu_q_lens, kv_lens, block_table, checks)
    if memo:
        checks.finish()  # raises now if it fails, so only a batch that passed is remembered
        _lengths_passed.put(True, scalars, *tensors)
    return checked


def _checked_slots(checks, slot_mapping, key_cache):
    """check_slots, skipped in full mode on the CPU for the slots that passed last."""
    memo = not checks.deferred and slot_mapping.is_cpu
    scalars = (key_cache.shape[0] * key_cache.shape[1],)
    if memo and _slots_passed.get(scalars, slot_mapping):
        return slot_mapping
    slots = check_slots(slot_mapping, key_cache, checks)
    if memo:
        checks.finish()
        _slots_passed.put(True, scalars, slot_mapping)
    return slots


_ones: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scales(scale, num_kv_heads: int, device) -> torch.Tensor:
    """The kernels' form of a scale: float32 ``[Hkv]`` (ones for None)."""
    if scale is None:
        ones = _ones.get((device, num_kv_heads))
        if ones is None:
            ones = torch.ones(num_kv_heads, device=device)
            if not _checks.capturing(device):  # inside a capture its fill only runs on replay
                _ones[(device, num_kv_heads)] = ones
        return ones
    return scale.reshape(-1).expand(num_kv_heads).contiguous()


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _write_kernel(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, implementation=None):
    check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    checks = _checks.ValueChecks(key.device, backend=backends.planned(WRITE_OP, _device_type(key), implementation))
    slot_mapping = _checked_slots(checks, slot_mapping, key_cache)
    scales = scale_checks(checks, k_scale=k_scale, v_scale=v_scale)
    checks.finish()
    heads, device = key_cache.shape[2], key.device
    backends.dispatch(WRITE_OP, _device_type(key), implementation, key.contiguous(), value.contiguous(),
                      key_cache, value_cache, slot_mapping.to(torch.int64).contiguous(),
                      _scales(scales["k_scale"], heads, device), _scales(scales["v_scale"], heads, device))


def _write_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, implementation=None):
    check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


reshape_and_cache_op = define(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None, str? implementation=None) -> ()",
    _write_kernel,
    _write_fake,
)


def check_out(out, query) -> None:
    """``out`` receives the attention output in place: a tensor of query's shape, dtype and device
    whose entries do not share memory (no data read)."""
    _checks.tensor("out", out)
    if out.dtype != query.dtype:
        raise TypeError(f"out: expected dtype {query.dtype} (as query), got {out.dtype}")
    if out.shape != query.shape:
        raise ValueError(f"out: expected shape {tuple(query.shape)} (as query), got {tuple(out.shape)}")
    _checks.same_device(query=query, out=out)
    _checks.written_in_place("out", out)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, past the last)`` a tensor's entries span."""
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check_out_apart(out, **inputs) -> None:
    """``out`` shares no memory with an input: the kernels read those while writing it."""
    if not out.numel():
        return
    start, end = _extent(out)
    for name, t in inputs.items():
        if t is not None and t.numel() and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            first, past = _extent(t)
            if first < end and start < past:
                raise ValueError(f"out: expected memory apart from {name}'s (the kernels read {name} while writing "
                                 "out)")


def _attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window, soft_cap,
               k_scale, v_scale, key, value, slot_mapping, implementation, out):
    """Both ops' kernel: checks, then the backend, whose result goes to ``out`` where given (a
    contiguous ``out`` is offered to the backend, which may write it itself, as the Triton and
    reference kernels do; else the result is copied into it here)."""
    check_inputs(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                 soft_cap, k_scale, v_scale, key, value, slot_mapping)
    if out is not None:
        check_out(out, query)
        _check_out_apart(out, query=query, key_cache=key_cache, value_cache=value_cache, key=key, value=value)
    kind = _device_type(query)
    checks = _checks.ValueChecks(query.device, backend=backends.planned(OP, kind, implementation))
    cu_q_lens, kv_lens, block_table, bad_rows = _checked_lengths(checks, query, key_cache, cu_q_lens, kv_lens,
                                                                 block_table)
    if key is not None:
        slot_mapping = _checked_slots(checks, slot_mapping, key_cache)
    scales = scale_checks(checks, k_scale=k_scale, v_scale=v_scale)
    checks.finish()
    heads, device = key_cache.shape[2], query.device
    k_scale, v_scale = _scales(scales["k_scale"], heads, device), _scales(scales["v_scale"], heads, device)
    if key is not None:
        if slot_mapping.dtype != torch.int64:
            slot_mapping = slot_mapping.to(torch.int64)
        key, value, slot_mapping = key.contiguous(), value.contiguous(), slot_mapping.contiguous()
        if checks.deferred:  # written first: deciding whether the attention may write it reads the block table
            backends.dispatch(WRITE_OP, kind, implementation, key, value, key_cache, value_cache, slot_mapping,
                              k_scale, v_scale)
            key = value = slot_mapping = None
    optional = {} if out is None or not out.is_contiguous() else {"out": out}
    if bad_rows is not None:  # the backend makes them NaN (Triton's kernel does, sparing a launch)
        optional["bad_rows"] = bad_rows
    result = backends.dispatch(
        OP, kind, implementation, query.contiguous(), key_cache, value_cache,
        # a window past every int32 length is no window; kernels index positions in int32
        cu_q_lens.contiguous(), kv_lens.contiguous(), block_table.contiguous(), float(sm_scale),
        None if sliding_window is None or sliding_window >= 2**31 - 1 else sliding_window,
        None if soft_cap is None else float(soft_cap), k_scale, v_scale, key, value, slot_mapping, **optional,
    )
    if out is not None and result is not out:
        out.copy_(result)
        result = out
    return result


def _attention_kernel(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                      sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None, value=None,
                      slot_mapping=None, implementation=None):
    return _attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                      soft_cap, k_scale, v_scale, key, value, slot_mapping, implementation, None)


def _attention_out_kernel(out, query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                          sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None, value=None,
                          slot_mapping=None, implementation=None):
    _attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window, soft_cap,
               k_scale, v_scale, key, value, slot_mapping, implementation, out)


def _attention_fake(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None, value=None,
                    slot_mapping=None, implementation=None):
    check_inputs(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                 soft_cap, k_scale, v_scale, key, value, slot_mapping)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


_ATTENTION_ARGUMENTS = (
    "Tensor query, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor cu_q_lens, "
    "Tensor kv_lens, Tensor block_table, float sm_scale, int? sliding_window=None, float? soft_cap=None, "
    "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? key=None, Tensor? value=None, "
    "Tensor? slot_mapping=None, str? implementation=None")
ragged_paged_attention_op = define(f"ragged_paged_attention({_ATTENTION_ARGUMENTS}) -> Tensor",
                                   _attention_kernel, _attention_fake)


def _attention_out_fake(out, query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                        sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None, value=None,
                        slot_mapping=None, implementation=None):
    _attention_fake(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                    soft_cap, k_scale, v_scale, key, value, slot_mapping)
    check_out(out, query)


# the same attention written into a given buffer (vLLM's output), its first argument: the op mutates
# ``out`` and returns nothing, as a custom op may not return an alias of its input
ragged_paged_attention_out_op = define(f"{OUT_OP}(Tensor(c!) out, {_ATTENTION_ARGUMENTS}) -> ()",
                                       _attention_out_kernel, _attention_out_fake)


def visible_keys(q_lens: Sequence[int], kv_lens: Sequence[int], sliding_window: int | None = None) -> int:
    """How many (query, key) pairs a batch attends over, summed over its sequences."""
    total = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        first = kv_len - q_len  # position of the first new query
        if sliding_window is None:  # position p sees p + 1 keys
            total += q_len * (first + 1) + q_len * (q_len - 1) // 2
        else:
            total += sum(min(p + 1, sliding_window) for p in range(first, kv_len))
    return total


def attention_flops(num_q_heads: int, head_size: int, q_lens, kv_lens, sliding_window=None) -> int:
    """QK^T and PV over the visible pairs: 4 * Hq * D per pair."""
    return 4 * num_q_heads * head_size * visible_keys(q_lens, kv_lens, sliding_window)


def attention_bytes(num_q_heads: int, num_kv_heads: int, head_size: int, q_lens, kv_lens,
                    query_itemsize: int, cache_itemsize: int, sliding_window=None) -> int:
    """What a call must move at least: each sequence's visible keys and values once (the cache rows
    any of its queries sees, not whole pages), queries in, output out. Page tables and lengths, a
    few bytes per page, are left out."""
    keys = sum(kv if sliding_window is None else min(kv, sliding_window + q - 1) for q, kv in zip(q_lens, kv_lens))
    num_tokens = sum(q_lens)
    return 2 * keys * num_kv_heads * head_size * cache_itemsize + 2 * num_tokens * num_q_heads * head_size * query_itemsize


def _lengths(a) -> tuple[list[int], list[int]]:
    """Each sequence's query and kv lengths, read on the host."""
    cu = a.cu_q_lens.tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])], a.kv_lens.tolist()


def _write_bytes(key, value, key_cache, slot_mapping, k_scale, v_scale) -> int:
    """Writing new tokens to the caches: the real (slot >= 0) rows of key and value read, the
    slots and scales read, the same rows written to both caches."""
    rows = int((slot_mapping >= 0).sum())
    row_elements = key.shape[1] * key.shape[2]
    return (rows * row_elements * (key.element_size() + value.element_size() + 2 * key_cache.element_size())
            + tensor_bytes(slot_mapping, k_scale, v_scale))


def _attention_cost_bytes(a, out) -> int:
    q_lens, kv_lens = _lengths(a)
    cache = attention_bytes(a.query.shape[1], a.key_cache.shape[2], a.query.shape[2], q_lens, kv_lens,
                            a.query.element_size(), a.key_cache.element_size(), a.sliding_window)
    scales = tensor_bytes(a.k_scale, a.v_scale)
    if a.key is None:
        return cache + scales
    return cache + _write_bytes(a.key, a.value, a.key_cache, a.slot_mapping, a.k_scale, a.v_scale)


for _op in (ragged_paged_attention_op, ragged_paged_attention_out_op):
    register_cost(_op, bytes=_attention_cost_bytes,
                  flops=lambda a, out: attention_flops(a.query.shape[1], a.query.shape[2], *_lengths(a),
                                                       a.sliding_window))
register_cost(reshape_and_cache_op, flops=lambda a, out: 0,  # a copy
              bytes=lambda a, out: _write_bytes(a.key, a.value, a.key_cache, a.slot_mapping, a.k_scale, a.v_scale))


def check_tensors(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    implementation: str | Sequence[str] | None = None,
) -> None:
    """Write new tokens' keys and values into a paged KV cache, in place.

    Token ``t`` goes to slot ``slot_mapping[t]`` = ``block * block_size + offset``, i.e. to
    ``key_cache[block, offset]``; slot ``-1`` marks a padding token, which is skipped. No other
    cache entry changes.

    Args:
        key, value: ``[T, Hkv, D]``, float16, bfloat16 or float32.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` of key's dtype or a quantized
            dtype (``int8``, ``float8_e4m3fn``, ``float8_e5m2``); any strides whose last is 1 and
            that keep entries apart (views of one larger tensor too: ``is_cache_layout``).
        slot_mapping: int64 (or int32) ``[T]``; each slot at most once (deferred checks skip a slot
            out of range and leave a repeated one to one of its tokens).
        k_scale, v_scale: optional float32 scales, finite and > 0, one (``[]`` or ``[1]``) or one
            per kv head (``[Hkv]``); the cache stores ``key / k_scale`` rounded to its dtype (int8
            rounds half to even and saturates, fp8 saturates). ``None`` means 1. NaN is stored
            as NaN (as 0 in int8 caches); inf and out-of-range values saturate in fp8 and int8
            caches; float caches round as their dtype does (overflow is inf).
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).
    """
    check_tensors(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
    reshape_and_cache_op(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                         backends.implementation_arg(implementation))


def ragged_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    implementation: str | Sequence[str] | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a ragged batch of sequences whose keys and values live in pages.

    Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``; they are its last positions,
    and ``kv_lens[s]`` counts all its tokens, the new ones included. So one batch mixes decode
    (one query), chunked prefill and whole prompts. A query at position ``p`` attends to key
    positions ``j <= p`` (and ``j > p - sliding_window`` with a window), read from pages
    ``block_table[s, j // block_size]`` at offset ``j % block_size``.

    Args:
        query: ``[T, Hq, D]``, float16, bfloat16 or float32; ``Hq`` a multiple of ``Hkv``
            (grouped-query and multi-query attention).
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` of query's dtype or quantized
            (``int8``, ``float8_e4m3fn``, ``float8_e5m2``; see ``k_scale``); any strides whose last
            is 1 and that keep entries apart (views of one larger tensor too: ``is_cache_layout``).
        cu_q_lens: int32 ``[S+1]``, query offsets, from 0 to ``T``.
        kv_lens: int32 ``[S]``, each at least its query length.
        block_table: int32 ``[S, max_blocks]``; entries past a sequence's last page are not read.
        sm_scale: multiplies the logits (usually ``D ** -0.5``).
        sliding_window: if given, each query sees its last ``sliding_window`` positions.
        soft_cap: if given, logits become ``soft_cap * tanh(logits / soft_cap)`` (after ``sm_scale``).
        k_scale, v_scale: float32 dequantization scales, finite and > 0, one or one per kv head;
            a cache entry means ``entry * scale``. ``None`` means 1.
        key, value, slot_mapping: if given (``[T, Hkv, D]`` of query's dtype and int64 or int32 ``[T]``),
            the new tokens are first written as :func:`reshape_and_cache` does, in the same kernel
            where the backend allows it; the result equals that write followed by attention.
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).
        out: if given, ``[T, Hq, D]`` of query's dtype and device, sharing no memory with the inputs:
            the output is written into it (by the Triton and reference kernels directly where it is
            contiguous, else copied) and it is returned. The op is
            ``torch.ops.torch_kernels.ragged_paged_attention_out(out, query, ...)``: it mutates ``out``
            and returns nothing, as a serving engine's preallocated output needs.

    Returns:
        ``[T, Hq, D]`` in query's dtype (``out`` where given). Softmax and accumulation are float32 on
        every backend.

    NaN and inf: cache entries a query does not attend to are never read (its output equals the
    output with them zero); a NaN or inf in its query row of head ``h`` or in an attended key or
    value entry of kv head ``h // G`` makes its output row for head ``h`` all NaN, and no other
    row changes. The write stores NaN as :func:`reshape_and_cache` does.

    Inputs are checked (lengths, page ids, slots) before any kernel runs, in the call's check mode
    (``torch_kernels.checks``): ``full`` reads the small index tensors once on the host and raises;
    ``deferred`` reads nothing, records what fails for ``torch_kernels.raise_deferred_errors()``,
    gives a sequence with a bad length or page id NaN rows and skips a bad slot (the write then
    runs before the attention rather than inside it). Inference only: it has no backward.
    """
    check_tensors(query=query, key_cache=key_cache, value_cache=value_cache, cu_q_lens=cu_q_lens,
                   kv_lens=kv_lens, block_table=block_table, k_scale=k_scale, v_scale=v_scale,
                   key=key, value=value, slot_mapping=slot_mapping)
    check_scalars(sm_scale, sliding_window, soft_cap)  # before the dispatcher parses them less clearly
    args = (query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, float(sm_scale),
            None if sliding_window is None else int(sliding_window), None if soft_cap is None else float(soft_cap),
            k_scale, v_scale, key, value, slot_mapping, backends.implementation_arg(implementation))
    if out is None:
        return ragged_paged_attention_op(*args)
    check_tensors(out=out)
    ragged_paged_attention_out_op(out, *args)
    return out


# ---- self-test cases ----

def paged_attention_inputs(gen, dtype, device, q_lens=(1, 7, 1, 19), contexts=(40, 0, 70, 13),
                           heads=(8, 2), head_size=64, block_size=16):
    """A ragged batch (decodes, a fresh prompt, a chunk of a prompt) over shuffled pages."""
    num_q_heads, num_kv_heads = heads
    kv_lens = torch.tensor(q_lens) + torch.tensor(contexts)
    pages = -(-kv_lens // block_size)
    num_blocks = int(pages.sum()) + 3
    block_table = torch.zeros(len(q_lens), int(pages.max()), dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    start = 0
    for s, n in enumerate(pages.tolist()):
        block_table[s, :n] = ids[start:start + n]
        start += n
    cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q_lens[1:] = torch.tensor(q_lens).cumsum(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    query = torch.randn(int(cu_q_lens[-1]), num_q_heads, head_size, generator=gen).to(device, dtype)
    return (query, key_cache, value_cache, cu_q_lens.to(device), kv_lens.to(device, torch.int32),
            block_table.to(device), head_size**-0.5)


def reshape_and_cache_inputs(gen, dtype, device, tokens=23, heads=2, head_size=64, block_size=16, num_blocks=5):
    """New keys and values, random caches to write them into, distinct slots (one of them -1, padding)."""
    key, value = (torch.randn(tokens, heads, head_size, generator=gen) for _ in range(2))
    cache_shape = (num_blocks, block_size, heads, head_size)
    key_cache, value_cache = (torch.randn(cache_shape, generator=gen) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1
    return (key.to(device, dtype), value.to(device, dtype), key_cache.to(device, dtype), value_cache.to(device, dtype),
            slots.to(device))


def _attention_definition(*inputs):
    return reference.ragged_paged_attention_naive(*inputs).float()


def selftest_cases() -> list[Case]:
    """The doctor's check of the attention against the readable reference (the cache write is
    checked by the tests)."""
    return [Case(OP, paged_attention_inputs, ragged_paged_attention, _attention_definition)]
