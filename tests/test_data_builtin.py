import json
import random
import re

import pytest

from orthon.data.arithmetic import check_answer, extract_answer, format_example, make_document, make_problem
from orthon.data.builtin import prepare_builtin, stdlib_sources
from orthon.data.config import BuiltinConfig
from orthon.data.loader import TrainData, ValidData
from orthon.data.store import TokenStore
from orthon.data.tokenizer import CHAT_TOKENS, load_tokenizer
from orthon.core.errors import ConfigError

_PROBLEM = re.compile(r"^Q: (\d+)([+*-])(\d+)=\? A:$")


@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_problems_are_correct_and_bounded(difficulty):
    rng = random.Random(difficulty)
    ops = set()
    for _ in range(500):
        prompt, answer = make_problem(rng, difficulty)
        a, op, b = _PROBLEM.match(prompt).groups()
        ops.add(op)
        assert int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(answer) >= 0 and len(a) <= difficulty
        assert len(b) <= (difficulty if op != "*" else (difficulty + 1) // 2)
    assert ops == ({"+", "-"} if difficulty == 1 else {"+", "-", "*"})


def test_problems_are_seeded():
    draw = lambda seed: [make_problem(random.Random(seed), 3) for _ in range(5)]  # noqa: E731
    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert make_problem(random.Random(0), 2) == make_problem(random.Random(0), 2)
    with pytest.raises(ValueError):
        make_problem(random.Random(0), 0)


def test_answer_checking():
    assert format_example("Q: 37+45=? A:", "82") == "Q: 37+45=? A: 82"
    assert extract_answer(" 82\nQ: 1+1=? A: 2") == "82"
    assert check_answer(" 82", "82") and check_answer("82 is it", "82") and check_answer(" 082", "82")
    assert not check_answer(" 83", "82") and not check_answer(" no idea", "82")
    assert check_answer(" -5", "-5")
    doc = make_document(random.Random(0), 4, 2)
    assert doc.endswith("\n") and len(doc.splitlines()) == 4
    for line in doc.splitlines():
        prompt, answer = line.rsplit(" ", 1)
        a, op, b = _PROBLEM.match(prompt).groups()
        assert check_answer(answer, str(eval(f"{a}{op}{b}")))


def test_stdlib_sources_are_real_code():
    files = stdlib_sources(max_mb=0.2)
    assert files and sum(len(src.encode()) for _, src in files) >= 0.2e6
    paths = [p for p, _ in files]
    assert paths == sorted(paths) and not any("/test/" in p or p.startswith("test/") for p in paths)
    assert all(p.endswith(".py") for p in paths)
    compile(files[0][1], files[0][0], "exec")  # real, parseable Python


@pytest.fixture(scope="module")
def small_builtin(tmp_path_factory):
    root = tmp_path_factory.mktemp("builtin")
    return prepare_builtin(root, vocab_size=600, seed=0, log=None, arithmetic_problems=3000, max_code_mb=0.4,
                           valid_fraction=0.05, workers=1)


def test_prepare_builtin_end_to_end(small_builtin):
    paths = small_builtin
    tok = load_tokenizer(paths.tokenizer)
    assert tok.vocab_size == 600
    for t in CHAT_TOKENS:
        assert len(tok.encode(t)) == 1
    assert tok.decode(tok.encode("Q: 37+45=? A: 82")) == "Q: 37+45=? A: 82"
    # every store decodes back to the corpus it came from, document by document
    for split, stores in (("train", paths.train_stores), ("valid", paths.valid_stores)):
        assert set(stores) == {"code", "arithmetic"}
        for kind, store_dir in stores.items():
            files = [p for p in paths.corpus[split] if ("arithmetic" in p.name) == (kind == "arithmetic")]
            texts = [json.loads(line)["text"] for f in files for line in f.read_text().splitlines()]
            store = TokenStore(store_dir)
            assert store.n_docs == len(texts) and store.n_tokens == paths.report["tokens"][f"{split}/{kind}"]
            assert [tok.decode(store.doc(i)) for i in range(store.n_docs)] == texts
    code = paths.corpus["train"][0].read_text()
    assert '"# ' in code and "def " in code
    arith = [json.loads(line)["text"] for line in (paths.root / "corpus/train/arithmetic.jsonl").open()]
    assert sum(len(d.splitlines()) for d in arith) >= 3000 * 0.9


def test_prepare_builtin_reuses_finished_steps(small_builtin):
    before = small_builtin.tokenizer.stat().st_mtime_ns
    again = prepare_builtin(small_builtin.root, vocab_size=600, seed=0, log=None, arithmetic_problems=3000,
                            max_code_mb=0.4, valid_fraction=0.05, workers=1)
    assert again.tokenizer.stat().st_mtime_ns == before  # not retrained
    assert again.report["tokens"] == small_builtin.report["tokens"]


def test_prepare_builtin_reuses_a_given_tokenizer(small_builtin, tmp_path):
    """A continuation adds kinds to the corpus and keeps the token ids its model was trained with."""
    given = small_builtin.tokenizer
    before = given.stat().st_mtime_ns
    paths = prepare_builtin(tmp_path / "b", vocab_size=600, seed=0, log=None, arithmetic_problems=3000, max_code_mb=0.4,
                            valid_fraction=0.05, workers=1, recall_docs=20, tokenizer=str(given))
    assert paths.tokenizer == given and given.stat().st_mtime_ns == before and not list((tmp_path / "b").glob("*.model"))
    assert set(paths.train_stores) == {"code", "arithmetic", "recall"}
    # the same code and arithmetic, tokenised by the given tokenizer: token for token what the first build made
    for kind in ("code", "arithmetic"):
        assert TokenStore(paths.train_stores[kind]).doc(0).tolist() == TokenStore(small_builtin.train_stores[kind]).doc(0).tolist()
    tok = load_tokenizer(given)
    text = json.loads((tmp_path / "b/corpus/train/recall.jsonl").open().readline())["text"]
    assert tok.decode(TokenStore(paths.train_stores["recall"]).doc(0)) == text
    with pytest.raises(ValueError, match="600 pieces, builtin.vocab_size is 700"):
        prepare_builtin(tmp_path / "c", vocab_size=700, log=None, arithmetic_problems=100, max_code_mb=0.1, tokenizer=str(given))
    with pytest.raises(FileNotFoundError, match="builtin.tokenizer"):
        prepare_builtin(tmp_path / "d", log=None, arithmetic_problems=100, max_code_mb=0.1, tokenizer=str(tmp_path / "none.model"))


def test_builtin_data_config_feeds_the_loader(small_builtin):
    cfg = small_builtin.data_config(seq_len=32, seed=3)
    assert [s.name for s in cfg.sources] == ["code", "arithmetic"]
    data = TrainData(cfg)
    batch = data.next_batch(8)
    assert batch.input_ids.shape == (8, 32) and int(batch.input_ids.max()) < 600
    valid = ValidData(cfg, max_samples=4)
    assert len(valid) == 8 and sum(b.input_ids.shape[0] for b in valid.batches(3)) == 8


def test_builtin_config_validation():
    with pytest.raises(ConfigError, match="valid_fraction"):
        BuiltinConfig(valid_fraction=0.7)
    with pytest.raises(ConfigError, match="max_difficulty"):
        BuiltinConfig(max_difficulty=0)


@pytest.mark.slow
def test_full_builtin_corpus(tmp_path):
    paths = prepare_builtin(tmp_path, log=None)
    assert paths.report["tokens"]["train/code"] > 1_000_000
    assert paths.report["tokens"]["train/arithmetic"] > 500_000
    assert load_tokenizer(paths.tokenizer).vocab_size == 4096


def test_reused_builtin_corpus_says_so(small_builtin):
    lines = []
    prepare_builtin(small_builtin.root, vocab_size=600, seed=0, log=lines.append, arithmetic_problems=3000,
                    max_code_mb=0.4, valid_fraction=0.05, workers=1)
    assert not [line for line in lines if "MB/s" in line], lines
    stores = [line for line in lines if line.startswith("store ")]
    assert stores and all("(reused: already prepared)" in line for line in stores), lines
    assert any(line.startswith("built-in corpus") and "reused" in line for line in lines)
    assert any(line.startswith("tokenizer") and "(reused)" in line for line in lines)


def test_ranks_that_prepare_at_once_build_once(tmp_path):
    """The ranks of a torchrun job all prepare the built-in data: run at the same moment in two processes,
    one builds while the other waits, then reuses what it built (both used to build, and one deleted the
    other's unfinished shards)."""
    import subprocess
    import sys

    code = ("import sys; from orthon.data.builtin import prepare_builtin; "
            "prepare_builtin(sys.argv[1], vocab_size=600, seed=0, arithmetic_problems=3000, max_code_mb=0.4, "
            "valid_fraction=0.05, workers=1)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "b")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    printed = [out for out, _ in outs]
    built = [out for out in printed if "reused" not in out]
    waited = [out for out in printed if out not in built]
    assert len(built) == 1 and len(waited) == 1
    assert waited[0].splitlines() and all("reused" in line for line in waited[0].splitlines())
    manifest = json.loads((tmp_path / "b" / "builtin.json").read_text())
    assert manifest["corpus"]
