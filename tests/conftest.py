import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ helpers (hf_reference) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

# Two threads, or the cores' share of one xdist worker (`-n 2` on 2 cores: one each, so that two
# workers' OpenMP teams never wait on each other's cores); the processes tests start inherit it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)


def pytest_configure(config):
    """The suite's numbers are the CPU's (runs bit-identical to CPU references, ranks over gloo, one GPU
    nowhere assumed): on a machine with GPUs it runs with them hidden, in its worker processes too. Asked
    for alone, tests/test_cuda.py keeps them: that file is the suite of the CUDA paths."""
    if not config.args or not all(Path(arg.split("::")[0]).name == "test_cuda.py" for arg in config.args):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


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


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A small sentencepiece tokenizer with the chat format's role and thinking tokens."""
    from orthon.data.tokenizer import CHAT_TOKENS, load_tokenizer, train_sentencepiece
    from test_data_support import corpus_texts

    lines = [line for t in corpus_texts(seed=0) for line in t.split("\n") if line.strip()]
    lines += ["Q: 123*456=? A: 56088", "```python tool_name=calculator", "print(123*456)", "```"] * 5
    path = train_sentencepiece(lines, tmp_path_factory.mktemp("tok") / "chat.model", 600,
                               special_tokens=CHAT_TOKENS, seed=0, threads=1)
    return load_tokenizer(path)
