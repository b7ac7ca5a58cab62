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
