import os
import sys

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
