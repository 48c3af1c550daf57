import os

import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.data.text import CharTokenizer, TextDataset, get_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare", "input.txt")


def test_tokenizer_round_trip():
    text = "Hello, world!\nÄpfel — ok ✓"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""
    assert [tok.stoi[c] for c in text] == ids.tolist()


def test_unknown_character_error_names_it():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError) as e:
        tok.encode("abcabz")
    msg = str(e.value)
    assert "\n" not in msg and "'z'" in msg and "position 5" in msg
    with pytest.raises(ValueError) as e:
        tok.encode("a\u2603")  # a code point above the lookup table
    assert repr("\u2603") in str(e.value) and "position 1" in str(e.value)
    with pytest.raises(ValueError) as e:
        tok.encode("ab\n")
    assert repr("\n") in str(e.value)


def test_decode_rejects_out_of_range():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError):
        tok.decode([0, 3])


def test_bad_tokenizer_construction():
    with pytest.raises(ValueError):
        CharTokenizer(["a", "a"])
    with pytest.raises(ValueError):
        CharTokenizer(["ab"])


def test_tokenizer_json_and_file(tmp_path):
    tok = CharTokenizer.from_text("the quick brown fox\n")
    assert CharTokenizer.from_json(tok.to_json()) == tok
    p = tmp_path / "tok.json"
    tok.save(p)
    assert os.listdir(tmp_path) == ["tok.json"]
    assert CharTokenizer.load(p).chars == tok.chars


def test_shakespeare_split():
    ds = TextDataset(SHAKESPEARE)
    assert ds.tokenizer.vocab_size == 65
    n = 1115394
    assert len(ds.train) == int(0.9 * n) == 1003854
    assert len(ds.val) == n - 1003854 == 111540
    assert ds.train.dtype == np.int32 and ds.val.dtype == np.int32
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read()
    assert ds.tokenizer.decode(ds.train[:100]) == text[:100]
    assert ds.tokenizer.decode(ds.val[-100:]) == text[-100:]


def test_dataset_missing_file(tmp_path):
    p = str(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError) as e:
        TextDataset(p)
    assert p in str(e.value) and "\n" not in str(e.value)


def test_dataset_with_given_tokenizer(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("abcabcabca")
    tok = CharTokenizer(list("cbaxyz"))
    ds = TextDataset(str(p), tokenizer=tok)
    assert ds.tokenizer is tok and ds.train.tolist() == [2, 1, 0, 2, 1, 0, 2, 1, 0]
    assert ds.val.tolist() == [2]


def test_get_batch_shapes_and_shift():
    tokens = np.arange(1000, dtype=np.int32)
    x, y = get_batch(tokens, 1337, 5, rng.SITE_BATCH_TRAIN, 8, 32)
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == np.int32 and y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(y, x + 1)  # tokens are arange: y is x shifted by one token
    offs = rng.batch_offsets(1337, 5, rng.SITE_BATCH_TRAIN, 8, 1000, 32)
    assert np.array_equal(x[:, 0], offs)


def test_get_batch_reproducible():
    ds_tokens = np.random.default_rng(0).integers(0, 65, 5000).astype(np.int32)
    a = get_batch(ds_tokens, 1337, 10, rng.SITE_BATCH_TRAIN, 4, 16)
    b = get_batch(ds_tokens, 1337, 10, rng.SITE_BATCH_TRAIN, 4, 16)
    c = get_batch(ds_tokens, 1337, 11, rng.SITE_BATCH_TRAIN, 4, 16)
    d = get_batch(ds_tokens, 1337, 10, rng.SITE_BATCH_VAL, 4, 16)
    e = get_batch(ds_tokens, 1338, 10, rng.SITE_BATCH_TRAIN, 4, 16)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], d[0])
    assert not np.array_equal(a[0], e[0])


def test_get_batch_edge_window():
    tokens = np.arange(17, dtype=np.int32)  # exactly block+1 tokens: one possible window
    x, y = get_batch(tokens, 1, 0, rng.SITE_BATCH_TRAIN, 3, 16)
    assert np.array_equal(x, np.tile(np.arange(16), (3, 1)))
    assert np.array_equal(y, np.tile(np.arange(1, 17), (3, 1)))
    with pytest.raises(ValueError):
        get_batch(tokens, 1, 0, rng.SITE_BATCH_TRAIN, 3, 17)
