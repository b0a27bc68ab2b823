"""Kernel configs tuned per device and cached (tokamax's model).

Every Triton launcher picks its config through ``triton_impl.autotune.choose``; importing
``torch_kernels`` installs :data:`autotune`, which answers each choice from, in order:

1. memory (the answers this process last gave for these exact sizes; at most ``MEMO_SIZE``);
2. the user cache ``$TORCH_KERNELS_CACHE/autotune/<device>.json`` (default
   ``~/.cache/torch_kernels/autotune``), written by searches on this machine;
3. the file shipped with the package for this device kind, ``torch_kernels/autotune_configs/<device>.json``;
4. on a miss: a search when enabled (``with torch_kernels.autotune(): ...`` or
   ``TORCH_KERNELS_AUTOTUNE=1``), else the kernel's heuristic.

Entries are keyed by kernel, size bucket (each size rounded up to a power of two) and dtype, per
device name (``torch.cuda.get_device_name`` as a slug: ``nvidia-h200``). A cached config is used
only if it is one of the kernel's candidates for the call's exact sizes, so an entry never
launches a config the call could not take. A search times each candidate with
``triton.testing.do_bench`` on the call's own inputs, skips a candidate that raises (out of
shared memory) or whose output disagrees with the heuristic's, keeps the fastest, and writes the
user cache atomically. A miss or a failed search never fails the call: it falls back to the
heuristic. Searches never run on CPU tensors (the Triton interpreter), nor while a CUDA graph is
being captured. ``TORCH_KERNELS_AUTOTUNE=0`` ignores every cache: heuristics only. Memory stays
bounded while serving: answers and misses are remembered for at most ``MEMO_SIZE`` exact sizes each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import re
import threading
import warnings

import torch

from ._cache import cache_dir, read_json, write_json
from ._library import _tensors

ENV_VAR = "TORCH_KERNELS_AUTOTUNE"
FORMAT = 1
SHIPPED = pathlib.Path(__file__).with_name("autotune_configs")
MEMO_SIZE = 4096
_hook = None  # triton_impl.autotune, where the tuner is installed (None without Triton)


@functools.cache
def device_name(device: torch.device) -> str:
    """The device's name as a file name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``; ``"cpu"`` for CPU."""
    module = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(module, "get_device_name"):
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", module.get_device_name(device).lower()).strip("-")


def entry_key(kernel: str, key: dict) -> str:
    """A cache entry's name: ``kernel|size=bucket,...,dtype=name`` (ints rounded up to a power of two)."""
    def bucket(value):
        if isinstance(value, (tuple, list)):
            return "x".join(map(str, value))
        if isinstance(value, bool) or not isinstance(value, int):
            return str(value).removeprefix("torch.")
        return 0 if value <= 0 else 1 << (value - 1).bit_length()

    return kernel + "|" + ",".join(f"{name}={bucket(value)}" for name, value in key.items())


def _do_bench(run, config) -> float:
    import triton.testing

    return triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")


def _agree(output, expected) -> bool:
    """Whether every floating tensor of ``output`` matches ``expected``'s: the same non-finite
    entries, the rest within a relative (Frobenius) error of 1e-4 for float32, 2e-2 for 16 bits."""
    outputs, expecteds = list(_tensors(output)), list(_tensors(expected))
    if len(outputs) != len(expecteds):
        return False
    for got, want in zip(outputs, expecteds):
        if got.shape != want.shape:
            return False
        if not want.is_floating_point():
            continue  # indices (a nearest class) may differ on ties
        tolerance = 1e-4 if want.dtype in (torch.float32, torch.float64) else 2e-2
        got, want = got.double(), want.double()
        finite = torch.isfinite(want)
        special_got, special_want = got[~finite], want[~finite]
        if not (torch.equal(finite, torch.isfinite(got))
                and bool(((special_got == special_want) | (special_got.isnan() & special_want.isnan())).all())):
            return False
        difference = torch.linalg.vector_norm(got[finite] - want[finite])
        if difference > tolerance * torch.linalg.vector_norm(want[finite]):
            return False
    return True


def _remember(answers: dict, exact: tuple, value) -> None:
    """``answers[exact] = value``, the oldest answer dropped past ``MEMO_SIZE``: a server sees ever
    new token and sequence counts, and the files' size buckets need no more."""
    if len(answers) >= MEMO_SIZE:
        answers.pop(next(iter(answers)), None)
    answers[exact] = value


class Autotune:
    """The tuner ``torch_kernels`` installs (as :data:`autotune`); the module docstring says what
    it does. ``autotune()`` is a context manager turning the search on for the calls inside."""

    def __init__(self, cache_dir: pathlib.Path | str | None = None, shipped_dir: pathlib.Path | str = SHIPPED,
                 timer=_do_bench, search_interpreted: bool = False):
        """``cache_dir``: the user cache (None: under ``$TORCH_KERNELS_CACHE``); ``timer(run,
        config)``: milliseconds of ``run()``; ``search_interpreted``: search on CPU tensors too
        (tests, with a stubbed timer)."""
        self._cache_dir = None if cache_dir is None else pathlib.Path(cache_dir)
        self._shipped_dir = pathlib.Path(shipped_dir)
        self._timer = timer
        self._search_interpreted = search_interpreted
        self._searching = False  # inside `with autotune():`
        self._lock = threading.RLock()
        self.clear()

    # ---- public ----

    @contextlib.contextmanager
    def __call__(self, enabled: bool = True):
        """Inside: a cache miss searches (``enabled``) or takes the heuristic (``enabled=False``)."""
        with self._lock:
            previous, self._searching = self._searching, enabled
        try:
            yield self
        finally:
            with self._lock:
                self._searching = previous

    def clear(self) -> None:
        """Forget every answer and cache file read; the next call reads the files again."""
        with self._lock:
            self._memo: dict = {}  # (kernel, device, exact key) -> config, at most MEMO_SIZE, oldest first
            self._misses: dict = {}  # (kernel, device, exact key) with no usable cache entry, at most MEMO_SIZE
            self._tables: dict[str, dict] = {}  # device -> entry -> record: shipped, then user cache
            self._found: dict[str, dict] = {}  # device -> entry -> record: this process's searches

    def entries(self, device: str | None = None) -> dict:
        """This process's search results: ``{device: {entry: record}}`` (or one device's)."""
        with self._lock:
            found = {name: dict(records) for name, records in self._found.items()}
        return found.get(device, {}) if device is not None else found

    def save(self, path: pathlib.Path | str) -> list[pathlib.Path]:
        """Write every config this process found, one ``<device>.json`` per device, to the folder
        ``path`` (merged into a file already there), ready to ship in ``torch_kernels/autotune_configs``.
        Returns the files written."""
        folder = pathlib.Path(path)
        return [self._write(folder / f"{name}.json", name, records) for name, records in self.entries().items()]

    def export(self, device: torch.device | str, path: pathlib.Path | str) -> pathlib.Path:
        """Write ``device``'s whole user cache (every search on this machine, by any process; empty
        if none) to ``<path>/<device name>.json``, merged into a file already there. Returns it."""
        name = device_name(torch.device(device))
        return self._write(pathlib.Path(path) / f"{name}.json", name, _read(self.cache_path(name)))

    def cache_path(self, device: str) -> pathlib.Path:
        """The user cache file of ``device`` (a :func:`device_name`)."""
        return (self._cache_dir or cache_dir("autotune")) / f"{device}.json"

    # ---- the hook: triton_impl.autotune.choose ----

    def choose(self, kernel, device, key, default, candidates, run):
        """``kernel``'s config for this call (the module docstring's lookup order)."""
        mode = os.environ.get(ENV_VAR, "")
        if mode == "0":
            return default()
        exact = (kernel, device, tuple(key.items()))
        config = self._memo.get(exact)
        if config is not None:
            return config
        if exact not in self._misses:
            name, entry = device_name(device), entry_key(kernel, key)
            record = self._table(name).get(entry)
            config = None if record is None else _match(record.get("config"), default, candidates)
            if config is not None:
                _remember(self._memo, exact, config)
                return config
            if record is not None:
                warnings.warn(f"autotune: the cached config of {entry} on {name} is not one of its candidates; "
                              "using the heuristic", stacklevel=2)
            _remember(self._misses, exact, True)
        if not self._may_search(device, mode):
            return default()
        name, entry = device_name(device), entry_key(kernel, key)
        config, record = self._search(kernel, entry, default, candidates, run)
        if record is None:  # nothing to keep: the heuristic, with no second search
            _remember(self._memo, exact, config)
            return config
        with self._lock:
            _remember(self._memo, exact, config)
            self._table(name)[entry] = record
            self._found.setdefault(name, {})[entry] = record
        try:
            self._write(self.cache_path(name), name, {entry: record})
        except OSError as error:
            warnings.warn(f"autotune: could not write {self.cache_path(name)}: {error}", stacklevel=2)
        return config

    # ---- internals ----

    def _may_search(self, device, mode: str) -> bool:
        if not (self._searching or mode == "1") or _hook.searching():
            return False
        if device.type == "cpu":
            return self._search_interpreted
        return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _search(self, kernel, entry, default, candidates, run):
        """(fastest config, its cache record); (heuristic, None) when nothing could be timed."""
        heuristic = default()
        try:
            with _hook.forcing(kernel, heuristic):
                expected = run()
        except Exception:  # the call itself fails: let it fail as it would untuned
            return heuristic, None
        timings = []
        for config in _unique([heuristic, *candidates()]):
            with _hook.forcing(kernel, config):
                try:
                    if not _agree(run(), expected):
                        warnings.warn(f"autotune: {entry}: {config} disagrees with the heuristic; skipped",
                                      stacklevel=3)
                        continue
                    timings.append((self._timer(run, config), config))
                except Exception:  # out of resources, or a config the kernel rejects
                    continue
        timings = [(ms, config) for ms, config in timings if math.isfinite(ms)]
        if not timings:
            warnings.warn(f"autotune: {entry}: no candidate could be timed; using the heuristic", stacklevel=3)
            return heuristic, None
        ms, best = min(timings, key=lambda timing: timing[0])
        heuristic_ms = next((t for t, config in timings if config == heuristic), None)
        return best, {"config": dataclasses.asdict(best), "ms": ms, "heuristic_ms": heuristic_ms}

    def _table(self, name: str) -> dict:
        table = self._tables.get(name)
        if table is None:
            with self._lock:
                table = {**_read(self._shipped_dir / f"{name}.json"), **_read(self.cache_path(name))}
                self._tables[name] = table
        return table

    def _write(self, path: pathlib.Path, name: str, records: dict) -> pathlib.Path:
        """Merge ``records`` into the cache file ``path`` and replace it atomically."""
        with self._lock:
            merged = {**_read(path, quiet=True), **records}
            write_json(path, {"format": FORMAT, "device": name, "configs": dict(sorted(merged.items()))})
        return path


def _read(path: pathlib.Path, quiet: bool = False) -> dict:
    """The entries of the cache file ``path`` ({} if there is none); a file that is not one is
    ignored with a warning."""
    contents = read_json(path, "cache file", quiet)
    if contents is None:
        return {}
    configs = contents.get("configs") if isinstance(contents, dict) else None
    if (not isinstance(configs, dict) or contents.get("format") != FORMAT
            or not all(isinstance(record, dict) and isinstance(record.get("config"), dict) for record in configs.values())):
        if not quiet:
            warnings.warn(f"autotune: ignoring {path}: not an autotune cache of format {FORMAT}", stacklevel=2)
        return {}
    return configs


def _match(fields, default, candidates):
    """The config among the heuristic and the candidates whose fields are ``fields``, or None."""
    if not isinstance(fields, dict):
        return None
    heuristic = default()
    for config in (heuristic, *candidates()):
        if type(config) is type(heuristic) and dataclasses.asdict(config) == fields:
            return config
    return None


def _unique(configs) -> list:
    unique = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


autotune = Autotune()


def _install() -> None:
    global _hook
    try:
        from triton_impl import autotune as hook
    except ImportError:  # no Triton here: no launcher to answer
        return
    _hook = hook
    hook.install(autotune.choose)


_install()
