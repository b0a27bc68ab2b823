"""Where torch_kernels keeps what it downloads, builds or measures: ``$TORCH_KERNELS_CACHE``
(default ``~/.cache/torch_kernels``)."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import warnings


def cache_dir(*parts: str) -> pathlib.Path:
    """The cache folder, or the path ``parts`` inside it (read from the environment at each call,
    so that a test or script may point it elsewhere)."""
    root = os.environ.get("TORCH_KERNELS_CACHE") or pathlib.Path.home() / ".cache" / "torch_kernels"
    return pathlib.Path(root).joinpath(*parts)


def read_json(path: pathlib.Path, what: str, quiet: bool = False):
    """The JSON in ``path``; None when there is no such file, or (with a warning naming ``what``,
    unless ``quiet``) when it cannot be read or parsed: a cache is never worth failing a call."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        if not quiet:
            warnings.warn(f"torch_kernels: ignoring the unreadable {what} {path}: {error}", stacklevel=3)
        return None


def write_json(path: pathlib.Path, data) -> None:
    """Replace ``path`` with ``data`` as JSON atomically: a concurrent reader sees the old file or
    the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
