"""Text and tokens: from files to the batches a step reads.

    tokenizers.py   char, gpt2 (tiktoken, offline), bpe:N (HF tokenizers)
    shards.py       token shard files (llm.c's format, our uint32 version, nanoGPT's raw)
    checks.py       token data against its tokenizer: prepare.json's record, other files' largest ids (cached)
    dataset.py      a run's data: text or shards, train / val splits, memory-mapped token streams
    batches.py      which windows each step reads, a pure function of (seed, step, rank)
    text.py         a character-level text in memory (tests, gradcheck)
"""
