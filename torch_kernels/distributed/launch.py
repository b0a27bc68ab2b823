"""Run a function on several local processes joined in one ``torch.distributed`` process group.

For tests, benchmarks and the disaggregated demo on one machine (gloo over a file store, so
nothing listens on a network port); a cluster launches its ranks with ``torchrun`` instead.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """One or more ranks raised or did not finish; ``errors`` maps each such rank to its story."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))


def _entry(fn, rank, world_size, args, store, backend, timeout, threads, results):
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def run_local(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, threads: int = 1) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process.

    ``fn`` must be importable (a module-level function). The group's collectives time out after
    ``timeout`` seconds, so a rank waiting on a dead peer fails with its own error; a rank that
    sends no news for ``2 * timeout + 30`` seconds is killed. Raises :class:`RankFailed` with every
    failing rank's traceback.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = "file://" + os.path.join(folder, "store")
        processes = [context.Process(target=_entry, args=(fn, rank, world_size, args, store, backend, timeout, threads,
                                                          results), daemon=True) for rank in range(world_size)]
        for process in processes:
            process.start()
        values, errors = {}, {}
        patience = 2 * timeout + 30
        deadline = time.monotonic() + patience
        while len(values) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                if time.monotonic() < deadline and any(p.is_alive() for p in processes):
                    continue
                for rank, process in enumerate(processes):
                    if rank not in values and rank not in errors:
                        errors[rank] = (f"sent no news for {patience:g} s" if process.is_alive()
                                        else f"exited with code {process.exitcode} without a result")
                break
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            deadline = time.monotonic() + patience
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    if errors:
        raise RankFailed(errors)
    return [values[rank] for rank in range(world_size)]
