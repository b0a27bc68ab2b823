import itertools
import os
import sys

# The project is importable from a clone without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402  (after the path set-up above)


def _share_the_cores_between_workers() -> None:
    """One xdist worker per core gets one intra-op thread: two workers of two threads each on two
    cores spin in each other's way (the SmolLM2 serving tests ran several times slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the tests' subprocesses too


_share_the_cores_between_workers()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once per test process; the tests
    that use it run in one process (below). Skips where the model is missing, fails in CI."""
    import torch

    from harness import REQUIRE_ALL
    from torch_kernels import models

    reason = models.missing_reason()
    if reason is not None:
        (pytest.fail if REQUIRE_ALL else pytest.skip)(reason)
    return models.load_smollm2(torch.float32)


FULL_MATRIX = os.environ.get("TORCH_KERNELS_FULL_MATRIX") == "1"
# where a kernel runs under an interpreter (Triton's, Pallas interpret mode, SYCL on the CPU) a call
# costs seconds; the reference runs every combination
INTERPRETED = ("triton", "pallas", "sycl")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "covering(strength=2): on the interpreted backends, run a covering share of this test's other "
                   "parameters (every combination of `strength` of their values at least once: every pair by "
                   "default); TORCH_KERNELS_FULL_MATRIX=1 runs every combination")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups (else the model loads in each worker)
def pytest_collection_modifyitems(items):
    # with --dist loadgroup, tests of one xdist group share a worker: SmolLM2 is loaded once
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smollm2"))
    if not FULL_MATRIX:
        _skip_outside_covering_shares(items)


def _skip_outside_covering_shares(items) -> None:
    """Skip, on each interpreted backend, the combinations of a ``covering`` test outside a greedy
    covering set: with strength 2, every value of every parameter and every pair of values of two
    parameters still runs on that backend."""
    groups: dict[tuple, list] = {}
    for item in items:
        marker = item.get_closest_marker("covering")
        if marker is None or not hasattr(item, "callspec"):
            continue
        backend = item.callspec.params.get("backend")
        if backend is not None and backend not in INTERPRETED:
            continue
        # one id per parametrize decorator: arguments parametrized together ("dtype, cache_dtype") are one
        # parameter, whose rows are covered as written
        ids = list(item.callspec._idlist)
        if backend is not None:
            ids.remove(backend)
        values = tuple(enumerate(ids))
        strength = marker.kwargs.get("strength", 2)
        groups.setdefault((item.originalname, item.path, backend, strength), []).append((item, values))
    for (_, _, backend, strength), members in groups.items():
        for item in _outside_covering_share(members, strength):
            item.add_marker(pytest.mark.skip(
                reason=f"outside CI's covering share of this test's parameters on {backend or 'this backend'} "
                       "(TORCH_KERNELS_FULL_MATRIX=1 runs every combination)"))


def _outside_covering_share(members: list, strength: int) -> list:
    """The items not needed to cover every combination of ``strength`` parameter values, chosen
    greedily (the one covering most of what is left, the first of equals)."""
    def combinations(values):
        return {c for n in range(1, strength + 1) for c in itertools.combinations(values, n)}

    covers = [combinations(values) for _, values in members]
    uncovered = set().union(*covers)
    chosen = set()
    while uncovered:
        best = max(range(len(members)), key=lambda i: len(covers[i] & uncovered))
        chosen.add(best)
        uncovered -= covers[best]
    return [item for i, (item, _) in enumerate(members) if i not in chosen]
