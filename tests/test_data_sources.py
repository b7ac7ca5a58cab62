import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_support import write_jsonl

from orthon.data.config import ReadConfig
from orthon.core.errors import DataError
from orthon.data.sources import classify, detect_format, expand_inputs, iter_documents


def test_jsonl_records_and_bad_bytes(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["first", "", {"other": 1}, "last"],
                       raw_lines=[b'{"text": "bad \xff\xfe bytes"}', b'{"text": "after"}'])
    docs = list(iter_documents(path))
    assert docs[0] == "first" and docs[1] == "" and docs[2] is None and docs[3] == "last" and docs[5] == "after"
    assert [classify(d) for d in docs] == [None, "empty", "no_text", None, "non_utf8", None]


def test_text_field_and_parquet(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"content": "x1"}, {"content": "x2"}])
    assert list(iter_documents(tmp_path / "b.jsonl", ReadConfig(text_field="content"))) == ["x1", "x2"]
    pq.write_table(pa.table({"text": ["p1", "", "p3"], "id": [1, 2, 3]}), tmp_path / "c.parquet")
    assert list(iter_documents(tmp_path / "c.parquet")) == ["p1", "", "p3"]


def test_text_units(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"one\ntwo \xff\n\npara two\n")
    assert list(iter_documents(path, ReadConfig(text_unit="line"))) == ["one", "two \ufffd", "", "para two"]
    assert list(iter_documents(path, ReadConfig(text_unit="paragraph"))) == ["one\ntwo \ufffd", "para two\n"]
    assert list(iter_documents(path, ReadConfig(text_unit="document"))) == ["one\ntwo \ufffd\n\npara two\n"]


def test_classify_limits():
    assert classify("x" * 11, max_chars=10) == "too_long"
    assert classify("abc", min_chars=4) == "too_short"
    assert classify(" \n\t ") == "empty"
    assert classify(5) == "no_text" and classify(None) == "no_text"
    assert classify("fine") is None


def test_missing_and_empty_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="glob matches no file"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="holds no"):
        expand_inputs([str(tmp_path / "empty_dir")])
    with pytest.raises(DataError, match="no input files"):
        expand_inputs([])
    with pytest.raises(DataError, match="no such file"):
        list(iter_documents(tmp_path / "missing.jsonl"))


def test_expand_inputs_sorts_globs_and_directories(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "sub/c.txt", "sub/skip.bin"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [p.name for p in expand_inputs([str(tmp_path / "*.jsonl")])] == ["a.jsonl", "b.jsonl"]
    assert [p.name for p in expand_inputs([str(tmp_path)])] == ["a.jsonl", "b.jsonl", "c.txt"]
    assert detect_format("x.parquet") == "parquet" and detect_format("x.json") == "jsonl"
    assert detect_format("x.py") == "text" and detect_format("x.py", "jsonl") == "jsonl"


def test_malformed_json_lines_are_skipped_counted_and_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "broken.jsonl", ["ok"], raw_lines=[
        b'{"text": oops', b"", b'["a list"]', b'{"text": "after", "note": "\xe2\x80\xa8 stays one line"}'])
    with caplog.at_level("WARNING", logger="orthon.data.sources"):
        docs = list(iter_documents(path))
    assert docs[0] == "ok" and docs[3] == "after"
    assert [classify(d) for d in docs] == [None, "malformed_json", "malformed_json", None]
    assert (docs[1].line, docs[2].line) == (2, 4)  # line numbers in the file, the blank line 3 counted
    assert "broken.jsonl line 2: malformed JSON" in caplog.text and "line 4" in caplog.text


def test_a_bad_line_after_the_first_block_repeats_and_loses_nothing(tmp_path):
    """pyarrow parses ~10 MB blocks and fails a whole block on one bad line: the records of the blocks
    before it come out once, the rest line by line."""
    texts = [f"{i:06d} " + "x" * 1000 for i in range(12_000)]  # 12 MB
    path = write_jsonl(tmp_path / "big.jsonl", texts[:11_000], raw_lines=[b"{bad"])
    with open(path, "ab") as f:
        for t in texts[11_000:]:
            f.write(json.dumps({"text": t}).encode() + b"\n")
    docs = list(iter_documents(path))
    assert [d for d in docs if isinstance(d, str)] == texts
    assert [d.line for d in docs if classify(d) == "malformed_json"] == [11_001]


def test_a_field_whose_type_changes_does_not_fail_the_file(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a", "meta": {"k": 1}}, {"text": "b", "meta": "s"}])
    assert list(iter_documents(path)) == ["a", "b"]


def test_a_file_that_is_not_json_lines_is_an_error(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("just some text\nmore text\n")
    with pytest.raises(DataError, match="notes.jsonl: not JSON lines: none of its 2 lines"):
        list(iter_documents(path))


def test_empty_files_hold_no_documents(tmp_path):
    for name in ["e.jsonl", "e.txt", "e.parquet"]:
        (tmp_path / name).write_bytes(b"")
        assert list(iter_documents(tmp_path / name)) == []
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert list(iter_documents(tmp_path / "blank.jsonl")) == []
