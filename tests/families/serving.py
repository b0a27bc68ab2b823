"""The serving loop's bad-input rows (``Engine`` and its ``generate``): not an op family, so no
device cases."""

from __future__ import annotations

from typing import Callable

import torch

from families import Row
from harness import tiny_llama


def _engine(*, generate=None, **kwargs) -> Callable[[str], object]:
    """``Engine(tiny llama, **kwargs)``, then ``generate(*generate)`` if given."""
    def call(backend):
        from torch_kernels.serving import Engine
        engine = Engine(tiny_llama(), **{"num_blocks": 8, "block_size": 4, **kwargs}, implementation=backend)
        if generate is not None:
            return engine.generate(*generate)
    return call


SERVING = [
    ("block_size 0", "block_size", ValueError, _engine(block_size=0)),
    ("block_size negative", "block_size", ValueError, _engine(block_size=-16)),
    ("block_size 2.5", "block_size", TypeError, _engine(block_size=2.5)),
    ("num_blocks 0", "num_blocks", ValueError, _engine(num_blocks=0)),
    ("max_seqs True", "max_seqs", TypeError, _engine(max_seqs=True)),
    ("max_batched_tokens 0", "max_batched_tokens", ValueError, _engine(max_batched_tokens=0)),
    ("max_new_tokens 2.5", "max_new_tokens", TypeError, _engine(generate=([[1, 2]], 2.5))),
    ("max_new_tokens 0", "max_new_tokens", ValueError, _engine(generate=([[1, 2]], 0))),
    ("max_new_tokens per prompt", "max_new_tokens", ValueError, _engine(generate=([[1, 2], [3]], [2]))),
    ("prompts a string", "prompts", TypeError, _engine(generate=("text", 2))),
    ("a prompt a string", "prompts[0]", TypeError, _engine(generate=(["text"], 2))),
    ("token id past the vocabulary", "prompts[0]", ValueError, _engine(generate=([[1, 97]], 2))),
    ("negative token id", "prompts[1]", ValueError, _engine(generate=([[1], [-3]], 2))),
    ("float token id", "prompts[0]", TypeError, _engine(generate=([[1, 2.0]], 2))),
    ("empty prompt", "prompts[0]", ValueError, _engine(generate=([[]], 2))),
    ("float tensor prompt", "prompts[0]", TypeError, _engine(generate=([torch.tensor([1.0])], 2))),
    ("more blocks than the cache", "prompts[0]", ValueError, _engine(generate=([list(range(30))], 8))),
]


BAD_INPUTS = {"serving": [Row(*row) for row in SERVING]}
