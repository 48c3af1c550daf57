import glob
import os

import numpy as np
import pytest

from gptcuda.data.text import TextDataset
from gptcuda.data.dataset import Dataset, TokenStream, open_dataset
from gptcuda.data.shards import DataError, is_shard, open_raw, open_shard, write_shard
from gptcuda.data.tokenizers import CharTokenizer, GPT2Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare", "input.txt")


def one_line(e):
    return "\n" not in str(e.value)


def header(path):
    return np.fromfile(path, dtype="<i4", count=256)


# --- shard files

def test_write_open_v1(tmp_path):
    p = str(tmp_path / "a.bin")
    toks = np.array([0, 1, 65535, 50256, 7], dtype=np.int64)
    write_shard(p, toks, 65536)
    h = header(p)
    assert h[:3].tolist() == [20240520, 1, 5] and not h[3:].any()
    assert os.path.getsize(p) == 1024 + 5 * 2
    m = open_shard(p)
    assert isinstance(m, np.memmap) and m.dtype == np.dtype("<u2") and not m.flags.writeable
    assert m.tolist() == toks.tolist()
    assert is_shard(p) and os.listdir(tmp_path) == ["a.bin"]


def test_write_open_v2(tmp_path):
    p = str(tmp_path / "b.bin")
    toks = np.array([0, 65536, 99999, 3], dtype=np.uint32)
    write_shard(p, toks, 100000)
    assert header(p)[:3].tolist() == [20240520, 2, 4]
    m = open_shard(p)
    assert isinstance(m, np.memmap) and m.dtype == np.dtype("<u4") and m.tolist() == toks.tolist()
    empty = str(tmp_path / "e.bin")
    write_shard(empty, np.zeros(0, np.int32), 10)
    assert len(open_shard(empty)) == 0


def test_write_rejects_out_of_vocab(tmp_path):
    p = str(tmp_path / "c.bin")
    with pytest.raises(DataError) as e:
        write_shard(p, np.array([1, 2, 50257]), 50257)
    assert one_line(e) and p in str(e.value) and "50257" in str(e.value) and "position 2" in str(e.value)
    with pytest.raises(DataError):
        write_shard(p, np.array([-1]), 10)
    assert os.listdir(tmp_path) == []                     # nothing half-written


def _corrupt(tmp_path, name, hdr=None, ntok=3, itemsize=2, raw=None):
    p = str(tmp_path / name)
    if raw is None:
        h = np.zeros(256, "<i4")
        h[:3] = hdr
        raw = h.tobytes() + b"\0" * (ntok * itemsize)
    with open(p, "wb") as f:
        f.write(raw)
    return p


@pytest.mark.parametrize("case, want", [
    ("short", "too small"),
    ("magic", "wrong magic 123 (want 20240520)"),
    ("version", "version 7 (known: 1 uint16, 2 uint32)"),
    ("count", "header says 5 tokens"),
    ("count2", "header says 2 tokens"),
    ("negative", "header says -4 tokens"),
])
def test_corrupt_headers(tmp_path, case, want):
    p = {
        "short": lambda: _corrupt(tmp_path, "s.bin", raw=b"\x00" * 100),
        "magic": lambda: _corrupt(tmp_path, "m.bin", [123, 1, 3]),
        "version": lambda: _corrupt(tmp_path, "v.bin", [20240520, 7, 3]),
        "count": lambda: _corrupt(tmp_path, "c.bin", [20240520, 1, 5], ntok=3),
        "count2": lambda: _corrupt(tmp_path, "c2.bin", [20240520, 2, 2], ntok=3, itemsize=2),
        "negative": lambda: _corrupt(tmp_path, "n.bin", [20240520, 1, -4], ntok=0),
    }[case]()
    with pytest.raises(DataError) as e:
        open_shard(p)
    assert one_line(e) and p in str(e.value) and want in str(e.value)
    assert isinstance(e.value, ValueError)


def test_missing_shard(tmp_path):
    p = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError) as e:
        open_shard(p)
    assert one_line(e) and p in str(e.value)
    assert not is_shard(p)


def test_nanogpt_raw(tmp_path):
    p = str(tmp_path / "train.bin")
    np.arange(1000, dtype=np.uint16).tofile(p)
    m = open_raw(p)
    assert isinstance(m, np.memmap) and m.dtype == np.dtype("<u2") and len(m) == 1000 and m[999] == 999
    assert not is_shard(p)
    with open(p, "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError) as e:
        open_raw(p)
    assert one_line(e) and p in str(e.value)


# --- TokenStream

def _pieces(tmp_path):
    a = str(tmp_path / "p0.bin")
    write_shard(a, np.arange(0, 10), 1000)                        # uint16 memmap
    b = str(tmp_path / "p1.bin")
    write_shard(b, np.arange(10, 13), 70000)                      # uint32 memmap
    c = np.arange(13, 40, dtype=np.int32)                         # in memory
    return [open_shard(a), open_shard(b), np.zeros(0, np.int32), c], [a, b, "<empty>", "<memory>"]


def test_gather_across_pieces(tmp_path):
    pieces, paths = _pieces(tmp_path)
    s = TokenStream(pieces, paths, 1000)
    assert len(s) == 40 and s.paths == [paths[0], paths[1], "<memory>"]
    ref = np.arange(40)
    for L in (1, 4, 12, 30):
        starts = np.minimum(np.array([0, 8, 9, 10, 12, 40 - L, 3], dtype=np.int64), 40 - L)
        out = np.full((len(starts), L), -7, dtype=np.int32)
        s.gather(starts, L, out)
        assert np.array_equal(out, ref[starts[:, None] + np.arange(L)])
    # every row inside one piece (the vectorized paths): one piece, and several
    for starts in ([0, 2, 6], [13, 20, 36], [0, 13, 30, 5]):
        out = np.empty((len(starts), 4), np.int32)
        s.gather(np.array(starts), 4, out)
        assert np.array_equal(out, ref[np.array(starts)[:, None] + np.arange(4)])
    assert s.read(8, 5).tolist() == [8, 9, 10, 11, 12]
    with pytest.raises(ValueError):
        s.gather(np.array([37]), 4, np.empty((1, 4), np.int32))
    with pytest.raises(ValueError):
        s.gather(np.array([0]), 4, np.empty((1, 4), np.int64))


def test_gather_out_of_vocab(tmp_path):
    pieces, paths = _pieces(tmp_path)
    s = TokenStream(pieces, paths, 12)                            # ids 12.. are outside
    out = np.empty((2, 4), np.int32)
    s.gather(np.array([0, 5]), 4, out)                            # fine: all < 12
    with pytest.raises(DataError) as e:
        s.gather(np.array([0, 9]), 4, out)                        # 9, 10, 11, 12
    msg = str(e.value)
    assert one_line(e) and paths[1] in msg and "token id 12" in msg and "position 2" in msg and "12" in msg
    big = str(tmp_path / "big.bin")
    write_shard(big, np.array([1, 2 ** 31 + 5, 3]), 2 ** 32)
    s = TokenStream([open_shard(big)], [big], 50257)
    with pytest.raises(DataError) as e:
        s.gather(np.array([0]), 3, np.empty((1, 3), np.int32))
    assert str(2 ** 31 + 5) in str(e.value) and big in str(e.value)


# --- open_dataset: text

def test_text_char_is_todays_split():
    ds = open_dataset(SHAKESPEARE)
    old = TextDataset(SHAKESPEARE)
    assert isinstance(ds, Dataset) and ds.tokenizer == old.tokenizer and ds.vocab_size == 65
    assert len(ds.train) == 1003854 and len(ds.val) == 111540
    assert np.array_equal(ds.train.pieces[0], old.train) and np.array_equal(ds.val.pieces[0], old.val)
    assert ds.train.paths == ["<memory>"]
    assert "1,003,854" in ds.describe() and "char" in ds.describe() and "\n" not in ds.describe()


def test_text_gpt2(tmp_path):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(20000)
    p = tmp_path / "t.txt"
    p.write_text(text, encoding="utf-8")
    ds = open_dataset(str(p), "gpt2")
    ids = GPT2Tokenizer().encode(text)
    n = int(0.9 * len(ids))
    assert ds.vocab_size == 50257
    assert ds.train.read(0, n).tolist() == ids[:n].tolist()
    assert ds.val.read(0, len(ids) - n).tolist() == ids[n:].tolist()


def test_text_errors(tmp_path):
    cases = {"empty.txt": b"", "nul.txt": b"abc\x00def", "latin1.txt": "caf\xe9".encode("latin-1")}
    for name, raw in cases.items():
        p = tmp_path / name
        p.write_bytes(raw)
        with pytest.raises(DataError) as e:
            open_dataset(str(p))
        assert one_line(e) and str(p) in str(e.value), name
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(missing)
    assert one_line(e) and missing in str(e.value)
    p = tmp_path / "t.txt"
    p.write_text("abcabz")
    with pytest.raises(DataError) as e:
        open_dataset(str(p), saved_tokenizer=CharTokenizer(list("abc")).to_dict())
    assert one_line(e) and "'z'" in str(e.value) and "position 5" in str(e.value) and str(p) in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(p), "gpt2", saved_tokenizer=CharTokenizer(list("abcz")).to_dict())
    assert one_line(e) and "char" in str(e.value) and "gpt2" in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(p), "bpe")
    assert one_line(e) and "'bpe'" in str(e.value)
    ds = open_dataset(str(p), saved_tokenizer=CharTokenizer(list("zcba")).to_dict())   # resume: its ids
    assert ds.train.read(0, 5).tolist() == [3, 2, 1, 3, 2]


# --- open_dataset: token data

def _llmc_dir(tmp_path, name="llmc"):
    d = tmp_path / name
    d.mkdir()
    write_shard(d / "tiny_shakespeare_val.bin", np.arange(100, 150), 50257)
    write_shard(d / "tiny_shakespeare_train_000001.bin", np.arange(0, 60), 50257)
    write_shard(d / "tiny_shakespeare_train_000002.bin", np.arange(60, 100), 50257)
    return d


def test_llmc_dir(tmp_path):
    d = _llmc_dir(tmp_path)
    ds = open_dataset(str(d), "gpt2")
    assert ds.kind == "llm.c" and isinstance(ds.tokenizer, GPT2Tokenizer)
    assert len(ds.train) == 100 and len(ds.val) == 50
    assert [os.path.basename(p) for p in ds.train.paths] == ["tiny_shakespeare_train_000001.bin",
                                                             "tiny_shakespeare_train_000002.bin"]
    assert ds.train.read(55, 10).tolist() == list(range(55, 65))
    assert all(isinstance(p, np.memmap) for p in ds.train.pieces + ds.val.pieces)
    assert "2 files" in ds.describe() and "gpt2" in ds.describe()
    with pytest.raises(DataError) as e:
        open_dataset(str(d))                                            # tokenizer: char
    assert one_line(e) and str(d) in str(e.value) and "tokenizer.json" in str(e.value) and "gpt2" in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(d), "bpe:1000")
    assert one_line(e) and "bpe:1000" in str(e.value)


def test_prepared_dir(tmp_path):
    import prepare
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(30000)
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "prep"
    assert prepare.main([str(src), "--out", str(out), "--shard_tokens", "2000", "--workers", "1"]) == 0
    ds = open_dataset(str(out))                                          # the default "char" spec is fine here
    assert ds.kind == "prepared" and isinstance(ds.tokenizer, GPT2Tokenizer)
    ids = np.concatenate([[50256], GPT2Tokenizer().encode(text)])
    n = int(0.9 * len(ids))
    assert len(ds.train) == n and len(ds.val) == len(ids) - n and len(ds.train.pieces) == -(-n // 2000)
    assert ds.train.read(0, n).tolist() == ids[:n].tolist()
    assert ds.val.read(0, len(ds.val)).tolist() == ids[n:].tolist()
    assert open_dataset(str(out), "gpt2").tokenizer == ds.tokenizer
    # resuming a run with another tokenizer
    with pytest.raises(DataError) as e:
        open_dataset(str(out), saved_tokenizer=CharTokenizer(list("abc")).to_dict())
    assert one_line(e) and "char" in str(e.value) and "gpt2" in str(e.value)
    assert open_dataset(str(out), saved_tokenizer={"type": "gpt2"}).vocab_size == 50257
    # a glob over its shards finds tokenizer.json beside them; val is "train" -> "val"
    g = open_dataset(str(out / "train_*.bin"))
    assert len(g.train) == n and len(g.val) == len(ids) - n and g.tokenizer == ds.tokenizer
    # a shard listed in prepare.json but gone
    os.unlink(out / "val_000000.bin")
    with pytest.raises(DataError) as e:
        open_dataset(str(out))
    assert one_line(e) and "val_000000.bin" in str(e.value)


def test_nanogpt_dir(tmp_path):
    d = tmp_path / "nano"
    d.mkdir()
    np.arange(0, 300, dtype=np.uint16).tofile(d / "train.bin")
    np.arange(300, 340, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.pkl").write_bytes(b"x")
    ds = open_dataset(str(d), "gpt2")
    assert ds.kind == "nanogpt" and len(ds.train) == 300 and len(ds.val) == 40
    assert ds.val.read(0, 3).tolist() == [300, 301, 302]
    assert open_dataset(str(d / "train.bin"), "gpt2").val.read(0, 1).tolist() == [300]


def test_glob(tmp_path):
    d = _llmc_dir(tmp_path)
    ds = open_dataset(str(d / "*train*.bin"), "gpt2")
    assert len(ds.train) == 100 and len(ds.val) == 50
    ds = open_dataset(str(d / "*_train_000002.bin"), "gpt2", val_data=str(d / "*val*"))
    assert len(ds.train) == 40 and len(ds.val) == 50
    one = open_dataset(str(d / "tiny_shakespeare_train_000001.bin"), "gpt2",
                       val_data=str(d / "tiny_shakespeare_val.bin"))
    assert len(one.train) == 60 and len(one.val) == 50
    with pytest.raises(DataError) as e:
        open_dataset(str(d / "*nothing*.bin"), "gpt2")
    assert one_line(e) and "*nothing*" in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(d / "*_000001.bin"), "gpt2")                   # no "train" to replace
    assert one_line(e) and "val_data" in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(d / "*train*.bin"), "gpt2", val_data=str(d / "*missing*"))
    assert one_line(e) and "*missing*" in str(e.value)
    os.unlink(d / "tiny_shakespeare_val.bin")
    with pytest.raises(DataError) as e:
        open_dataset(str(d / "*train*.bin"), "gpt2")
    assert one_line(e) and "val" in str(e.value)


def test_bad_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        open_dataset(str(empty), "gpt2")
    assert one_line(e) and str(empty) in str(e.value) and "looked for" in str(e.value)
    d = _llmc_dir(tmp_path, "noval")
    os.unlink(d / "tiny_shakespeare_val.bin")
    with pytest.raises(DataError) as e:
        open_dataset(str(d), "gpt2")
    assert one_line(e) and "no val files" in str(e.value)
    d = _llmc_dir(tmp_path, "corrupt")
    with open(d / "tiny_shakespeare_train_000002.bin", "r+b") as f:
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(DataError) as e:
        open_dataset(str(d), "gpt2")
    assert one_line(e) and "tiny_shakespeare_train_000002.bin" in str(e.value) and "magic" in str(e.value)
    d = _llmc_dir(tmp_path, "bigids")
    write_shard(d / "tiny_shakespeare_train_000003.bin", np.array([5, 60000, 6]), 65536)
    with pytest.raises(DataError) as e:                 # checked up front (data/checks.py), not at a step
        open_dataset(str(d), "gpt2")
    assert one_line(e) and "tiny_shakespeare_train_000003.bin" in str(e.value) and "60000" in str(e.value)
    assert "position 1" in str(e.value)
    ts = TokenStream([open_shard(d / "tiny_shakespeare_train_000003.bin")], ["x.bin"], 50257)
    with pytest.raises(DataError) as e:                 # and where the ids are gathered, as before
        ts.read(0, 3)
    assert one_line(e) and "x.bin" in str(e.value) and "60000" in str(e.value)
    with pytest.raises(DataError) as e:
        open_dataset(str(d), "gpt2", val_data="x")
    assert one_line(e)
    assert glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True) == []


def test_glob_split_directories(tmp_path):
    for split, ids in (("train", np.arange(10)), ("val", np.arange(10, 14))):
        (tmp_path / split).mkdir()
        write_shard(tmp_path / split / "part_000.bin", ids, 50257)
    ds = open_dataset(str(tmp_path / "train" / "*.bin"), "gpt2")
    assert len(ds.train) == 10 and ds.val.read(0, 4).tolist() == [10, 11, 12, 13]


def test_bad_tokenizer_json(tmp_path):
    d = _llmc_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"type": "gpt2"')
    with pytest.raises(DataError) as e:
        open_dataset(str(d))
    assert one_line(e) and str(d / "tokenizer.json") in str(e.value)
    (d / "tokenizer.json").write_text('{"type": "gpt2"}')
    assert open_dataset(str(d)).vocab_size == 50257
    with pytest.raises(DataError) as e:
        open_dataset(str(d), "bpe:1000")                 # asked for another tokenizer than the data's
    assert one_line(e) and "bpe:1000" in str(e.value) and "gpt2" in str(e.value)
