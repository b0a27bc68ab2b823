import os
import sys

# The project is importable from a clone without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402  (after the path set-up above)


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


def pytest_collection_modifyitems(items):
    # with --dist loadgroup, tests of one xdist group share a worker: SmolLM2 is loaded once
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smollm2"))
