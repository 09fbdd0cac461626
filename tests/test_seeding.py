"""The test suite's own reproducibility (tests/conftest.py): every test starts from Python's,
NumPy's and torch's global generators seeded from its node id, whatever ran before it."""
import random

import numpy as np
import pytest
import torch

from conftest import seed_global_generators


def draws():
    return random.random(), float(np.random.random()), float(torch.rand(()))


@pytest.mark.parametrize("case", ["a", "b"])
def test_each_test_starts_from_generators_seeded_by_its_node_id(request, case):
    first = draws()
    seed_global_generators(request.node.nodeid)
    assert draws() == first
    # and two tests get different draws: the seed is the test's, not one fixed number for all
    seed_global_generators(request.node.nodeid.replace(f"[{case}]", "[b]" if case == "a" else "[a]"))
    assert draws() != first
