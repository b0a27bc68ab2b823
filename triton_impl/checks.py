"""Deferred value checks that several families share, each one launch with no host read.

An op's deferred check mode (``torch_kernels.checks``) records a failed check in a device's
error word (int32 counts, one entry per message) and hands the kernels safe inputs. These kernels
do that for a family's index and offset arguments in a single program each (the arguments are a
few bytes a sequence or token, so one program reads them in microseconds), where the same checks
as torch ops take ten or more launches. ``codes`` (int64) gives each check's entry of the word, in
the order the launcher's docstring lists; the messages are the caller's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import for_device

INT32_MIN = tl.constexpr(-(2 ** 31))
INT32_MAX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def record(word_ptr, codes_ptr, index: tl.constexpr, failed):
    """Count one failed check (``failed``: nonzero when it failed) in the error word."""
    if failed != 0:
        tl.atomic_add(word_ptr + tl.load(codes_ptr + index), 1)


@triton.jit
def check_indices_kernel(index_ptr, owner_ptr, codes_ptr, word_ptr, safe_ptr, bad_ptr, count, limit,
                         ONLY_MINUS_ONE_PADS: tl.constexpr, HAS_BAD: tl.constexpr, WIDE: tl.constexpr,
                         UNIQUE: tl.constexpr, TILE: tl.constexpr):
    """See ``check_indices``. A repeat is found through ``owner`` (an entry per index below
    ``limit``, never cleared): each entry writes its position to its index's owner, and after a
    barrier one that reads another's position shares its index."""
    out_of_range = 0
    narrowed = 0
    for start in range(0, count, TILE):
        rows = start + tl.arange(0, TILE)
        live = rows < count
        index = tl.load(index_ptr + rows, mask=live, other=-1)
        if ONLY_MINUS_ONE_PADS:
            bad = live & ((index < -1) | (index >= limit))
        else:
            bad = live & (index >= limit)
        out_of_range += tl.sum(bad.to(tl.int32), axis=0)
        safe = tl.where(bad, -1, index)
        if WIDE:  # int64 in, int32 out: saturated (below int32's range: padding, but its output NaN)
            narrowed += tl.sum((live & ((safe < INT32_MIN) | (safe > INT32_MAX))).to(tl.int32), axis=0)
            bad = bad | (live & (index < INT32_MIN))
            safe = tl.minimum(tl.maximum(safe, INT32_MIN), INT32_MAX)
        tl.store(safe_ptr + rows, safe.to(safe_ptr.dtype.element_ty), mask=live)
        if HAS_BAD:
            tl.store(bad_ptr + rows, bad, mask=live)
        if UNIQUE:
            tl.store(owner_ptr + safe, rows, mask=live & (safe >= 0))
    record(word_ptr, codes_ptr, 0, out_of_range)
    if UNIQUE:
        tl.debug_barrier()
        repeats = 0
        for start in range(0, count, TILE):
            rows = start + tl.arange(0, TILE)
            safe = tl.load(safe_ptr + rows, mask=rows < count, other=-1)
            live = (rows < count) & (safe >= 0)
            owner = tl.load(owner_ptr + safe, mask=live, other=0)
            repeats += tl.sum((live & (owner != rows)).to(tl.int32), axis=0)
        record(word_ptr, codes_ptr, 1, repeats)
    if WIDE:
        record(word_ptr, codes_ptr, 2, narrowed)


_INDEX_TILE = 1024
_owners: dict[tuple[torch.device, int], torch.Tensor] = {}


def check_indices(index: torch.Tensor, limit: int, codes: torch.Tensor, word: torch.Tensor, *,
                  only_minus_one_pads: bool, with_bad: bool, narrow: bool = False, unique: bool = True):
    """Indices into something of ``limit`` entries (cache slots, state rows, experts), 1-D: each
    padding or below ``limit`` and, with ``unique`` (what is written in place), none twice.
    Padding is -1 (``only_minus_one_pads``: below -1 is out of range) or any negative.

    Counts at ``codes`` [out of range, repeated] and, with ``narrow`` (the indices given back as
    int32), [an index kept outside int32's range]. Returns ``(safe, bad)``: the indices with each
    out-of-range one -1 (int32 and saturated with ``narrow``, else ``index``'s dtype), and with
    ``with_bad`` a bool ``[count]`` marking the out-of-range ones and, narrowed, the int64 ones
    below int32's range (None without). A repeat stays (in bounds, recorded only). Keeps an int32
    entry per index on the device, made once per device and limit: calls on one device must not
    run at once on two streams."""
    device = index.device
    index = index.contiguous()  # the kernel steps 1 along it
    owner = _owners.get((device, limit)) if unique else index
    if owner is None:  # any contents do (each call writes its entries before reading them): made in a capture too
        owner = _owners[(device, limit)] = torch.empty(max(1, limit), dtype=torch.int32, device=device)
    wide = narrow and index.dtype == torch.int64
    safe = torch.empty(index.shape, dtype=torch.int32 if narrow else index.dtype, device=device)
    bad = torch.empty(index.shape, dtype=torch.bool, device=device) if with_bad else safe
    kernel = for_device(check_indices_kernel, device)
    kernel[(1,)](index, owner, codes, word, safe, bad, index.shape[0], limit, ONLY_MINUS_ONE_PADS=only_minus_one_pads,
                 HAS_BAD=with_bad, WIDE=wide, UNIQUE=unique, TILE=_INDEX_TILE)
    return safe, bad if with_bad else None


_OFFSETS_TILE = 1024


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def check_offsets_kernel(offsets_ptr, codes_ptr, word_ptr, safe_ptr, bad_ptr, count, total, ENDS: tl.constexpr,
                         TILE: tl.constexpr):
    """See ``check_offsets``: one program walks the offsets in order, carrying the running maximum."""
    first = tl.load(offsets_ptr)
    last = tl.load(offsets_ptr + count - 1)
    if ENDS:
        starts_off = first < 0
        ends_off = last > total
    else:
        starts_off = first != 0
        ends_off = last != total
    decreases = 0
    carry = tl.full([], 0, tl.int64)
    for start in range(0, count, TILE):
        rows = start + tl.arange(0, TILE)
        live = rows < count
        value = tl.load(offsets_ptr + rows, mask=live, other=0)
        before = tl.load(offsets_ptr + rows - 1, mask=live & (rows > 0), other=0)
        decreases += tl.sum((live & (rows > 0) & (value < before)).to(tl.int32), axis=0)
        clamped = tl.minimum(tl.maximum(value, 0), total).to(tl.int64)
        running = tl.maximum(tl.associative_scan(clamped, 0, _larger), carry)
        carry = tl.max(tl.where(live, running, 0), axis=0)
        safe = running
        if not ENDS:
            safe = tl.where(rows == count - 1, total, tl.where(rows == 0, 0, running))
        tl.store(safe_ptr + rows, safe.to(safe_ptr.dtype.element_ty), mask=live)
    record(word_ptr, codes_ptr, 0, starts_off.to(tl.int32))
    record(word_ptr, codes_ptr, 1, decreases)
    record(word_ptr, codes_ptr, 2, ends_off.to(tl.int32))
    tl.store(bad_ptr, starts_off | ends_off | (decreases != 0))


def check_offsets(offsets: torch.Tensor, total: int, codes: torch.Tensor, word: torch.Tensor, *,
                  ends: bool = False):
    """Offsets (1-D, at least one entry) that never decrease: packed-sequence offsets that start at
    0 and end at ``total``, or with ``ends`` cumulative group ends (``grouped_mm``'s) from >= 0 to
    at most ``total``; counts at ``codes`` [first off, decreases, last off]. Returns ``(safe,
    bad)``: the offsets clamped into ``[0, total]`` and made non-decreasing (packed ones also from
    0 to ``total``, as ``torch_kernels._checks.safe_offsets``), and a 0-dim bool set when a check
    failed."""
    if not offsets.numel():
        raise ValueError("offsets: expected at least one entry")
    offsets = offsets.contiguous()  # the kernel steps 1 along it
    safe = torch.empty_like(offsets)
    bad = torch.empty((), dtype=torch.bool, device=offsets.device)
    kernel = for_device(check_offsets_kernel, offsets.device)
    kernel[(1,)](offsets, codes, word, safe, bad, offsets.shape[0], total, ENDS=ends, TILE=_OFFSETS_TILE)
    return safe, bad


@triton.jit
def check_not_positive_kernel(bits_ptr, codes_ptr, word_ptr, count, INF_BITS: tl.constexpr, TILE: tl.constexpr,
                              TILES: tl.constexpr):
    """See ``check_not_positive``: ``TILES`` tiles a program. The values come as the signed
    integers of their bits: a float is > 0 exactly when those lie in [1, the bits of +inf] (the
    sign bit clear, not zero, not NaN), a test the interpreter's bfloat16 handling cannot upset."""
    positive = 0
    for tile in range(TILES):
        rows = (tl.program_id(0) * TILES + tile).to(tl.int64) * TILE + tl.arange(0, TILE)
        bits = tl.load(bits_ptr + rows, mask=rows < count, other=0)
        positive += tl.sum(((bits >= 1) & (bits <= INF_BITS)).to(tl.int32), axis=0)
    record(word_ptr, codes_ptr, 0, positive)


_BITS = {torch.float64: (torch.int64, 0x7FF0000000000000), torch.float32: (torch.int32, 0x7F800000),
         torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80)}


def check_not_positive(values: torch.Tensor, codes: torch.Tensor, word: torch.Tensor) -> None:
    """Counts at ``codes`` [a value > 0] (log decays, say): recorded only, the values are safe as
    they are. A program per 8,192 values (the only check here that reads a tensor of the data's
    size: it is a pass over it)."""
    flat = values.reshape(-1).contiguous()
    if not flat.numel():
        return
    int_dtype, inf_bits = _BITS[flat.dtype]
    kernel = for_device(check_not_positive_kernel, values.device)
    kernel[(triton.cdiv(flat.numel(), _SIGN_TILE * _SIGN_TILES),)](
        flat.view(int_dtype), codes, word, flat.numel(), INF_BITS=inf_bits, TILE=_SIGN_TILE, TILES=_SIGN_TILES)


_SIGN_TILE, _SIGN_TILES = 1024, 8


@triton.jit
def check_lengths_kernel(lengths_ptr, codes_ptr, word_ptr, safe_ptr, bad_ptr, count, WIDE: tl.constexpr,
                         TILE: tl.constexpr):
    """See ``check_lengths``."""
    negative = 0
    too_long = 0
    for start in range(0, count, TILE):
        rows = start + tl.arange(0, TILE)
        live = rows < count
        length = tl.load(lengths_ptr + rows, mask=live, other=0)
        below = live & (length < 0)
        negative += tl.sum(below.to(tl.int32), axis=0)
        bad = below
        if WIDE:
            above = live & (length > INT32_MAX)
            too_long += tl.sum(above.to(tl.int32), axis=0)
            bad = bad | above
        safe = tl.minimum(tl.maximum(length, 0), INT32_MAX)
        tl.store(safe_ptr + rows, safe.to(tl.int32), mask=live)
        tl.store(bad_ptr + rows, bad, mask=live)
    record(word_ptr, codes_ptr, 0, negative)
    if WIDE:
        record(word_ptr, codes_ptr, 1, too_long)


def check_lengths(lengths: torch.Tensor, codes: torch.Tensor, word: torch.Tensor):
    """Lengths (1-D) >= 0 and, int64 ones, within int32; counts at ``codes`` [negative, past
    int32's range]. Returns ``(safe, bad)``: int32 lengths clamped into ``[0, 2**31 - 1]``, and a
    bool per entry marking the bad ones (their outputs must be NaN)."""
    lengths = lengths.contiguous()  # the kernel steps 1 along it
    safe = torch.empty(lengths.shape, dtype=torch.int32, device=lengths.device)
    bad = torch.empty(lengths.shape, dtype=torch.bool, device=lengths.device)
    kernel = for_device(check_lengths_kernel, lengths.device)
    kernel[(1,)](lengths, codes, word, safe, bad, lengths.shape[0], WIDE=lengths.dtype == torch.int64,
                 TILE=_INDEX_TILE)
    return safe, bad


@triton.jit
def check_scales_kernel(scale_ptr, codes_ptr, word_ptr, safe_ptr, count, TILE: tl.constexpr):
    """See ``check_scales``."""
    bad_count = 0
    for start in range(0, count, TILE):
        rows = start + tl.arange(0, TILE)
        live = rows < count
        scale = tl.load(scale_ptr + rows, mask=live, other=1.0)
        bad = live & ~((scale > 0) & (scale < float("inf")))  # NaN fails both
        bad_count += tl.sum(bad.to(tl.int32), axis=0)
        tl.store(safe_ptr + rows, tl.where(bad, float("nan"), scale), mask=live)
    record(word_ptr, codes_ptr, 0, bad_count)


def check_scales(scale: torch.Tensor, codes: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """Scales (float32, any shape) finite and > 0; counts at ``codes`` [not]. Returns them with
    each bad one NaN, in ``scale``'s shape."""
    flat = scale.reshape(-1).contiguous()
    safe = torch.empty_like(flat)
    kernel = for_device(check_scales_kernel, scale.device)
    kernel[(1,)](flat, codes, word, safe, flat.shape[0], TILE=_SCALES_TILE)
    return safe.view(scale.shape)


_SCALES_TILE = 128


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of these checks: one group, each kernel for int32 and int64
    indices (``everything`` adds nothing: there are no sizes to vary)."""
    def builds(arch: int = 90) -> list[dict]:
        found = []
        for index_type in ("i32", "i64"):
            for narrow in (False, True):
                found.append(dict(
                    label=f"check_indices {index_type}{' to i32' if narrow else ''}", kernel=check_indices_kernel,
                    signature=dict(index_ptr=f"*{index_type}", owner_ptr="*i32", codes_ptr="*i64", word_ptr="*i32",
                                   safe_ptr="*i32" if narrow else f"*{index_type}", bad_ptr="*i1", count="i32",
                                   limit="i32", ONLY_MINUS_ONE_PADS="constexpr", HAS_BAD="constexpr",
                                   WIDE="constexpr", UNIQUE="constexpr", TILE="constexpr"),
                    constexprs=dict(ONLY_MINUS_ONE_PADS=not narrow, HAS_BAD=narrow, WIDE=narrow and index_type == "i64",
                                    UNIQUE=True, TILE=_INDEX_TILE), num_warps=4, num_stages=None))
            for ends in (False, True):
                found.append(dict(
                    label=f"check_offsets {index_type}{' ends' if ends else ''}", kernel=check_offsets_kernel,
                    signature=dict(offsets_ptr=f"*{index_type}", codes_ptr="*i64", word_ptr="*i32",
                                   safe_ptr=f"*{index_type}", bad_ptr="*i1", count="i32", total="i32",
                                   ENDS="constexpr", TILE="constexpr"),
                    constexprs=dict(ENDS=ends, TILE=_OFFSETS_TILE), num_warps=4, num_stages=None))
        for dtype in (torch.float32, torch.bfloat16):
            int_dtype, inf_bits = _BITS[dtype]
            found.append(dict(label=f"check_not_positive {str(dtype).removeprefix('torch.')}",
                              kernel=check_not_positive_kernel,
                              signature=dict(bits_ptr=f"*i{int_dtype.itemsize * 8}", codes_ptr="*i64",
                                             word_ptr="*i32", count="i64", INF_BITS="constexpr", TILE="constexpr",
                                             TILES="constexpr"),
                              constexprs=dict(INF_BITS=inf_bits, TILE=_SIGN_TILE, TILES=_SIGN_TILES), num_warps=4,
                              num_stages=None))
        for index_type in ("i32", "i64"):
            found.append(dict(label=f"check_lengths {index_type}", kernel=check_lengths_kernel,
                              signature=dict(lengths_ptr=f"*{index_type}", codes_ptr="*i64", word_ptr="*i32",
                                             safe_ptr="*i32", bad_ptr="*i1", count="i32", WIDE="constexpr",
                                             TILE="constexpr"),
                              constexprs=dict(WIDE=index_type == "i64", TILE=_INDEX_TILE), num_warps=4,
                              num_stages=None))
        found.append(dict(label="check_scales", kernel=check_scales_kernel,
                          signature=dict(scale_ptr="*fp32", codes_ptr="*i64", word_ptr="*i32", safe_ptr="*fp32",
                                         count="i32", TILE="constexpr"),
                          constexprs=dict(TILE=_SCALES_TILE), num_warps=4, num_stages=None))
        return found

    return {"checks": builds}
