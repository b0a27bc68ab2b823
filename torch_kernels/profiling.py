"""The roofline in the profiler: what each op achieved against what the device can do.

``with torch_kernels.profile() as prof: ...`` runs the block under ``torch.profiler`` and, for
every call of a ``torch_kernels`` op in it, records the op, the backend that ran it, its time and
its FLOPs and bytes (the op's formulas, ``torch_kernels._library.register_cost``). ``print(prof)``
prints one row per op and backend: calls, total and mean time, achieved FLOP/s and GB/s, and
their fractions of the device's peaks, which :func:`calibrate_device` measures once per device
(copy bandwidth and matmul rate) and caches. ``prof.export_chrome_trace(path)`` (or ``trace=``)
writes the Chrome trace, where each kernel appears as ``torch_kernels::<op>[<backend>]``.

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

import dataclasses
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

__all__ = ["profile", "calibrate_device", "DevicePeaks", "device_name"]

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
    backends: list[str] = dataclasses.field(default_factory=list)
    flops: int | None = None
    bytes: int | None = None


_local = threading.local()  # each thread's stack of op calls in progress (a kernel may call another op)
_active_lock = threading.Lock()
_active: profile | None = None


def _open_calls() -> list[_Call]:
    stack = getattr(_local, "calls", None)
    if stack is None:
        stack = _local.calls = []
    return stack


def _observe(op: str, backend: str) -> None:
    stack = getattr(_local, "calls", None)
    if stack:
        stack[-1].backends.append(backend)


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
            backends._observer = _observe
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
            backends._observer = None
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

    def _timed(self, op: torch._ops.OpOverload, kernel: Callable) -> Callable:
        """``kernel`` recording each call: its time, backends and cost."""
        name = op._opname
        cost = _library.cost_of(name)
        calls = self._calls

        def timed_kernel(*args, **kwargs):
            device = _device_of(args)
            call = _Call(name, device, _Timer(device))
            stack = _open_calls()
            stack.append(call)
            try:
                out = kernel(*args, **kwargs)
            finally:
                stack.pop()
            call.timer.stop()
            if cost is not None:
                arguments = _library.bind_arguments(op, args, kwargs)
                call.flops, call.bytes = cost.flops(arguments, out), cost.bytes(arguments, out)
            calls.append(call)
            return out

        timed_kernel.__name__ = f"{name}_timed"
        return timed_kernel

    def _summarize(self) -> list[dict]:
        names = {device: device_name(device) for device in {call.device for call in self._calls}}
        if self.calibrate:
            for device, name in names.items():
                self.peaks.setdefault(name, calibrate_device(device))
        groups: dict[tuple[str, str, str], dict] = {}
        for call in self._calls:
            backend = "+".join(dict.fromkeys(call.backends)) or NO_KERNEL
            device = names[call.device]
            row = groups.setdefault((call.op, backend, device), {
                "op": call.op, "backend": backend, "device": device, "calls": 0, "seconds": 0.0,
                "flops": 0, "bytes": 0})
            row["calls"] += 1
            row["seconds"] += call.timer.seconds()
            for key in ("flops", "bytes"):
                value = getattr(call, key)
                row[key] = None if value is None or row[key] is None else row[key] + value
        rows = []
        for row in sorted(groups.values(), key=lambda r: -r["seconds"]):
            peaks = self.peaks.get(row["device"])
            flops_per_s, bytes_per_s = _ratio(row["flops"], row["seconds"]), _ratio(row["bytes"], row["seconds"])
            rows.append({**row, "mean_seconds": row["seconds"] / row["calls"],
                         "flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s,
                         "peak_flops_fraction": _ratio(flops_per_s, peaks and peaks.flops_per_s),
                         "peak_bandwidth_fraction": _ratio(bytes_per_s, peaks and peaks.bytes_per_s)})
        return rows

    def table(self) -> str:
        """The rows as a text table, slowest first, with each device's peaks above it."""
        if not self.rows:
            return "torch_kernels profile: no torch_kernels op ran"
        devices = list(dict.fromkeys(row["device"] for row in self.rows))
        lines = [f"torch_kernels profile: {sum(r['calls'] for r in self.rows)} op calls"]
        for device in devices:
            peaks = self.peaks.get(device)
            lines.append(f"  {device}: " + ("peaks not calibrated" if peaks is None else
                         f"peaks {peaks.flops_per_s / 1e9:,.1f} GFLOP/s ({peaks.matmul_dtype} matmul), "
                         f"{peaks.bytes_per_s / 1e9:,.1f} GB/s (copy)"))
        tera = max((r["flops_per_s"] or 0) for r in self.rows) >= 1e12
        unit, scale = ("TFLOP/s", 1e12) if tera else ("GFLOP/s", 1e9)
        header = ["op", "backend", *(["device"] if len(devices) > 1 else []), "calls", "total ms", "mean us",
                  unit, "GB/s", "% peak FLOP/s", "% peak GB/s"]

        def number(value, factor, digits):
            return "-" if value is None else f"{value * factor:,.{digits}f}"

        body = [[r["op"], r["backend"], *([r["device"]] if len(devices) > 1 else []), str(r["calls"]),
                 number(r["seconds"], 1e3, 3), number(r["mean_seconds"], 1e6, 1),
                 number(r["flops_per_s"], 1 / scale, 3), number(r["bytes_per_s"], 1e-9, 3),
                 number(r["peak_flops_fraction"], 100, 1), number(r["peak_bandwidth_fraction"], 100, 1)]
                for r in self.rows]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        text_columns = 3 if len(devices) > 1 else 2
        for line in [header, *body]:
            lines.append("  ".join(cell.ljust(w) if i < text_columns else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(line, widths))).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def export_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the block's Chrome trace (``chrome://tracing``, Perfetto) to ``path``."""
        if self._trace_written is not None:  # the profiler writes its trace once; later exports copy it
            shutil.copyfile(self._trace_written, path)
            return
        self.profiler.export_chrome_trace(str(path))
        self._trace_written = pathlib.Path(path).resolve()
