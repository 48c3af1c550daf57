import json
import os
import subprocess
import sys

import numpy as np
import pytest

import prepare
from gptcuda.data.text import TextDataset
from gptcuda.data.dataset import DataError, open_dataset
from gptcuda.data.shards import open_shard
from gptcuda.data.tokenizers import BPETokenizer, GPT2Tokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare", "input.txt")


def text_of(n=None):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        return f.read() if n is None else f.read(n)


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


def run(capsys, *argv):
    rc = prepare.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def tokens(out, split):
    meta = json.loads((out / "prepare.json").read_text())
    return np.concatenate([open_shard(out / s["file"]) for s in meta["splits"][split]["shards"]]).astype(np.int64)


def test_shakespeare_gpt2(tmp_path, capsys, gpt2):
    out = tmp_path / "sg"
    rc, so, _ = run(capsys, SHAKESPEARE, "--out", out, "--workers", 2)
    assert rc == 0 and "304,223 train tokens" in so
    assert sorted(os.listdir(out)) == ["prepare.json", "tokenizer.json", "train_000000.bin", "val_000000.bin"]
    ids = np.concatenate([[50256], gpt2.encode(text_of())])               # llm.c: EOT before the document
    n = int(0.9 * len(ids))
    assert np.array_equal(tokens(out, "train"), ids[:n]) and np.array_equal(tokens(out, "val"), ids[n:])
    # llm.c's header, byte for byte
    raw = (out / "train_000000.bin").read_bytes()
    want = (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + n.to_bytes(4, "little") + bytes(1012)
    assert raw[:1024] == want and len(raw) == 1024 + 2 * n
    assert raw[1024:1030] == np.array(ids[:3], "<u2").tobytes()
    assert load_tokenizer(out / "tokenizer.json") == gpt2
    meta = json.loads((out / "prepare.json").read_text())
    assert meta["settings"] == {"tokenizer": "gpt2", "val_fraction": 0.1, "shard_tokens": 100000000}
    assert meta["inputs"][0]["path"] == SHAKESPEARE and meta["inputs"][0]["size"] == 1115394
    assert meta["inputs"][0]["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert meta["splits"]["train"]["tokens"] == n and meta["splits"]["val"]["tokens"] == len(ids) - n
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]       # no temp dir left
    # a re-run is a no-op
    before = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}
    rc, so, _ = run(capsys, SHAKESPEARE, "--out", out, "--workers", 3)
    assert rc == 0 and "up to date" in so and so.count("\n") == 1
    assert {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)} == before


def test_rerun_after_changes(tmp_path, capsys, gpt2):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(text_of(3000))
    b.write_text(text_of()[5000:9000])
    out = tmp_path / "out"
    assert run(capsys, a, b, "--out", out, "--shard_tokens", 300)[0] == 0
    n_train = json.loads((out / "prepare.json").read_text())["splits"]["train"]["tokens"]
    assert len([f for f in os.listdir(out) if f.startswith("train_")]) == -(-n_train // 300) > 2
    (out / "notes.md").write_text("mine")                                  # not prepare.py's: never touched
    # touched but unchanged: still up to date
    os.utime(a, ns=(1, 1))
    assert "up to date" in run(capsys, a, b, "--out", out, "--shard_tokens", 300)[1]
    # other settings: prepared anew, stale shards removed
    assert run(capsys, a, b, "--out", out, "--shard_tokens", 100000)[0] == 0
    assert sorted(os.listdir(out)) == ["notes.md", "prepare.json", "tokenizer.json", "train_000000.bin",
                                       "val_000000.bin"]
    # changed input content: prepared anew
    b.write_text("New text.\n")
    rc, so, _ = run(capsys, a, b, "--out", out, "--shard_tokens", 100000)
    assert rc == 0 and "up to date" not in so
    ids = np.concatenate([[50256], gpt2.encode(text_of(3000)), [50256], gpt2.encode("New text.\n")])
    assert np.array_equal(np.concatenate([tokens(out, "train"), tokens(out, "val")]), ids)
    assert (out / "notes.md").read_text() == "mine"
    # a deleted shard: prepared anew
    os.unlink(out / "val_000000.bin")
    rc, so, _ = run(capsys, a, b, "--out", out, "--shard_tokens", 100000)
    assert rc == 0 and "up to date" not in so and (out / "val_000000.bin").exists()


def test_chunked_parallel_equals_whole(tmp_path, capsys, monkeypatch, gpt2):
    docs = [text_of(20000) + " \n\n  \t\nend  \n", "naïve café 東京 🙂\r\n\r\nit's  \n\n" * 200,
            "one long line without a newline " * 300]
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / "in" / f"doc{i}.txt"
        p.parent.mkdir(exist_ok=True)
        p.write_text(d, encoding="utf-8")
        paths.append(p)
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 700)
    monkeypatch.setattr(prepare, "READ_BYTES", 333)       # also splits UTF-8 sequences across reads
    out = tmp_path / "out"
    assert run(capsys, tmp_path / "in", "--out", out, "--workers", 2)[0] == 0  # a directory input
    whole = np.concatenate([np.concatenate([[50256], gpt2.encode(d)]) for d in docs])
    assert np.array_equal(np.concatenate([tokens(out, "train"), tokens(out, "val")]), whole)
    # the pieces it encodes really are small and cut only before "\n"
    pieces = [t for t, _ in prepare._read_pieces(str(paths[0]))]
    assert len(pieces) > 20 and "".join(pieces) == docs[0] and all(p[0] == "\n" for p in pieces[1:])


def test_char_matches_text_dataset(tmp_path, capsys):
    out = tmp_path / "c"
    assert run(capsys, SHAKESPEARE, "--out", out, "--tokenizer", "char", "--workers", 1)[0] == 0
    ds = TextDataset(SHAKESPEARE)
    assert load_tokenizer(out / "tokenizer.json") == ds.tokenizer
    assert np.array_equal(tokens(out, "train"), ds.train) and np.array_equal(tokens(out, "val"), ds.val)


def test_bpe_and_glob(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text(text_of()[i * 20000:(i + 1) * 20000])
    out = tmp_path / "b"
    rc, so, _ = run(capsys, tmp_path / "part*.txt", "--out", out, "--tokenizer", "bpe:300", "--val_fraction", 0.05)
    assert rc == 0 and "3 documents" in so
    tok = load_tokenizer(out / "tokenizer.json")
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300 and tok.eot_id == 299
    ids = np.concatenate([tokens(out, "train"), tokens(out, "val")])
    assert (ids == 299).sum() == 3 and ids[0] == 299
    assert tok.decode(ids[1:]).split("<|endoftext|>") == [text_of()[i * 20000:(i + 1) * 20000] for i in range(3)]
    assert len(tokens(out, "val")) == len(ids) - int(0.95 * len(ids))


@pytest.mark.parametrize("case", ["missing", "empty", "nul", "latin1", "nomatch", "emptydir", "tokenizer",
                                  "bpe_small", "vf0", "vf1", "vfx", "shard0", "workers0", "noout", "noinput",
                                  "foreign", "toofew", "unknown_opt"])
def test_bad_inputs(tmp_path, capsys, case):
    good = tmp_path / "good.txt"
    good.write_text("Some text.\n")
    bad = tmp_path / "bad.txt"
    out = tmp_path / "sub" / "out"
    args = [good, "--out", out]
    if case == "missing":
        args[0] = tmp_path / "missing.txt"
    elif case == "empty":
        bad.write_bytes(b"")
        args[0] = bad
    elif case == "nul":
        bad.write_bytes(b"text\x00more")
        args[0] = bad
    elif case == "latin1":
        bad.write_bytes("fine\ncaf\xe9\n".encode("latin-1"))
        args[0] = bad
    elif case == "nomatch":
        args[0] = tmp_path / "*.md"
    elif case == "emptydir":
        (tmp_path / "d").mkdir()
        args[0] = tmp_path / "d"
    elif case == "tokenizer":
        args += ["--tokenizer", "bpe:abc"]
    elif case == "bpe_small":
        args += ["--tokenizer", "bpe:5000"]
    elif case == "vf0":
        args += ["--val_fraction", "0"]
    elif case == "vf1":
        args += ["--val_fraction", "1.5"]
    elif case == "vfx":
        args += ["--val_fraction", "nan"]
    elif case == "shard0":
        args += ["--shard_tokens", "0"]
    elif case == "workers0":
        args += ["--workers", "x"]
    elif case == "noout":
        args = [good]
    elif case == "noinput":
        args = ["--out", out]
    elif case == "foreign":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("x")
    elif case == "toofew":
        args += ["--tokenizer", "char", "--val_fraction", "0.95"]    # 11 tokens: none for train
    elif case == "unknown_opt":
        args += ["--shards", "3"]
    rc, so, err = run(capsys, *args)
    assert rc == 2, (case, err)
    assert err.startswith("error: ") and err.count("\n") == 1, (case, err)
    if case in ("missing", "empty", "nul", "latin1"):
        assert str(args[0]) in err
    if case == "latin1":
        assert "byte 8" in err
    if case == "foreign":
        assert os.listdir(out) == ["keep.txt"]
    else:
        assert not (tmp_path / "sub").exists()                  # nothing half-written, no parents left
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_help():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: python prepare.py" in r.stdout and "--shard_tokens" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), "x.txt"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")


def test_interrupted_install_is_recovered(tmp_path, capsys, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text(text_of(4000))
    out = tmp_path / "out"
    assert run(capsys, src, "--out", out, "--shard_tokens", 200)[0] == 0
    (out / "mine.txt").write_text("x")
    real_replace = os.replace
    calls = []

    def crash(a, b):                     # die after moving the first new file into out
        if os.path.dirname(b) == str(out) and not b.endswith(prepare.MARKER):
            calls.append(b)
            if len(calls) == 2:
                raise KeyboardInterrupt
        real_replace(a, b)
    monkeypatch.setattr(prepare.os, "replace", crash)
    rc, _, err = run(capsys, src, "--out", out, "--shard_tokens", 1000)
    assert rc == 130 and err.count("\n") == 1
    monkeypatch.setattr(prepare.os, "replace", real_replace)
    assert not (out / "prepare.json").exists() and (out / prepare.MARKER).exists()
    with pytest.raises(DataError) as e:                                  # half-installed: not data
        open_dataset(str(out))
    assert "prepare.py" in str(e.value) and "\n" not in str(e.value)
    rc, so, _ = run(capsys, src, "--out", out, "--shard_tokens", 1000)   # ours (the marker says so): redone
    assert rc == 0 and "up to date" not in so
    n = json.loads((out / "prepare.json").read_text())["splits"]["train"]["tokens"]
    assert sorted(os.listdir(out)) == ["mine.txt", "prepare.json", "tokenizer.json"] + [
        f"train_{k:06d}.bin" for k in range(-(-n // 1000))] + ["val_000000.bin"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]
