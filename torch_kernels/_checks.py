"""Input checks shared by every op: each error names the argument, what was expected and what came."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from typing import Callable

import torch

from . import backends

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


def entries_apart(t: torch.Tensor) -> bool:
    """Whether no two entries of ``t`` share memory: sorted by stride, each dimension steps past
    everything the smaller ones reach (sufficient, and met by every slice and permutation of a
    tensor, such as the halves of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache)."""
    shape, strides = tuple(t.shape), t.stride()
    try:
        return _strides_apart(shape, strides)
    except TypeError:  # symbolic sizes (fake tensors while compiling) do not hash
        return _strides_apart.__wrapped__(shape, strides)


@functools.lru_cache(maxsize=256)  # a model's caches share a few layouts; checked on every call
def _strides_apart(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def written_in_place(name: str, value: torch.Tensor) -> None:
    """``value`` is written in place by the op: no two of its entries may share memory (an expanded
    stride-0 view would have every backend write through it differently)."""
    if not entries_apart(value):
        raise ValueError(f"{name}: expected no two entries sharing memory (it is written in place), got strides "
                         f"{value.stride()} for shape {tuple(value.shape)}")


# what a layout-remembered check may take besides tensors: plain values, compared by type and value
_PLAIN = (int, float, bool, str, type(None), torch.dtype)
_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exactly these: fake and torchax tensors are checked each time


def _layout_key(values) -> tuple | None:
    """What a metadata check can see of ``values``: each tensor's dtype, shape, strides and device,
    each plain value's type and value; None where a value is neither (the check then runs)."""
    key = []
    for value in values:
        kind = type(value)
        if kind in _TENSORS:
            key.append((value.dtype, value.shape, value.stride(), value.device))
        elif kind in _PLAIN:
            key.append((kind, value))  # the type too: True and 1 are equal keys, not equal arguments
        elif kind is tuple and all(type(item) in _PLAIN for item in value):
            key.append((kind, tuple((type(item), item) for item in value)))
        else:
            return None
    return tuple(key)


def remembers_layouts(check: Callable) -> Callable:
    """``check``, a host check of its arguments' metadata only (types, dtypes, shapes, strides,
    devices and plain values; never tensor data or addresses), skipped for arguments whose
    metadata equal those of a call that passed, whose result it returns: a model calls each op with
    a few layouts, and the checks were a third of an op's host time. A call that raises is not
    remembered; arguments of any other kind (fake tensors while compiling, lists) are checked each
    time. At most 1024 layouts a check are kept."""
    passed: dict[tuple, object] = {}

    @functools.wraps(check)
    def remembered(*args, **kwargs):
        key = _layout_key(args)
        if key is not None and kwargs:
            named = _layout_key(kwargs.values())
            key = None if named is None else (key, tuple(kwargs), named)
        if key is None:
            return check(*args, **kwargs)
        if key in passed:
            return passed[key]
        result = check(*args, **kwargs)
        if len(passed) >= 1024:
            passed.clear()
        passed[key] = result
        return result

    return remembered


INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def int32_message(name: str) -> str:
    return f"{name}: expected values in int32's range [{INT32_MIN}, {INT32_MAX}]"


def int32_values(name: str, value: torch.Tensor | None, checks: "ValueChecks | None" = None) -> torch.Tensor | None:
    """``value`` (ids, lengths, rows) as a contiguous int32 tensor for a kernel. An int64 value
    outside int32's range is a ``ValueError`` naming ``name``: the cast would wrap it into another,
    valid-looking value (a padding row into row 0). With ``checks`` the test is one of the call's
    value checks (deferred: recorded, and the value saturated so the op's own range checks see it
    out of range); without, it reads the values back at once. Only int64 input is tested."""
    if value is None:
        return None
    if value.dtype == torch.int64 and value.numel():
        message = int32_message(name)
        if checks is not None:
            checks.add((value < INT32_MIN) | (value > INT32_MAX), message,
                       lambda given=value: f"got {int(given.min())} .. {int(given.max())}")
            value = value.clamp(INT32_MIN, INT32_MAX)
        else:
            low, high = torch.aminmax(value)
            if low.item() < INT32_MIN or high.item() > INT32_MAX:
                raise ValueError(f"{message}, got {low.item()} .. {high.item()}")
    return value.to(torch.int32).contiguous()


# ---- value checks: "full" (raise now) or "deferred" (recorded on the device) ----

# The shared deferred checks a backend may run as one device launch of its own (``backends.helper``,
# chosen by ``ValueChecks.backend``); the rest run as torch ops. Messages are made once per shape.
OFFSETS_CHECK, INDICES_CHECK, SCALES_CHECK = "checks.packed_offsets", "checks.indices", "checks.scales"
NOT_POSITIVE_CHECK, LENGTHS_CHECK = "checks.not_positive", "checks.lengths"
backends.register(OFFSETS_CHECK, "triton", "triton_impl.checks:check_offsets")
backends.register(INDICES_CHECK, "triton", "triton_impl.checks:check_indices")
backends.register(SCALES_CHECK, "triton", "triton_impl.checks:check_scales")
backends.register(NOT_POSITIVE_CHECK, "triton", "triton_impl.checks:check_not_positive")
backends.register(LENGTHS_CHECK, "triton", "triton_impl.checks:check_lengths")


@functools.lru_cache(maxsize=256)
def _offsets_messages(name: str, total_what: str) -> tuple[str, ...]:
    return (f"{name}: expected to start at 0", f"{name}: expected non-decreasing offsets",
            f"{name}: expected to end at {total_what}")


@functools.lru_cache(maxsize=256)
def _rows_messages(name: str, state_name: str, num_rows: int) -> tuple[str, ...]:
    return (f"{name}: expected rows below {state_name}'s {num_rows}", f"{name}: expected each row at most once",
            int32_message(name))


def safe_offsets(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Packed-sequence ``offsets`` made safe for a kernel in deferred mode (on the device, no read):
    clamped into ``[0, total]``, non-decreasing, from 0 to ``total``."""
    safe = offsets.clamp(0, total).cummax(0).values
    safe[0] = 0
    safe[-1] = total
    return safe


def packed_offsets(name: str, offsets: torch.Tensor, total: int, total_what: str,
                   checks: "ValueChecks") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed-sequence ``offsets`` (argument ``name``) start at 0, never decrease and end at
    ``total`` (``total_what`` says what it is). Returns ``(offsets, bad)`` for the kernels: as given
    and None in full mode; in deferred mode :func:`safe_offsets` and a 0-dim flag set when a check
    failed (the outputs are then all NaN: the sequences' rows cannot be told apart)."""
    messages = _offsets_messages(name, total_what)
    if (device_check := checks.device_check(OFFSETS_CHECK, messages)) is not None:
        return device_check(offsets, total)
    starts_off, ends_off = offsets[0] != 0, offsets[-1] != total
    decreasing = offsets[1:] < offsets[:-1]
    checks.add(starts_off, messages[0], lambda: f"got {int(offsets[0])}")
    checks.add(decreasing, messages[1], lambda: f"got {offsets.tolist()}")
    checks.add(ends_off, messages[2], lambda: f"got {int(offsets[-1])}")
    if not checks.deferred:
        return offsets, None
    return safe_offsets(offsets, total), starts_off | ends_off | decreasing.any()


def state_rows(name: str, rows: torch.Tensor, state_name: str, num_rows: int,
               checks: "ValueChecks") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows ``name`` picks of a state ``state_name`` written in place: each below ``num_rows``
    (negative: padding) and at most once. Returns ``(rows, bad)``: as given and None in full mode;
    in deferred mode a row past the state becomes padding and ``bad`` marks the entries whose output
    must be NaN (also an int64 row below int32's range, which the kernels' int32 cast makes
    padding). A repeated row stays in bounds and is only recorded. With the shared index check of
    the planned backend (``INDICES_CHECK``) the rows come back as int32 already, saturated and the
    int32 range checked, as :func:`int32_values` would give them."""
    messages = _rows_messages(name, state_name, num_rows)
    if (device_check := checks.device_check(INDICES_CHECK, messages)) is not None:
        # int32 rows straight away: the int32 range check the kernels need is in the launch too
        return device_check(rows, num_rows, only_minus_one_pads=False, with_bad=True, narrow=True)
    past = rows >= num_rows
    ordered = rows.sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    checks.add(past, messages[0], lambda: f"got {rows.tolist()}")
    checks.add(repeated, messages[1], lambda: f"got {rows.tolist()}")
    if not checks.deferred:
        return rows, None
    bad = past | (rows < INT32_MIN) if rows.dtype == torch.int64 else past
    return torch.where(past, -1, rows), bad


def nan_where(flag: torch.Tensor | None, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``outputs``, each all NaN where the 0-dim ``flag`` (a deferred check failed) is set; as
    they are for None (full mode)."""
    return outputs if flag is None else tuple(t.masked_fill(flag, torch.nan) for t in outputs)


CHECKS_ENV_VAR = "TORCH_KERNELS_CHECKS"
MODES = ("full", "deferred")
_mode_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("torch_kernels_checks", default=None)


def _parse_mode(mode, what: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{what}: expected one of {MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def checks(mode: str):
    """Within this block every op call checks its inputs' values in ``mode``:

    - ``"full"``: before any kernel runs, reading the index tensors on the host (one read per
      call; on an accelerator a host-device synchronisation), and a bad value raises at once a
      ``ValueError`` that names the argument and the offending value;
    - ``"deferred"``: no tensor data is read on the host, whatever the device. The checks run on
      the device and record what fails in a small persistent error word; the kernels get inputs
      made safe (a bad slot or row is skipped, a bad expert id dropped, a sequence with a bad page
      id or length kept to its own rows), and the output rows such an entry touches are NaN (-1 in
      index outputs). Nothing is read or written out of bounds. :func:`raise_deferred_errors` reads the word (one read) and raises the
      ``ValueError`` the full mode would have raised, without the value.

    Without a block: ``TORCH_KERNELS_CHECKS`` (``full`` or ``deferred``) if set, else ``full`` for
    CPU tensors and ``deferred`` on accelerators; torchax tensors always ``full``. Shapes, dtypes,
    devices and strides are checked on the host in both modes (they cost no read).
    """
    token = _mode_override.set(_parse_mode(mode, "checks"))
    try:
        yield
    finally:
        _mode_override.reset(token)


def mode_for(device: torch.device) -> str:
    """The check mode of a call on ``device``: the innermost :func:`checks` block, the environment
    variable, or the device's default; always ``full`` on torchax tensors."""
    if device.type == "jax":  # torchax tensors: JAX runs eagerly there and the checks stay full
        return "full"
    mode = _mode_override.get()
    if mode is None:
        mode = os.environ.get(CHECKS_ENV_VAR)
        if not mode:
            return "full" if device.type == "cpu" else "deferred"
        _parse_mode(mode, CHECKS_ENV_VAR)
    return mode


# The error word: per device, one int32 count per distinct failure message. A message is numbered
# the first time it is recorded; past the word's capacity failures share the last entry.
_WORD_SIZE = 1024
_OVERFLOW = ("a deferred input check failed (more distinct failures than the error word holds; "
             f"rerun with {CHECKS_ENV_VAR}=full to see which)")
_messages: list[str] = []
_codes: dict[str, int] = {}
_words: dict[torch.device, torch.Tensor] = {}
_indices: dict[tuple, torch.Tensor] = {}  # (device, codes) -> the codes on that device
_word_lock = threading.Lock()


def _code(message: str) -> int:
    code = _codes.get(message)
    if code is None:
        with _word_lock:
            code = _codes.get(message)
            if code is None:
                if len(_messages) >= _WORD_SIZE - 1:
                    return _WORD_SIZE - 1
                code = _codes[message] = len(_messages)
                _messages.append(message)
    return code


def capturing(device: torch.device) -> bool:
    """Whether this thread's current stream on ``device`` is being captured into a CUDA graph
    (its kernels are then recorded, not run)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def error_word(device: torch.device) -> torch.Tensor:
    """``device``'s error word (int32 ``[1024]``), made on first use and kept: a CUDA graph that
    captured a deferred check writes into this same tensor on replay. Made outside a capture (its
    zeroing would only be recorded there): a first call inside one is a ``RuntimeError``."""
    word = _words.get(device)
    if word is None:
        if capturing(device):
            raise RuntimeError(f"torch_kernels: the deferred checks' error word of {device} is made on the first "
                               "op call; run the ops once before capturing a CUDA graph (a warm-up step)")
        with _word_lock:
            word = _words.get(device)
            if word is None:
                word = _words[device] = torch.zeros(_WORD_SIZE, dtype=torch.int32, device=device)
    return word


_message_indices: dict[tuple, torch.Tensor] = {}  # (device, messages) -> their codes there


def message_codes(device: torch.device, messages: tuple[str, ...]) -> torch.Tensor:
    """The error word's entries for ``messages`` (int64, on ``device``): where a device check
    counts each message's failures (kept per device and messages; made without a host read)."""
    key = (device, messages)
    index = _message_indices.get(key)
    if index is None:
        index = _codes_on(device, tuple(_code(m) for m in messages))
        if not capturing(device):  # as _codes_on keeps them
            if len(_message_indices) > 4096:
                _message_indices.clear()
            _message_indices[key] = index
    return index


_host_codes: dict[tuple[int, ...], torch.Tensor] = {}


def _codes_on(device: torch.device, codes: tuple[int, ...]) -> torch.Tensor:
    """``codes`` as an int64 tensor on ``device``: copied from a host tensor that is kept (pinned
    for CUDA), without waiting, so no synchronisation even on first use. Kept for later calls,
    but for one made inside a CUDA-graph capture: its copy is only recorded there (it runs on each
    replay, from the kept host tensor), so outside the graph it would hold nothing yet."""
    key = (device, codes)
    index = _indices.get(key)
    if index is None:
        host = _host_codes.get(codes)
        if host is None:
            if len(_host_codes) > 4096:  # bounded: distinct messages per shape could grow without end
                _host_codes.clear()
                _indices.clear()
            host = torch.tensor(codes, dtype=torch.int64)
            host = _host_codes[codes] = host.pin_memory() if device.type == "cuda" else host
        index = host.to(device, non_blocking=True)
        if not capturing(device):
            _indices[key] = index
    return index


class ValueChecks:
    """The value checks of one op call, in the call's mode (:func:`checks`).

    Each :meth:`add` gives a boolean tensor that is True where an entry is bad (any shape; on the
    call's device), the error message's fixed part (the argument's name first, then what was
    expected) and, for the full mode, a function that says what came. :meth:`finish` then raises
    the first failure (full: one host read for all the checks) or records them in the device's
    error word (deferred: no host read). In deferred mode the op makes bad entries safe itself,
    from the same masks (``self.deferred``). ``mode``: this call's, overriding :func:`mode_for`.
    ``backend``: the backend the call's kernel is planned on (``backends.planned``), whose helpers
    may run a family's deferred checks in one device launch (None: the checks as torch ops)."""

    __slots__ = ("device", "deferred", "backend", "_flags", "_messages", "_details")

    def __init__(self, device: torch.device, mode: str | None = None, backend: str | None = None):
        self.device = device
        self.deferred = (mode or mode_for(device)) == "deferred"
        self.backend = backend
        self._flags: list[torch.Tensor] = []
        self._messages: list[str] = []
        self._details: list = []

    def device_check(self, name: str, messages: tuple[str, ...]) -> Callable | None:
        """In deferred mode, the planned backend's one-launch check ``name`` (``backends.helper``)
        with the error word and its entries for ``messages`` bound (``codes=``, ``word=``): call it
        with the check's own arguments. None in full mode or where the backend has none: the
        checks then run as torch ops through :meth:`add`."""
        if not self.deferred or (check := backends.helper(name, self.backend)) is None:
            return None
        return functools.partial(check, codes=message_codes(self.device, messages), word=error_word(self.device))

    def add(self, bad: torch.Tensor, message: str, detail: Callable[[], str] | None = None) -> torch.Tensor:
        """Record one check; returns ``bad`` reduced to one flag (True: it failed)."""
        flag = bad if bad.dim() == 0 else bad.any()
        self._flags.append(flag)
        self._messages.append(message)
        self._details.append(detail)
        return flag

    def finish(self) -> None:
        if not self._flags:
            return
        flags = torch.stack(self._flags)
        if self.deferred:
            codes = tuple(_code(m) for m in self._messages)
            error_word(self.device).index_put_((_codes_on(self.device, codes),), flags.to(torch.int32), accumulate=True)
            return
        for failed, message, detail in zip(flags.tolist(), self._messages, self._details):  # the one read
            if failed:
                raise ValueError(message if detail is None else f"{message}, {detail()}")


def checked(device: torch.device, check: Callable, *args, backend: str | None = None):
    """``check(*args, checks)`` with a :class:`ValueChecks` of the call's mode on ``device`` (and
    ``backend``, as there), then finished (in full mode raising the first failure now): what
    ``check`` returns."""
    checks = ValueChecks(device, backend=backend)
    result = check(*args, checks)
    checks.finish()
    return result


def raise_deferred_errors(device: torch.device | str | None = None) -> None:
    """Raise the first input error the deferred checks recorded since the last call, and clear them.

    Reads each device's error word once (on an accelerator, one synchronisation: call it where the
    loop syncs anyway, as the serving ``Engine`` does after each step). The ``ValueError`` names the
    argument and what was expected, as the full mode's does, and says how many more checks failed.
    ``device``: only that device's word; by default every device's.
    """
    if device is not None:
        device = torch.device(device)
    failures: list[tuple[int, int]] = []
    for word_device, word in list(_words.items()):
        if device is not None and word_device != device:
            continue
        counts = word.tolist()
        if any(counts):
            word.zero_()
            failures += [(code, count) for code, count in enumerate(counts) if count]
    if failures:
        code = min(failures)[0]
        message = _messages[code] if code < len(_messages) else _OVERFLOW
        others = len(failures) - 1
        more = f" (and {others} other failed check{'s' if others > 1 else ''})" if others else ""
        raise ValueError(f"{message} (found by a deferred check){more}")
