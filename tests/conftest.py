import os
import random
import sys
import zlib

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _restore_thread_count():
    """A test may run on one thread (torch.set_num_threads(1)); the next test gets the usual count
    back, so that no test passes or fails by the thread count an earlier one left behind."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    """Every test starts from Python's, NumPy's and torch's global generators seeded from its own
    name. Without this, a test that draws from them without seeding got whatever state the tests
    before it in the same worker left, and pytest-xdist shares the tests out differently from run to
    run: a draw that fails about once in twenty runs failed CI at random and passed alone. Now a
    test's draws are the same in every run, alone or not, and a failure reproduces with
    `pytest <its node id>`. Tests that need other draws seed their own generators."""
    seed_global_generators(request.node.nodeid)


def seed_global_generators(nodeid: str) -> None:
    """Seed Python's, NumPy's and torch's global generators from a test's node id (crc32)."""
    seed = zlib.crc32(nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
