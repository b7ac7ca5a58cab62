import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_support import hf_tokenizer_json, train_tiny_tokenizer, write_jsonl

from orthon.data.config import FilterConfig, PrepareConfig, ReadConfig
from orthon.core.errors import DataError
from orthon.core.files import sha256_file
from orthon.data.prepare import prepare
from orthon.data.store import MANIFEST, Shard, StoreError, TokenStore
from orthon.data.tokenizer import load_tokenizer

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _cfg(inputs, out, tok, **kw):
    return PrepareConfig(inputs=[str(p) for p in inputs], out_dir=str(out), tokenizer=str(tok), **kw)


def _docs(path):
    store = TokenStore(path)
    return [store.doc(i).tolist() for i in range(store.n_docs)]


def _manifest(out):
    return json.loads((Path(out) / MANIFEST).read_text())


def test_prepare_keeps_order_and_counts_bad_input(tmp_path, tok):
    good = [f"def f{i}(x):\n    return x * {i}\n" for i in range(30)]
    a = write_jsonl(tmp_path / "a.jsonl", good[:10] + ["", "   \n", {"other": 1}, "tiny"] + good[10:20],
                    raw_lines=[b'{"text": "bad \xff bytes in a long enough document"}', b'{"text": oops'])
    pq.write_table(pa.table({"text": good[20:25] + [""]}), tmp_path / "b.parquet")
    txt_docs = [f"plain text line number {i}" for i in range(5)]
    (tmp_path / "c.txt").write_text("\n".join(txt_docs) + "\n\n")  # ends in one blank line
    length = FilterConfig(path="test_data_support:LengthScorer", min_score=1.0, kwargs={"min_len": 10})
    cfg = _cfg([a, tmp_path / "b.parquet", tmp_path / "c.txt"], tmp_path / "out", tok, workers=2,
               shard_mb=0.0003, batch_docs=3, filters=[length])
    report = prepare(cfg, log=None)

    tokenizer = load_tokenizer(tok)
    expected = good[:25] + txt_docs
    assert _docs(tmp_path / "out") == [tokenizer.encode(t) for t in expected]
    assert report.docs_kept == len(expected)
    assert report.skipped == {"empty": 4, "no_text": 1, "non_utf8": 1, "malformed_json": 1,
                              "filtered:LengthScorer": 1}
    assert report.docs_read == len(expected) + 8
    assert report.tokens == sum(len(tokenizer.encode(t)) for t in expected)
    manifest = _manifest(tmp_path / "out")
    assert manifest["complete"] and manifest["totals"]["skipped"] == report.skipped
    assert len(manifest["shards"]) == report.shards_written > 3  # several shards per file
    assert manifest["dtype"] == "uint16" and manifest["eos_id"] == tokenizer.eos_id
    assert json.loads((tmp_path / "out" / "report.json").read_text())["docs_kept"] == len(expected)


def test_hundred_megabyte_line_is_skipped_and_counted(tmp_path, tok):
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        f.write("word " * (21 * 2**20))  # one 105 MB line
        f.write("\nshort line after it\n")
    report = prepare(_cfg([big], tmp_path / "out", tok, workers=1), log=None)
    assert report.skipped == {"too_long": 1}
    assert load_tokenizer(tok).decode(TokenStore(tmp_path / "out").doc(0)) == "short line after it"


def test_missing_file_fails_before_any_work(tmp_path, tok):
    (tmp_path / "ok.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        prepare(_cfg([tmp_path / "ok.jsonl", tmp_path / "missing.jsonl"], tmp_path / "out", tok), log=None)
    assert not (tmp_path / "out").exists()


def test_rerun_resumes_and_other_settings_are_refused(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [f"document {i} " * 4 for i in range(40)])
    first = prepare(_cfg([src], tmp_path / "out", tok, workers=1, shard_mb=0.0005), log=None)
    again = prepare(_cfg([src], tmp_path / "out", tok, workers=1, shard_mb=0.0005), log=None)
    assert again.shards_written == 0 and again.shards_resumed == first.shards_written
    with pytest.raises(DataError, match="shard_mb differ"):
        prepare(_cfg([src], tmp_path / "out", tok, workers=1, shard_mb=0.001), log=None)
    redone = prepare(_cfg([src], tmp_path / "out", tok, workers=1, shard_mb=0.001, overwrite=True), log=None)
    assert redone.shards_written < first.shards_written
    assert len(list((tmp_path / "out").glob("shard_*.bin"))) == redone.shards_written  # old shards are gone


def test_hf_tokenizer_json_store(tmp_path):
    path = hf_tokenizer_json(tmp_path / "tokenizer.json")
    src = write_jsonl(tmp_path / "a.jsonl", ["hello world", "def f(x):\n    return x\n"])
    prepare(_cfg([src], tmp_path / "out", path, workers=1), log=None)
    tokenizer = load_tokenizer(path)
    assert _docs(tmp_path / "out") == [tokenizer.encode("hello world"), tokenizer.encode("def f(x):\n    return x\n")]
    assert TokenStore(tmp_path / "out").eos_id == tokenizer.token_to_id("<|endoftext|>")


def _check_no_half_written_file(out):
    """Every file under a final name is a whole shard; every recorded shard matches its checksum."""
    for idx in Path(out).glob("shard_*.idx"):
        Shard(idx.with_suffix(""))  # validates sizes and offsets
    for entry in _manifest(out)["shards"]:
        assert sha256_file(Path(out) / (entry["name"] + ".bin")) == entry["bin_sha256"]
    assert not _manifest(out)["complete"]
    with pytest.raises(StoreError, match="incomplete"):
        TokenStore(out)


def test_crash_mid_shard_leaves_no_half_written_file(tmp_path, tok):
    texts = [f"document number {i} " * 5 for i in range(60)]
    texts[45] = "this one says BOOM " * 5
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    flag = tmp_path / "crash-flag"
    flag.write_text("armed")
    boom = FilterConfig(path="test_data_support.boom_if_flag", min_score=1.0, kwargs={"flag": str(flag)})
    cfg = _cfg([src], tmp_path / "out", tok, workers=2, shard_mb=0.0005, batch_docs=2, filters=[boom])
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(cfg, log=None)
    done = len(_manifest(tmp_path / "out")["shards"])
    assert 0 < done
    _check_no_half_written_file(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tmp"))  # the failed shard's temporary files were removed

    flag.unlink()
    report = prepare(cfg, log=None)
    # The rerun kept the finished shards and wrote exactly the rest: the manifest lists both, nothing twice.
    assert report.shards_resumed == done and report.shards_written > 0
    assert done + report.shards_written == len(_manifest(tmp_path / "out")["shards"])
    clean = prepare(_cfg([src], tmp_path / "clean", tok, workers=1, shard_mb=0.0005), log=None)
    assert _docs(tmp_path / "out") == _docs(tmp_path / "clean")
    assert report.docs_kept + sum(_manifest(tmp_path / "out")["shards"][i]["n_docs"] for i in range(done)) \
        == clean.docs_kept == 60


@pytest.mark.parametrize("die_at", [0, 20])  # 0: before any shard can finish
def test_dead_worker_fails_the_run_instead_of_hanging(tmp_path, tok, die_at):
    from concurrent.futures.process import BrokenProcessPool

    texts = [f"document number {i} " * 5 for i in range(30)]
    texts[die_at] = "this one says DIE " * 5
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    die = FilterConfig(path="test_data_support.die_on_marker", min_score=1.0)
    with pytest.raises(BrokenProcessPool):
        prepare(_cfg([src], tmp_path / "out", tok, workers=2, shard_mb=0.0005, batch_docs=2, filters=[die]),
                log=None)
    _check_no_half_written_file(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_sigkill_mid_run_then_rerun_completes(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [f"text of document {i} " * 4 for i in range(120)])
    out = tmp_path / "out"
    args = ["prepare", str(src), "--tokenizer", str(tok), "--out", str(out), "--workers", "2",
            "--shard-mb", "0.0005", "--filter", "test_data_support.slow_score=1.0"]
    code = "import sys; from test_data_support import run_cli; sys.exit(run_cli('data', sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / MANIFEST).is_file() and len(_manifest(out)["shards"]) >= 2:
                break
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its tokeniser processes, mid-shard
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    _check_no_half_written_file(out)

    slow = FilterConfig(path="test_data_support.slow_score", min_score=1.0)
    report = prepare(_cfg([src], out, tok, workers=2, shard_mb=0.0005, filters=[slow]), log=None)
    assert report.shards_resumed >= 2
    assert not list(out.glob("*.tmp"))
    prepare(_cfg([src], tmp_path / "clean", tok, workers=1, shard_mb=0.0005), log=None)
    assert _docs(out) == _docs(tmp_path / "clean")
    assert len(_docs(out)) == 120


def test_read_config_reaches_the_reader(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", [{"body": "first body"}, {"body": "second"}])
    prepare(_cfg([src], tmp_path / "out", tok, workers=1, read=ReadConfig(text_field="body")), log=None)
    tokenizer = load_tokenizer(tok)
    assert [tokenizer.decode(d) for d in _docs(tmp_path / "out")] == ["first body", "second"]


def test_stores_name_their_tokenizer_and_refuse_another(tmp_path, tok):
    """A recipe that names stores and no tokenizer trains with the one the stores were prepared with (the run
    records it: generate and RL find it); one that names a different tokenizer is refused before any step."""
    from orthon.data.store import stores_tokenizer

    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(20)]
    a = write_jsonl(tmp_path / "a.jsonl", docs)
    prepare(_cfg([a], tmp_path / "s1", tok))
    prepare(_cfg([a], tmp_path / "s2", tok))
    stores = [tmp_path / "s1", tmp_path / "s2"]
    assert stores_tokenizer(stores) == str(tok)
    copy = tmp_path / "copy.model"  # the same contents elsewhere: accepted
    copy.write_bytes(Path(tok).read_bytes())
    assert stores_tokenizer(stores, str(copy)) == str(copy)
    other = train_tiny_tokenizer(tmp_path / "other", vocab_size=400)
    refused = r"data.tokenizer: .*other.*is not the tokenizer the store .*s1 was prepared with"
    with pytest.raises(DataError, match=refused):
        stores_tokenizer(stores, str(other))
    prepare(_cfg([a], tmp_path / "s3", other))
    assert stores_tokenizer(stores + [tmp_path / "s3"]) == ""  # they disagree: none named
    prepare(_cfg([a], tmp_path / "s4", copy))
    copy.write_bytes(Path(other).read_bytes())  # the recorded file has changed since: none named
    assert stores_tokenizer([tmp_path / "s4"]) == ""
    copy.unlink()  # or is gone
    assert stores_tokenizer([tmp_path / "s4"]) == ""


def test_a_pretraining_recipe_of_stores_takes_their_tokenizer_and_its_ids(tmp_path, tok):
    from orthon.data.config import DataConfig, StoreSource
    from orthon.launch.cmd_pretrain import with_builtin_data
    from orthon.pretrain.recipe import Recipe

    docs = write_jsonl(tmp_path / "a.jsonl", [f"x = {i} + {i}\n" * 3 for i in range(20)])
    prepare(_cfg([docs], tmp_path / "s", tok))
    lines = []
    recipe = with_builtin_data(Recipe(data=DataConfig(sources=[StoreSource(str(tmp_path / "s"))])), lines.append)
    tokenizer = load_tokenizer(tok)
    assert recipe.data.tokenizer == str(tok)
    assert lines[0] == f"data.tokenizer: {tok} (the one the stores were prepared with)"
    assert (recipe.model.bos_token_id, recipe.model.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
