import json
import random

from test_data_support import write_jsonl

from orthon.data.config import DedupConfig
from orthon.data.dedup import deduplicate, shingles


def _article(rng, n_words=200):
    vocab = [f"w{i}" for i in range(3000)]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def _near_copy(text, rng, changes=4):
    words = text.split()
    for _ in range(changes):
        words[rng.randrange(len(words))] = "CHANGED"
    return " ".join(words)


def test_shingles():
    assert shingles("A b c d", 2) == {b"a b", b"b c", b"c d"}
    assert shingles("one two", 5) == {b"one two"}
    assert shingles("!!!", 3) == {b"!!!"}


def test_near_duplicates_removed_distinct_kept():
    rng = random.Random(0)
    originals = [_article(rng) for _ in range(20)]
    docs = list(originals)
    docs.insert(5, _near_copy(originals[2], rng))  # near-duplicate of a kept document
    docs.insert(12, originals[7])  # exact duplicate
    docs.append(_near_copy(originals[19], rng, changes=2))
    docs.append(_near_copy(originals[0], rng, changes=120))  # heavily edited: no longer a duplicate
    results = list(deduplicate(docs, threshold=0.7, num_perm=128, ngram=3))
    removed = {i: r for i, _, r in results if r is not None}
    assert sorted(removed) == [5, 12, 22]
    assert removed[5].duplicate_of == 2 and removed[12].duplicate_of == 8 and removed[22].duplicate_of == 21
    assert removed[12].jaccard == 1.0 and 0.7 <= removed[5].jaccard < 1.0
    kept = [t for _, t, r in results if r is None]
    assert kept == [d for i, d in enumerate(docs) if i not in removed]  # order kept, first copy stays


def test_dedup_files_writes_output_and_report(tmp_path):
    rng = random.Random(1)
    a = [_article(rng) for _ in range(6)]
    write_jsonl(tmp_path / "one.jsonl", a[:3] + [""])
    write_jsonl(tmp_path / "two.jsonl", [_near_copy(a[1], rng), a[3], a[4], a[5], a[0]])
    from orthon.data.dedup import dedup_files

    report = dedup_files(DedupConfig(inputs=[str(tmp_path / "*.jsonl")], output=str(tmp_path / "out.jsonl"),
                                     threshold=0.7, ngram=3), log=None)
    kept = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept == a[:3] + a[3:6]
    assert (report["documents"], report["kept"], report["removed"]) == (8, 6, 2)
    assert report["skipped"] == {"empty": 1}
    on_disk = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    gone = {(r["file"].rsplit("/", 1)[-1], r["record"]): (r["duplicate_of_file"].rsplit("/", 1)[-1],
                                                          r["duplicate_of_record"]) for r in on_disk["removed_documents"]}
    assert gone == {("two.jsonl", 0): ("one.jsonl", 1), ("two.jsonl", 4): ("one.jsonl", 0)}
    assert not list(tmp_path.glob("*.tmp"))


def test_dedup_keeps_every_field_of_the_records_it_keeps(tmp_path):
    """A JSON-lines or Parquet corpus keeps its metadata (ids, sources, urls) through dedup, each JSON-lines
    record exactly as written; plain text becomes {"text": ...}. A malformed line is skipped and counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orthon.data.dedup import dedup_files

    rng = random.Random(2)
    a = [_article(rng) for _ in range(4)]
    # As written: ints stay ints beside a float, a record keeps only its own fields.
    records = [{"text": a[0], "id": 7, "meta": {"url": "u0", "tags": ["x"]}}, {"text": a[0], "id": 8.5},
               {"text": a[1], "source": "s1"}]
    write_jsonl(tmp_path / "a.jsonl", records)
    write_jsonl(tmp_path / "d.jsonl", [{"text": a[1], "n": 1}], raw_lines=[b"{broken"])
    pq.write_table(pa.table({"text": [a[2], a[1]], "source": ["p0", "p1"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text(a[3] + "\n")
    report = dedup_files(DedupConfig(inputs=[str(tmp_path / n) for n in ("a.jsonl", "b.parquet", "c.txt", "d.jsonl")],
                                     output=str(tmp_path / "out.jsonl"), threshold=0.7, ngram=3), log=None)
    kept = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept == [records[0], records[2], {"text": a[2], "source": "p0"}, {"text": a[3]}]
    assert (report["kept"], report["removed"], report["skipped"]) == (4, 3, {"malformed_json": 1})
    # An output naming a folder gets dedup.jsonl inside it.
    again = dedup_files(DedupConfig(inputs=[str(tmp_path / "a.jsonl")], output=str(tmp_path / "out") + "/",
                                    threshold=0.7, ngram=3), log=None)
    assert again["output"] == str(tmp_path / "out" / "dedup.jsonl") and (tmp_path / "out" / "dedup.jsonl.report.json").is_file()
    assert [json.loads(line) for line in (tmp_path / "out" / "dedup.jsonl").read_text().splitlines()] == [records[0], records[2]]
