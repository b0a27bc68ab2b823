"""Where torch_kernels keeps what it downloads, builds or measures: ``$TORCH_KERNELS_CACHE``
(default ``~/.cache/torch_kernels``)."""

from __future__ import annotations

import os
import pathlib


def cache_dir(*parts: str) -> pathlib.Path:
    """The cache folder, or the path ``parts`` inside it (read from the environment at each call,
    so that a test or script may point it elsewhere)."""
    root = os.environ.get("TORCH_KERNELS_CACHE") or pathlib.Path.home() / ".cache" / "torch_kernels"
    return pathlib.Path(root).joinpath(*parts)
