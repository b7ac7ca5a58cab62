import sys
from pathlib import Path

import pytest
import torch

# tests/ helpers (hf_reference) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One OpenMP thread for the test: many tiny ops, where a second thread only adds hand-offs and, on
    a 2-core machine shared with other jobs, waits a scheduler quantum for a busy core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
