"""Where every launcher picks its kernel's config: the heuristic, unless a tuner is installed.

A launcher calls :func:`choose` with its kernel's name, the sizes and dtypes that its config
depends on (``key``), its heuristic (``default``), its config space (``candidates``) and ``run``,
a zero-argument call of the launcher itself with the same inputs. With no tuner installed (this
package alone) ``choose`` returns the heuristic. A tuner (``torch_kernels.autotune`` installs one)
may answer from a cache or search: it times ``run()`` while :func:`forcing` makes ``choose``
return one candidate for that kernel, and every other kernel launched meanwhile gets its cached
config or heuristic (:func:`searching` tells a tuner not to start a second search inside one).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Callable, Iterable, TypeVar

Config = TypeVar("Config")
Tuner = Callable[..., object]  # (kernel, device, key, default, candidates, run) -> config

_tuner: Tuner | None = None
_forced: contextvars.ContextVar[dict] = contextvars.ContextVar("forced_configs", default={})


def install(tuner: Tuner | None) -> Tuner | None:
    """Make ``tuner`` answer every :func:`choose` (None: the heuristics); returns the previous one."""
    global _tuner
    previous, _tuner = _tuner, tuner
    return previous


def choose(kernel: str, device, key: dict, default: Callable[[], Config],
           candidates: Callable[[], Iterable[Config]], run: Callable[[], object]) -> Config:
    """The config of ``kernel``'s launch on ``device`` for ``key`` (sizes and dtypes; the module
    docstring says what the other arguments are)."""
    forced = _forced.get()
    if kernel in forced:
        return forced[kernel]
    if _tuner is None:
        return default()
    return _tuner(kernel, device, key, default, candidates, run)


def searching() -> bool:
    """Whether a search is timing some kernel's candidates in this context right now."""
    return bool(_forced.get())


@contextlib.contextmanager
def forcing(kernel: str, config):
    """Inside: :func:`choose` returns ``config`` for ``kernel``."""
    token = _forced.set({**_forced.get(), kernel: config})
    try:
        yield
    finally:
        _forced.reset(token)


def space(default: Config, keep: Callable[[Config], bool] | None = None, **choices: Iterable) -> list[Config]:
    """``default`` first, then ``default`` with every combination of ``choices`` (field -> values),
    without repeats and without those that ``keep`` rejects (constraints a launch must meet)."""
    configs = [default]
    names = list(choices)
    for values in itertools.product(*(choices[name] for name in names)):
        config = dataclasses.replace(default, **dict(zip(names, values)))
        if config not in configs and (keep is None or keep(config)):
            configs.append(config)
    return configs
