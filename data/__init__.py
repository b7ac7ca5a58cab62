"""orthon.data: text in, packed token batches out.

tokenizer (sentencepiece / HF tokenizer.json) -> sources (jsonl, parquet, text via datasets)
-> prepare (parallel, resumable tokenising into a token store) -> store (memory-mapped .bin/.idx)
-> packing (fixed-length samples with end-of-document tokens) -> blend (weighted sources)
-> sampler (deterministic, resumable order) -> loader (TrainData / ValidData for the trainer).
dedup (MinHash-LSH) and filters (plug-in scorers) clean text; builtin builds the no-download corpus.
"""
