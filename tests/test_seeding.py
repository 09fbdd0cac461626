"""The test suite's own reproducibility (tests/conftest.py): every test starts from Python's,
NumPy's and torch's global generators seeded from its node id, whatever ran before it."""
import random
import zlib

import numpy as np
import pytest
import torch


def draws():
    return random.random(), float(np.random.random()), float(torch.rand(()))


def reseed(nodeid):
    seed = zlib.crc32(nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("case", ["a", "b"])
def test_each_test_starts_from_generators_seeded_by_its_node_id(request, case):
    first = draws()
    reseed(request.node.nodeid)
    assert draws() == first
    # and two tests get different draws: the seed is the test's, not one fixed number for all
    reseed(request.node.nodeid.replace(f"[{case}]", "[b]" if case == "a" else "[a]"))
    assert draws() != first
