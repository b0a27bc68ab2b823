"""The roofline in the profiler: what each op achieved against what the device can do.

``with torch_kernels.profile() as prof: ...`` runs the block under ``torch.profiler`` and, for
every call of a ``torch_kernels`` op in it, records the op, the backend that ran it, its time and
its FLOPs and bytes (the op's formulas, ``torch_kernels._library.register_cost``). ``print(prof)``
prints one row per op and backend: calls, total and mean time, achieved FLOP/s and GB/s, and
their fractions of the device's peaks, which :func:`calibrate_device` measures once per device
(copy bandwidth and matmul rate) and caches. ``prof.export_chrome_trace(path)`` (or ``trace=``)
writes the Chrome trace, where each kernel appears as ``torch_kernels::<op>[<backend>]``.
``torch_kernels.profile.continuous()`` records the same per call, always on, in a bounded ring
(:class:`Telemetry`); its ``snapshot()`` gives the last seconds as this table, rows or a trace.

How a call is timed: the op's own kernel is swapped for a timed one while the block runs
(``_library.kernels_replaced_by``), so outside it nothing changes and nothing is checked. The
time is the whole op call, input checks and glue included, because that is what the FLOP and byte
formulas count (a backward may do part of its math around its kernel): on the CPU by the wall
clock, on accelerators by device events recorded around the call on the current stream and read
when the block ends (no sync per call). The profiler's own events are not used for the table:
their device times need the accelerator activity enabled and an event tree built for the whole
trace, and a range covers the backend kernel only, not the op the formulas describe.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import threading
import time
import warnings
from typing import Callable, Iterable

import torch

from . import _library, backends
from ._cache import cache_dir, read_json, write_json

__all__ = ["profile", "calibrate_device", "DevicePeaks", "device_name", "Telemetry", "Snapshot", "continuous",
           "snapshot", "telemetry", "summarize", "format_table"]

CACHE_FILE = "device_peaks.json"
NO_KERNEL = "torch"  # the backend column of a call that ran no backend kernel (plain PyTorch in the op)


# ---- device peaks ----

@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """A device's measured peaks: ``flops_per_s`` of a dense matmul in ``matmul_dtype`` and
    ``bytes_per_s`` of a large copy (bytes read plus bytes written)."""

    device: str
    flops_per_s: float
    bytes_per_s: float
    matmul_dtype: str


def device_name(device: torch.device | str) -> str:
    """The name peaks are cached under: the accelerator's model, or the CPU's model and threads."""
    device = torch.device(device)
    if device.type == "cpu":
        return f"cpu: {_cpu_model()} ({torch.get_num_threads()} threads)"
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "get_device_name"):
        return f"{device.type}: {module.get_device_name(device)}"
    return str(device)


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate_device(device: torch.device | str | None = None, *, refresh: bool = False) -> DevicePeaks:
    """The peaks of ``device`` (default: the current accelerator, else the CPU), measured once.

    The first call for a device measures for a few seconds (see :func:`measure_peaks`) and stores
    the result under the device's name in ``$TORCH_KERNELS_CACHE/device_peaks.json`` (default
    ``~/.cache/torch_kernels``); later calls, in any process, read it back. ``refresh=True``
    measures again. An unreadable cache file is ignored with a warning and rewritten.
    """
    if device is None:
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        device = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else "cpu"
    device = torch.device(device)
    name = device_name(device)
    path = cache_dir(CACHE_FILE)
    cache = read_json(path, "peaks cache")
    cache = cache if isinstance(cache, dict) else {}
    entry = cache.get(name)
    if entry is not None and not refresh:
        try:
            return DevicePeaks(**entry)
        except TypeError:
            warnings.warn(f"torch_kernels: ignoring a malformed entry for {name!r} in {path}", stacklevel=2)
    peaks = measure_peaks(device)
    cache[name] = dataclasses.asdict(peaks)
    write_json(path, dict(sorted(cache.items())))
    return peaks


def measure_peaks(device: torch.device | str) -> DevicePeaks:
    """Measure ``device``'s copy bandwidth and matmul rate (best of a few runs; a few seconds).

    Copy: ``dst.copy_(src)`` of 1 GiB on an accelerator, 256 MiB on the CPU (beyond its caches);
    bandwidth = 2 x size / time. Matmul: square bfloat16 products of 2048, 4096 and 8192 on an
    accelerator, float32 of 256, 512 and 1024 on the CPU; rate = 2 n^3 / time, the best size.
    """
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    dtype = torch.float32 if on_cpu else torch.bfloat16
    flops_per_s = max(_matmul_rate(n, dtype, device) for n in ((256, 512, 1024) if on_cpu else (2048, 4096, 8192)))
    bytes_per_s = _copy_bandwidth((256 if on_cpu else 1024) * 2**20, device)
    return DevicePeaks(device_name(device), flops_per_s, bytes_per_s, str(dtype).removeprefix("torch."))


def _copy_bandwidth(size: int, device: torch.device) -> float:
    src = torch.ones(size // 4, dtype=torch.float32, device=device)  # written, so its pages exist
    dst = torch.zeros_like(src)
    return 2 * size / _best_seconds(lambda: dst.copy_(src), device)


def _matmul_rate(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up: allocation, library initialization, clocks
    return min(_Timer(device).time(fn) for _ in range(repeats))


class _Timer:
    """Times work on ``device``: the wall clock on the CPU, events on the current stream elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            self.begin = time.perf_counter()
        else:
            self.begin, self.end = (torch.Event(device=device, enable_timing=True) for _ in range(2))
            self.begin.record()

    def stop(self) -> None:
        if self.device.type == "cpu":
            self.end = time.perf_counter()
        else:
            self.end.record()

    def seconds(self) -> float:
        if self.device.type == "cpu":
            return self.end - self.begin
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3

    def time(self, fn: Callable[[], object]) -> float:
        fn()
        self.stop()
        return self.seconds()


# ---- the profile ----

@dataclasses.dataclass
class _Call:
    op: str
    device: torch.device
    timer: _Timer
    backends: str = ""
    flops: int | None = None
    bytes: int | None = None


class _Running(threading.local):
    """Per thread, ``calls``: for each op call being recorded, innermost last (a kernel may call another
    op), the backends that ran for it (``"a+b"`` where its kernel dispatched twice), ``""`` before any;
    backends.dispatch writes the last."""

    def __init__(self):
        self.calls: list[str] = []


_running = _Running()
_active_lock = threading.Lock()
_active: profile | None = None


def _set_observer() -> None:
    """Have backends.dispatch report the backends while a profile or the telemetry records, else not."""
    backends._observer = _running if _active is not None or _telemetry is not None else None


def _ratio(numerator, denominator) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _device_of(values: Iterable) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


class profile:  # noqa: N801 - used as ``with torch_kernels.profile():``, like torch.profiler.profile
    """Profile the ``torch_kernels`` ops run in a block: time, FLOP/s, GB/s and roofline fractions.

    >>> with torch_kernels.profile() as prof:
    ...     out = model(x)
    >>> print(prof)                      # the table, one row per op and backend
    >>> prof.rows                         # the same as dicts (JSON-ready)
    >>> prof.export_chrome_trace("trace.json")

    Args:
        activities: ``torch.profiler``'s (default: the CPU and any accelerator it supports).
        trace: a path to write the Chrome trace to when the block ends.
        calibrate: look up each device's peaks (:func:`calibrate_device`, measured a few seconds
            the first time a device is seen, cached after) to report fractions of the roofline;
            ``False`` leaves the fractions out.
        **profiler_kwargs: passed to ``torch.profiler.profile`` (``record_shapes``, ``with_stack``...).

    Ops are recorded where they run on CPU, CUDA or XPU tensors, eagerly or inside code compiled
    by ``torch.compile``, and forward and backward alike (a backward op is a row of its own).
    Torchax ('jax') tensors never reach these kernels (torchax runs the op's JAX implementation),
    so they are not recorded; profile those with JAX's profiler. Ops called on other threads are
    recorded too; profiles do not nest. A first call includes one-time work (Triton compilation,
    autotuning, caches): run the code once before the block. The block's own overhead: one timer
    and one formula evaluation per op call (formulas that read lengths from device tensors copy
    them to the host).
    """

    def __init__(self, activities=None, trace: str | os.PathLike | None = None, calibrate: bool = True,
                 **profiler_kwargs):
        self.profiler = torch.profiler.profile(activities=activities, **profiler_kwargs)
        self.trace = trace
        self.calibrate = calibrate
        self.rows: list[dict] = []
        self.peaks: dict[str, DevicePeaks] = {}
        self._calls: list[_Call] = []
        self._kernels = None
        self._trace_written: pathlib.Path | None = None

    def __enter__(self) -> profile:
        global _active
        with _active_lock:
            if _active is not None:
                raise RuntimeError("torch_kernels.profile: another profile is active (profiles do not nest)")
            _active = self
        try:
            self.profiler.__enter__()
            self._kernels = _library.kernels_replaced_by(self._timed)
            self._kernels.__enter__()
            backends._observer = _running
        except BaseException:
            self._close(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(exc_type, exc, tb)
        if exc_type is None:
            self.rows = self._summarize()
            if self.trace is not None:
                self.export_chrome_trace(self.trace)

    def _close(self, exc_type, exc, tb) -> None:
        global _active
        try:
            if self._kernels is not None:
                self._kernels.__exit__(None, None, None)  # restores the kernels; the error is the caller's
                self._kernels = None
            for device in {call.device for call in self._calls if call.device.type != "cpu"}:
                getattr(torch, device.type).synchronize(device)
            if self.profiler.profiler is not None:
                self.profiler.__exit__(exc_type, exc, tb)
        finally:
            with _active_lock:
                _active = None
            _set_observer()

    def _timed(self, op: torch._ops.OpOverload, kernel: Callable) -> Callable:
        """``kernel`` recording each call: its time, backends and cost."""
        name = op._opname
        cost = _library.cost_of(name)
        calls = self._calls

        def timed_kernel(*args, **kwargs):
            device = _device_of(args)
            call = _Call(name, device, _Timer(device))
            running = _running.calls
            running.append("")
            try:
                out = kernel(*args, **kwargs)
            finally:
                call.backends = running.pop()
            call.timer.stop()
            if cost is not None:
                arguments = _library.bind_arguments(op, args, kwargs)
                call.flops, call.bytes = cost.flops(arguments, out), cost.bytes(arguments, out)
            calls.append(call)
            telemetry = _telemetry  # running too: the call goes to its ring as well, costs already known
            if telemetry is not None:
                telemetry._add_profiled(call, args)
            return out

        timed_kernel.__name__ = f"{name}_timed"
        return timed_kernel

    def _summarize(self) -> list[dict]:
        names = {device: device_name(device) for device in {call.device for call in self._calls}}
        if self.calibrate:
            for device, name in names.items():
                self.peaks.setdefault(name, calibrate_device(device))
        return summarize(((call.op, call.backends or NO_KERNEL, names[call.device],
                           call.timer.seconds(), call.flops, call.bytes) for call in self._calls), self.peaks)

    def table(self) -> str:
        """The rows as a text table, slowest first, with each device's peaks above it."""
        return format_table(self.rows, self.peaks, "torch_kernels profile")

    def __str__(self) -> str:
        return self.table()

    def export_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the block's Chrome trace (``chrome://tracing``, Perfetto) to ``path``."""
        if self._trace_written is not None:  # the profiler writes its trace once; later exports copy it
            shutil.copyfile(self._trace_written, path)
            return
        self.profiler.export_chrome_trace(str(path))
        self._trace_written = pathlib.Path(path).resolve()


# ---- always-on telemetry ----

ENV_TELEMETRY = "TORCH_KERNELS_TELEMETRY"
_telemetry: Telemetry | None = None
_Tensor = torch.Tensor


INDEX_NUMEL = 256  # integer tensors up to this size are kept, for formulas that read them (offsets, lengths)
COST_MEMO = 4096  # distinct call signatures whose FLOPs and bytes a telemetry remembers
SIGNATURE_MEMO = 1024  # distinct argument descriptions per op the hot path hands back as made before
SIGNATURE_PROBES = 4  # per op, the recent signatures a call is matched against in C before the memo


def _describer(op: torch._ops.OpOverload) -> list[Callable[[tuple], tuple | None]]:
    """``[describe, describe_plain]``: ``describe(args)`` is what the cost formulas need later, holding no
    tensor of data: each tensor argument as ``(shape, dtype)``, other arguments as they are. Integer
    tensors of at most ``INDEX_NUMEL`` elements (offsets, sequence lengths, which formulas read) are
    kept themselves. ``describe_plain(args)`` is the same for a call the autograd kernel would hand
    straight to the kernel (no tensor needing a gradient, none of a subclass; the caller checks for
    dispatch modes), else None. The caller reads the list's items on each call: new probes replace them.

    The hot path of the telemetry. Reading a tensor's shape and dtype from Python costs about 0.2 us
    here (a new ``torch.Size``, two attribute calls into torch, then hashing and comparing it for a
    memo), so a call is first matched against the signatures this op saw recently (at most
    ``SIGNATURE_PROBES``, the newest first) by one function generated for them: the number of
    arguments, the other arguments by ``==``, and the tensors in one call of a ``TensorGuards``
    (torch's compiler checks its inputs with it), which compares each tensor's type, dtype, device,
    dispatch keys, sizes and whether it requires grad in C++ without making a Python object, about
    60 ns a tensor; a match hands back that signature's description. Probes are made for plain
    tensors needing no gradient only, so a match also tells the autograd key's wrapper that the
    kernel may run directly (``Telemetry._recording``). A call no probe matches takes the memo: per op
    and number of arguments (the dispatcher leaves trailing defaults out), a function generated from
    the schema and the first call's argument types, which looks the description up by the
    arguments' shapes and dtypes, made the first time. A signature the memo has seen before gets a
    probe while fewer than ``SIGNATURE_PROBES`` exist, or when it comes twice in a row (the oldest
    probe then dropped), so that many signatures in turn do not keep replacing each other's probes:
    each of those calls costs the probes' misses (about 70 ns each) and the memo. Where torch lacks
    a working ``TensorGuards``, the memo alone.

    Descriptions hold shapes as plain tuples: ``torch.Size`` is a container the garbage collector
    tracks for good, and a ring of records holding one had every collection walk all of it (about
    0.3 us a call at 10,000 records); a record of shared plain tuples leaves its sight after one
    collection, and the call allocates no other lasting container to bring the next one sooner.
    """
    kinds = []
    for argument in op._schema.arguments:
        kind, optional = argument.type, isinstance(argument.type, torch.OptionalType)
        if optional:
            kind = kind.getElementType()
        if isinstance(kind, torch.ListType):
            if "Tensor" in str(kind.getElementType()):
                return [lambda args: _plain(tuple(_metadata(a) for a in args)), _missed]
            kinds.append("list")
        elif isinstance(kind, torch.TensorType):
            kinds.append("optional" if optional else "tensor")
        else:
            kinds.append("value")
    made: dict[int, tuple[Callable, bool]] = {}
    known: dict[tuple, tuple] = {}
    probes: list[tuple] = []  # (test, check, description), the newest first
    latest: list = [None]  # the description of the latest call no probe matched
    lock = threading.Lock()

    def remember(meta: tuple) -> tuple:
        if len(known) >= SIGNATURE_MEMO:
            known.clear()
        kept = known[meta] = _plain(meta)
        return kept

    def generated(args: tuple) -> tuple[Callable, bool]:
        fields, keeps_tensors = [], False
        for i, kind in enumerate(kinds[:len(args)]):
            t = f"a[{i}]"
            if kind in ("tensor", "optional"):
                index = isinstance(args[i], _Tensor) and not (args[i].is_floating_point() or args[i].is_complex())
                keeps_tensors |= index
                field = f"(_kept_index({t}) if {t}.numel() <= {INDEX_NUMEL} else ({t}.shape, {t}.dtype))" if index \
                    else f"({t}.shape, {t}.dtype)"
                fields.append(f"(None if {t} is None else {field})" if kind == "optional" else field)
            else:
                fields.append(f"_metadata({t})" if kind == "list" else t)
        meta = f"({', '.join(fields)}{',' if len(fields) == 1 else ''})"
        # a kept index tensor makes each call's description distinct: those skip the memo and the probes
        body = f"_plain({meta})" if keeps_tensors else f"known(key := {meta}) or remember(key)"
        return eval(f"lambda a: {body}",  # noqa: S307 - our own text
                    {"_metadata": _metadata, "_kept_index": _kept_index, "_plain": _plain, "known": known.get,
                     "remember": remember}), not keeps_tensors

    def probe_for(args: tuple, meta: tuple) -> None:
        tensors = [i for i in positions if i < len(args) and args[i] is not None]
        if not all(type(args[i]) is _Tensor and not args[i].requires_grad for i in tensors):
            return  # a probe's match says "plain, no gradient" too (the autograd kernel's fast path)
        try:
            check = _guard_maker()(*[args[i] for i in tensors])
        except Exception:  # noqa: BLE001 - a tensor the guards do not take: this signature stays with the memo
            return
        test = [f"len(a) == {len(args)}", f"CHECK({', '.join(f'a[{i}]' for i in tensors)})"]
        for i, kind in enumerate(kinds[:len(args)]):
            if kind in ("tensor", "optional"):
                test += [] if i in tensors else [f"a[{i}] is None"]
            else:
                test.append(f"{'_metadata(a[{i}])' if kind == 'list' else f'a[{i}]'} == META[{i}]")
        with lock:
            probes.insert(0, (" and ".join(test), check, meta))
            del probes[SIGNATURE_PROBES:]
            make = _probes_maker(tuple(test for test, _, _ in probes))
            known_checks = [value for _, check, meta in probes for value in (check, meta)]
            describer[:] = make(memo, *known_checks), make(plain_memo, *known_checks)

    def memo(args: tuple) -> tuple:
        entry = made.get(len(args))
        if entry is None:
            if len(args) > len(kinds):
                return _plain(tuple(_metadata(a) for a in args))
            entry = made[len(args)] = generated(args)
        fn, memoized = entry
        size = len(known)
        meta = fn(args)
        if memoized and len(known) == size and (meta is latest[0] or len(probes) < SIGNATURE_PROBES) \
                and _guard_maker() is not None:
            probe_for(args, meta)
        latest[0] = meta
        return meta

    def plain_memo(args: tuple) -> tuple | None:
        """The memo's description of a call the autograd kernel would hand straight to the kernel (no tensor
        needing a gradient, none of a subclass; no dispatch mode, which the caller checked), else None."""
        for i in positions:
            if i < len(args) and (t := args[i]) is not None and (type(t) is not _Tensor or t.requires_grad):
                return None
        return memo(args)

    positions = [i for i, kind in enumerate(kinds) if kind in ("tensor", "optional")]
    describer = [memo, plain_memo]
    return describer


def _missed(args: tuple) -> None:
    return None


_probes_makers: dict[tuple[str, ...], Callable] = {}


def _probes_maker(tests: tuple[str, ...]) -> Callable:
    """``make(otherwise, check0, meta0, check1, meta1, ...)``: one function trying the probes in turn (each
    test with its ``CHECK`` and ``META``), handing back the first match's description, else ``otherwise(a)``;
    compiled once per sequence of tests, which ops whose probes read alike share."""
    make = _probes_makers.get(tests)
    if make is None:
        if len(_probes_makers) >= SIGNATURE_MEMO:  # texts depend on arguments' kinds, not shapes: few
            _probes_makers.clear()
        chain = " else ".join(f"meta{i} if {test.replace('CHECK', f'check{i}').replace('META', f'meta{i}')}"
                              for i, test in enumerate(tests))
        names = ", ".join(f"check{i}, meta{i}" for i in range(len(tests)))
        make = _probes_makers[tests] = eval(  # noqa: S307 - our own text
            f"lambda otherwise, {names}: lambda a: {chain} else otherwise(a)", {"_metadata": _metadata})
    return make


def _guard_maker() -> Callable | None:
    """``guard(*tensors)``: a function telling whether its tensors match these in type, dtype, device,
    dispatch keys and sizes (strides not compared), made of torch's ``TensorGuards``; ``None`` where
    that is missing or does not behave so in this torch (then the probes are off)."""
    global _guards
    if _guards is False:
        _guards = None
        try:
            from torch._C._dynamo.guards import TensorGuards

            def guard(*tensors):
                return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                    dynamic_dims_strides=[[None] * t.dim() for t in tensors]).check

            check = guard(torch.zeros(2, 3))
            others = (torch.zeros(3, 2), torch.zeros(2, 4), torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, 1),
                      torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, requires_grad=True), None)
            if check(torch.ones(2, 3)) and check(torch.ones(3, 2).t()) and not any(check(t) for t in others):
                _guards = guard
        except Exception:  # noqa: BLE001 - another torch's guards: the memo alone
            pass
    return _guards


_guards: Callable | None | bool = False  # False until _guard_maker first looks


def _kept_index(t: torch.Tensor) -> torch.Tensor:
    """A small integer tensor as the record keeps it: a copy where it views a larger storage, which
    the view would keep alive (a few offsets sliced from a large buffer)."""
    return t if t.untyped_storage().nbytes() <= INDEX_NUMEL * 8 else t.clone()


def _metadata(value):
    if isinstance(value, _Tensor):
        if not (value.is_floating_point() or value.is_complex()) and value.numel() <= INDEX_NUMEL:
            return _kept_index(value)
        return value.shape, value.dtype
    if isinstance(value, (list, tuple)):  # kept as a tuple: the caller may change its list later
        return tuple(_metadata(v) for v in value)
    return value


def _is_metadata(value) -> bool:
    """Whether ``value`` is a recorded tensor: ``(shape, dtype)``, the shape a tuple or a ``torch.Size``."""
    return type(value) is tuple and len(value) == 2 and type(value[0]) in (tuple, torch.Size) \
        and isinstance(value[1], torch.dtype)


def _plain(value):
    """A description with each shape a plain tuple (which the garbage collector stops tracking)."""
    if _is_metadata(value):
        return tuple(value[0]), value[1]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _on_meta(value, keep_index: bool):
    """A recorded argument back as an argument: a meta tensor of its shape and dtype for a tensor; a kept
    index tensor itself when ``keep_index`` (for the formulas), else on meta too (for the fake kernel)."""
    if _is_metadata(value):
        return torch.empty(value[0], dtype=value[1], device="meta")
    if isinstance(value, _Tensor):
        return value if keep_index else torch.empty_like(value, device="meta")
    if isinstance(value, tuple):
        return [_on_meta(v, keep_index) for v in value]
    return value


def _hashable(value):
    if isinstance(value, _Tensor):
        return value.shape, value.dtype, tuple(value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _shapes_dtypes_arguments(meta: tuple) -> tuple[list, list, list]:
    """The tensor arguments' shapes and dtypes, and the other arguments given (not None), in order."""
    shapes, dtypes, others = [], [], []
    for value in meta or ():  # None: recorded without shapes
        items = value if isinstance(value, tuple) and value and all(
            _is_metadata(v) or isinstance(v, _Tensor) for v in value) else (value,)
        for item in items:
            if isinstance(item, _Tensor):
                item = tuple(item.shape), item.dtype
            if _is_metadata(item):
                shapes.append(list(item[0]))
                dtypes.append(str(item[1]).removeprefix("torch."))
            elif item is not None:
                others.append(list(item) if isinstance(item, tuple) else item)
    return shapes, dtypes, others


class Telemetry:
    """Always-on op telemetry: a bounded ring of every ``torch_kernels`` op call, read on demand.

    Started by :meth:`profile.continuous` (or ``TORCH_KERNELS_TELEMETRY=1`` at import); see there.
    Each call adds one record: the op, the backends that ran it, the tensor arguments' shapes and
    dtypes, the other arguments, and its start and end on the host clock, or on an accelerator two
    device events recorded around the call on the current stream, read only when a snapshot is
    taken (no sync per call). FLOPs and bytes are worked out at snapshot time from the recorded
    shapes (the op's formulas on meta tensors, once per distinct signature). Formulas that read
    tensor values (expert offsets, sequence lengths) read the integer tensors of at most
    ``INDEX_NUMEL`` elements, which the record keeps (a snapshot copies them to the host; a caller
    that overwrites one in place before the snapshot gets the cost of the new values); where such a
    tensor is larger, the formula cannot run on its shape alone and the cost is ``None``.

    Args:
        seconds: the window a snapshot reads by default; older calls are dropped when one is taken.
        max_events: the most calls the ring holds (the oldest go first), which bounds its memory.
        shapes: record the arguments (shapes, dtypes, the rest) for the shapes column and the costs;
            ``False`` records op, backend and time only, for the least cost per call.
    """

    def __init__(self, seconds: float = 90.0, max_events: int = 100_000, shapes: bool = True):
        if not seconds > 0:
            raise ValueError(f"seconds: expected a positive window, got {seconds}")
        if not (isinstance(max_events, int) and max_events > 0):
            raise ValueError(f"max_events: expected a positive int, got {max_events!r}")
        self.seconds = float(seconds)
        self.max_events = max_events
        self.shapes = bool(shapes)
        self._ring: collections.deque = collections.deque(maxlen=max_events)
        self._kernels = None
        self._costs: dict[tuple, tuple[int | None, int | None]] = {}
        self._describers: dict[str, list[Callable[[tuple], tuple | None]]] = {}
        self._clock_offset = time.time() - time.perf_counter()  # host clock -> Unix time

    @property
    def running(self) -> bool:
        """Whether this telemetry is recording."""
        return _telemetry is self

    def _start(self) -> Telemetry:
        global _telemetry
        with _active_lock:
            if _active is not None:
                raise RuntimeError("torch_kernels.profile.continuous: start the telemetry outside a profile block")
            previous, _telemetry = _telemetry, None
            if previous is not None:
                previous._release()
            front = self._recording if self.shapes and _guard_maker() is not None else None
            self._kernels = _library.kernels_replaced_by(self._recording, front)
            self._kernels.__enter__()
            _telemetry = self
        _set_observer()
        return self

    def stop(self) -> None:
        """Stop recording (the ring stays readable); the ops run exactly as defined again."""
        global _telemetry
        with _active_lock:
            if _telemetry is self:
                _telemetry = None
            self._release()
        _set_observer()

    def _release(self) -> None:
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self._kernels = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _recording(self, op: torch._ops.OpOverload, kernel: Callable, autograd: Callable | None = None) -> Callable:
        """``kernel`` adding a record of each call to the ring: the hot path, kept to a few lookups. With
        ``autograd`` (the autograd kernel over the recording ``kernel``), the autograd key's kernel instead,
        which records the calls the autograd kernel would hand straight to the kernel (plain tensors needing
        no gradient, which a probe of ``_describer`` checks in C) around the kernel itself, and hands the
        others to ``autograd``: so such a call costs one Python frame, not two, and on a probe's match no
        per-tensor check in Python."""
        name = op._opname
        front = autograd is not None
        if not front:
            self._describers[name] = _describer(op) if self.shapes else None
        describer = self._describers[name]
        host_only = not torch.accelerator.is_available()  # then every tensor is on the CPU
        append = self._ring.append
        clock = time.perf_counter
        tensor_positions = [i for i, a in enumerate(op._schema.arguments) if isinstance(a.type, torch.TensorType)]
        first = tensor_positions[0] if tensor_positions else None
        running = _running
        dispatch_modes = _library._dispatch_modes

        # the dispatcher passes every argument positionally (no op's schema has keyword-only ones, which
        # _library's autograd kernel does not take either); a record holds strings, floats and plain tuples
        # only, which the garbage collector stops tracking (see _describer)
        def recorded(*args):
            if front:
                if dispatch_modes() or (meta := describer[1](args)) is None:
                    return autograd(*args)
            else:
                meta = None if describer is None else describer[0](args)
            calls = running.calls
            calls.append("")
            if host_only or first is None or args[first].is_cpu:
                start = clock()
                try:
                    out = kernel(*args)
                finally:
                    ran = calls.pop()
                end = clock()
                timing = None
            else:  # device events around the call, read when a snapshot is taken: no sync here
                device = args[first].device
                begin, stop = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
                start = clock()
                begin.record()
                try:
                    out = kernel(*args)
                finally:
                    ran = calls.pop()
                stop.record()
                end = clock()
                timing = device, begin, stop, None
            append((name, start, end, ran, meta, None, timing))
            return out

        recorded.__name__ = f"{name}_recorded"
        return recorded

    def _add_profiled(self, call: _Call, args: tuple) -> None:
        """A call a profile block timed (its kernels replace these while it runs), costs included."""
        now = time.perf_counter()
        timing = None if call.device.type == "cpu" else (call.device, call.timer.begin, call.timer.end, call)
        start = call.timer.begin if timing is None else now
        end = call.timer.end if timing is None else now
        self._ring.append((call.op, start, end, call.backends, tuple(_metadata(a) for a in args), None, timing))

    def _cost(self, name: str, meta: list, kwargs: dict | None) -> tuple[int | None, int | None]:
        key = (name, _hashable(meta), _hashable(sorted((kwargs or {}).items())))
        known = self._costs.get(key)
        if known is None:
            if len(self._costs) >= COST_MEMO:  # bounded too: a long run may see many distinct shapes
                self._costs.clear()
            known = self._costs[key] = _cost_on_meta(name, meta, kwargs or {})
        return known

    def events(self, seconds: float | None = None) -> list[dict]:
        """The raw records of the calls that ended in the last ``seconds`` (default: the window), oldest
        first, each a dict: op, backend, device, start (Unix time), seconds, the tensor arguments' shapes and
        dtypes, the other arguments given (``arguments``), flops, bytes.
        Calls whose device work has not finished yet are left out (a later snapshot has them)."""
        window = self.seconds if seconds is None else seconds
        cutoff = time.perf_counter() - window
        while True:  # drop the calls past the window for good; another thread may be dropping them too
            try:
                if self._ring[0][2] >= time.perf_counter() - self.seconds:
                    break
                self._ring.popleft()
            except IndexError:
                break
        names: dict = {}
        rows = []
        for name, start, end, ran, meta, kwargs, timing in list(self._ring):
            if end < cutoff:
                continue
            if timing is None:
                device, seconds_taken = "cpu", end - start
            else:
                device, begin, stop, profiled = timing
                if not stop.query():
                    continue
                seconds_taken = begin.elapsed_time(stop) / 1e3
            if device not in names:
                names[device] = device_name(device)
            shapes, dtypes, others = _shapes_dtypes_arguments(meta)
            if timing is not None and timing[3] is not None:
                flops, nbytes = timing[3].flops, timing[3].bytes
            else:
                flops, nbytes = self._cost(name, meta, dict(kwargs) if kwargs else None)
            rows.append({"op": name, "backend": ran or NO_KERNEL, "device": names[device],
                         "start": start + self._clock_offset, "seconds": seconds_taken, "shapes": shapes,
                         "dtypes": dtypes, "arguments": others, "flops": flops, "bytes": nbytes})
        return rows

    def snapshot(self, seconds: float | None = None, calibrate: bool = False) -> Snapshot:
        """The last ``seconds`` (default: the whole window) as a :class:`Snapshot`: ``print()`` it for the
        table :class:`profile` prints, ``.rows`` for that table's rows, ``.events`` for the raw records,
        ``.export_chrome_trace(path)`` for a Chrome trace. ``calibrate``: fractions of the device's peaks
        (:func:`calibrate_device`, measured the first time a device is seen)."""
        return Snapshot(self.events(seconds), calibrate)


def _cost_on_meta(name: str, meta: list, kwargs: dict) -> tuple[int | None, int | None]:
    definition, cost = _library._definitions.get(name), _library.cost_of(name)
    if definition is None or cost is None or meta is None:
        return None, None
    try:
        with _library._below_autograd():  # to the op's fake kernel, not the recording one
            out = definition.op(*[_on_meta(value, False) for value in meta], **kwargs)
    except Exception:  # noqa: BLE001 - an output the fake kernel cannot size from shapes alone
        out = None
    bound = _library.bind_arguments(definition.op, tuple(_on_meta(value, True) for value in meta), kwargs)
    values = []
    for formula in (cost.flops, cost.bytes):
        try:
            values.append(int(formula(bound, out)))
        except Exception:  # noqa: BLE001 - a formula that reads tensor values
            values.append(None)
    return values[0], values[1]


class Snapshot:
    """What :meth:`Telemetry.snapshot` returns: the calls of a time window as a table, rows, raw
    records (``events``) and a Chrome trace."""

    def __init__(self, events: list[dict], calibrate: bool = False):
        self.events = events
        self.peaks: dict[str, DevicePeaks] = {}
        if calibrate:
            for device in {e["device"] for e in events}:
                self.peaks[device] = calibrate_device(_device_named(device))
        self.rows = summarize(((e["op"], e["backend"], e["device"], e["seconds"], e["flops"], e["bytes"])
                               for e in events), self.peaks)

    def table(self) -> str:
        """The rows as the text table ``print(profile)`` shows."""
        return format_table(self.rows, self.peaks, "torch_kernels telemetry")

    def __str__(self) -> str:
        return self.table()

    def chrome_trace(self) -> dict:
        """The calls as Chrome trace events (``chrome://tracing``, Perfetto), one track per device."""
        devices = {name: i for i, name in enumerate(dict.fromkeys(e["device"] for e in self.events))}
        trace = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
                 for name, pid in devices.items()]
        trace += [{"name": f"torch_kernels::{e['op']}[{e['backend']}]", "ph": "X", "pid": devices[e["device"]],
                   "tid": 0, "ts": e["start"] * 1e6, "dur": e["seconds"] * 1e6,
                   "args": {key: e[key] for key in ("shapes", "dtypes", "flops", "bytes")}} for e in self.events]
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write :meth:`chrome_trace` to ``path`` as JSON."""
        pathlib.Path(path).write_text(json.dumps(self.chrome_trace()))


def _device_named(name: str) -> torch.device:
    return torch.device(name.split(":", 1)[0])


def continuous(seconds: float = 90.0, max_events: int = 100_000, shapes: bool = True) -> Telemetry:
    """Turn the always-on telemetry on: every ``torch_kernels`` op call from now on is recorded in a
    ring of at most ``max_events`` calls, of which a snapshot reads the last ``seconds``.

    >>> telemetry = torch_kernels.profile.continuous(seconds=90)
    >>> ...                                   # serve, train
    >>> print(telemetry.snapshot(10))         # the last 10 s, as the profile table

    Memory stays bounded however long it runs: the ring drops its oldest calls, and a record holds
    shapes, not tensors, but for small integer tensors (at most ``INDEX_NUMEL`` elements each, see
    :class:`Telemetry`), usually the same few objects shared by many calls. Per op call on the CPU
    it costs about 0.5 us on a busy 2-core machine (benchmarks/telemetry.py), however many tensor
    arguments, where the call's signature (shapes, dtypes, other arguments) is one of the op's last
    few (``SIGNATURE_PROBES``, see ``_describer``) and no gradient is needed; about 1 us in
    ``torch.inference_mode()`` (recorded at the device key: one Python frame more); 1 to 2 us for
    other signatures and with gradients (the shapes read in Python). ``shapes=False`` records op,
    backend and time only (so no FLOPs or bytes), for about 0.5 us. On accelerators it adds two
    device events per call and never syncs. Off, it costs nothing: the ops run exactly as
    defined, and backends.dispatch checks one flag. A second call replaces the running telemetry;
    ``TORCH_KERNELS_TELEMETRY=1`` calls it with the defaults at import. A profile block started
    while it runs feeds it too; start it outside one. Ops are the ones defined when it
    starts.
    """
    return Telemetry(seconds, max_events, shapes)._start()


def telemetry() -> Telemetry | None:
    """The running telemetry (:func:`continuous`), or None."""
    return _telemetry


def snapshot(seconds: float | None = None, calibrate: bool = False) -> Snapshot:
    """The running telemetry's :meth:`Telemetry.snapshot`; a RuntimeError when it is off."""
    if _telemetry is None:
        raise RuntimeError("torch_kernels.profile.snapshot: the telemetry is off (torch_kernels.profile.continuous())")
    return _telemetry.snapshot(seconds, calibrate)


profile.continuous = staticmethod(continuous)
profile.snapshot = staticmethod(snapshot)
profile.telemetry = staticmethod(telemetry)


def summarize(calls: Iterable[tuple], peaks: dict[str, DevicePeaks]) -> list[dict]:
    """The table's rows, slowest first, from ``(op, backend, device name, seconds, flops, bytes)`` per call
    (flops or bytes ``None`` where unknown): one row per op, backend and device, with achieved rates and
    their fractions of ``peaks[device name]`` where given."""
    groups: dict[tuple[str, str, str], dict] = {}
    for op, backend, device, seconds, flops, nbytes in calls:
        row = groups.setdefault((op, backend, device), {
            "op": op, "backend": backend, "device": device, "calls": 0, "seconds": 0.0, "flops": 0, "bytes": 0})
        row["calls"] += 1
        row["seconds"] += seconds
        for key, value in (("flops", flops), ("bytes", nbytes)):
            row[key] = None if value is None or row[key] is None else row[key] + value
    rows = []
    for row in sorted(groups.values(), key=lambda r: -r["seconds"]):
        device_peaks = peaks.get(row["device"])
        flops_per_s, bytes_per_s = _ratio(row["flops"], row["seconds"]), _ratio(row["bytes"], row["seconds"])
        rows.append({**row, "mean_seconds": row["seconds"] / row["calls"],
                     "flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s,
                     "peak_flops_fraction": _ratio(flops_per_s, device_peaks and device_peaks.flops_per_s),
                     "peak_bandwidth_fraction": _ratio(bytes_per_s, device_peaks and device_peaks.bytes_per_s)})
    return rows


def format_table(rows: list[dict], peaks: dict[str, DevicePeaks], title: str) -> str:
    """``rows`` (:func:`summarize`'s) as the text table ``print(profile)`` shows, each device's peaks above it."""
    if not rows:
        return f"{title}: no torch_kernels op ran"
    devices = list(dict.fromkeys(row["device"] for row in rows))
    lines = [f"{title}: {sum(r['calls'] for r in rows)} op calls"]
    for device in devices:
        device_peaks = peaks.get(device)
        lines.append(f"  {device}: " + ("peaks not calibrated" if device_peaks is None else
                     f"peaks {device_peaks.flops_per_s / 1e9:,.1f} GFLOP/s ({device_peaks.matmul_dtype} matmul), "
                     f"{device_peaks.bytes_per_s / 1e9:,.1f} GB/s (copy)"))
    tera = max((r["flops_per_s"] or 0) for r in rows) >= 1e12
    unit, scale = ("TFLOP/s", 1e12) if tera else ("GFLOP/s", 1e9)
    header = ["op", "backend", *(["device"] if len(devices) > 1 else []), "calls", "total ms", "mean us",
              unit, "GB/s", "% peak FLOP/s", "% peak GB/s"]

    def number(value, factor, digits):
        return "-" if value is None else f"{value * factor:,.{digits}f}"

    body = [[r["op"], r["backend"], *([r["device"]] if len(devices) > 1 else []), str(r["calls"]),
             number(r["seconds"], 1e3, 3), number(r["mean_seconds"], 1e6, 1),
             number(r["flops_per_s"], 1 / scale, 3), number(r["bytes_per_s"], 1e-9, 3),
             number(r["peak_flops_fraction"], 100, 1), number(r["peak_bandwidth_fraction"], 100, 1)]
            for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    text_columns = 3 if len(devices) > 1 else 2
    for line in [header, *body]:
        lines.append("  ".join(cell.ljust(w) if i < text_columns else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip())
    return "\n".join(lines)
