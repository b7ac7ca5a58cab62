import json

from test_data_support import corpus_texts, run_cli, write_jsonl

from orthon.data.store import TokenStore
from orthon.data.tokenizer import load_tokenizer


def test_tokenizer_train_prepare_inspect(tmp_path, capsys):
    texts = corpus_texts(n_arith_docs=20, code_mb=0.03)
    src = write_jsonl(tmp_path / "corpus.jsonl", texts + [""])
    assert run_cli("tokenizer", ["train", str(src), "--out", str(tmp_path / "tok.model"), "--vocab-size", "400",
                                 "--special-token", "<|user|>"]) == 0
    tok = load_tokenizer(tmp_path / "tok.model")
    assert tok.vocab_size == 400 and len(tok.encode("<|user|>")) == 1

    recipe = tmp_path / "prepare.yaml"
    recipe.write_text("shard_mb: 0.01\nworkers: 1\n")
    assert run_cli("data", ["prepare", str(src), "--tokenizer", str(tmp_path / "tok.model"), "--out",
                            str(tmp_path / "store"), "-c", str(recipe), "--set", "max_chars=100000",
                            "--filter", "orthon.data.filters.heuristic_quality=0.5"]) == 0
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["fingerprint"]["shard_mb"] == 0.01 and manifest["fingerprint"]["max_chars"] == 100000
    assert manifest["fingerprint"]["filters"][0]["min_score"] == 0.5
    assert manifest["totals"]["skipped"]["empty"] == 1
    store = TokenStore(tmp_path / "store")
    assert store.n_docs == manifest["totals"]["n_docs"] and len(store.shards) > 1
    assert tok.decode(store.doc(0)) == texts[0]

    capsys.readouterr()
    assert run_cli("data", ["inspect", str(tmp_path / "store"), "--verify", "--show", "1",
                            "--tokenizer", str(tmp_path / "tok.model")]) == 0
    out = capsys.readouterr().out
    assert f"{store.n_docs} documents, {store.n_tokens} tokens" in out and "every shard matches" in out
    assert texts[0][:40] in out

    # a .bin that no longer matches its index is reported by name
    shard = tmp_path / "store" / (manifest["shards"][0]["name"] + ".bin")
    shard.write_bytes(shard.read_bytes()[:-2])
    assert run_cli("data", ["inspect", str(tmp_path / "store")]) == 1
    assert "index does not match the .bin" in capsys.readouterr().err


def test_bad_input_exit_codes(tmp_path, capsys):
    assert run_cli("data", ["prepare", str(tmp_path / "missing.jsonl"), "--tokenizer", "x.model",
                            "--out", str(tmp_path / "o")]) == 1
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert run_cli("tokenizer", ["train", str(tmp_path / "nothing.txt"), "--out", str(tmp_path / "t.model")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_dedup_command(tmp_path, capsys):
    doc = " ".join(f"word{i}" for i in range(100))
    src = write_jsonl(tmp_path / "a.jsonl", [doc, "something else entirely, quite different", doc + " end"])
    assert run_cli("data", ["dedup", str(src), "--out", str(tmp_path / "d.jsonl"), "--threshold", "0.8"]) == 0
    kept = [json.loads(line)["text"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert kept == [doc, "something else entirely, quite different"]
    assert json.loads((tmp_path / "d.jsonl.report.json").read_text())["removed"] == 1
