import hashlib
import json
import os

import numpy as np
import pytest

from gptcuda.data import text as data, tokenizers as toks
from gptcuda.data.tokenizers import (BPETokenizer, CharTokenizer, GPT2Tokenizer, load_tokenizer,
                                     make_tokenizer, parse_spec, safe_chunks, tokenizer_from_dict)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare", "input.txt")
GPT2_DIR = os.path.join(ROOT, "data", "gpt2")

# unicode, whitespace runs of every kind, contractions, digits, a literal end-of-text marker
ODD = ("naïve café — 東京 🙂 emoji👍🏽 ĳ\u00a0nbsp\u2003em\tTab\t\t  \n\n\n   \r\n  x  \n"
       "it's we'll they'RE 12345 3.14159 ...!!! <|endoftext|> trailing   \n \n\t\nend  ")


def shakespeare(n=None):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        return f.read() if n is None else f.read(n)


def one_line(e):
    return "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def small_bpe():
    return BPETokenizer.train([shakespeare(60000), ODD], 400)


# --- GPT-2

def test_gpt2_known_ids(gpt2):
    assert gpt2.name == "gpt2" and gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.encode("Hello world").tolist() == [15496, 995]
    ids = gpt2.encode(" <|endoftext|>")            # text, not the special token
    assert ids.tolist() == [1279, 91, 437, 1659, 5239, 91, 29] and 50256 not in ids
    assert gpt2.encode("").dtype == np.int32 and gpt2.encode("").shape == (0,)
    assert gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.to_dict() == {"type": "gpt2"} and tokenizer_from_dict({"type": "gpt2"}) == gpt2


def test_shipped_files_are_gpt2s():
    for name, (_, sha) in toks.GPT2_FILES.items():
        with open(os.path.join(GPT2_DIR, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha
    assert os.path.isfile(os.path.join(GPT2_DIR, "LICENSE"))


def test_gpt2_equals_independent_hf_bpe(gpt2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    hf = Tokenizer(models.BPE.from_file(os.path.join(GPT2_DIR, "encoder.json"), os.path.join(GPT2_DIR, "vocab.bpe")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    text = shakespeare(5000) + ODD + shakespeare()[500000:502000]
    ids = gpt2.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == hf.encode(text).ids
    assert gpt2.decode(ids) == text


def test_gpt2_decode_partial_utf8_and_range(gpt2):
    ids = gpt2.encode("🙂")
    assert len(ids) > 1
    assert "\ufffd" in gpt2.decode(ids[:1])            # a partial UTF-8 sequence does not raise
    with pytest.raises(ValueError) as e:
        gpt2.decode([1, 50257])
    assert one_line(e) and "50257" in str(e.value) and "position 1" in str(e.value)
    with pytest.raises(ValueError):
        gpt2.decode([-1])


def test_gpt2_offline_sources(tmp_path, monkeypatch):
    # the shipped files, however tiktoken's cache is set (nothing is downloaded)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert toks._gpt2_files()["encoder.json"] == os.path.join(toks.GPT2_DIR, "encoder.json")
    assert not (tmp_path / "empty-cache").exists()
    # without them: tiktoken's cache when it holds the files, keyed by sha1(url)
    monkeypatch.setenv("GPTCUDA_GPT2_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as e:
        toks._gpt2_files()
    assert one_line(e) and "nowhere" in str(e.value) and "GPTCUDA_GPT2_DIR" in str(e.value)
    cache = tmp_path / "cache"
    cache.mkdir()
    for name, (url, _) in toks.GPT2_FILES.items():
        with open(os.path.join(GPT2_DIR, name), "rb") as f:
            (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(f.read())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert toks._gpt2_files()["vocab.bpe"].startswith(str(cache))
    # a shipped file that is not GPT-2's
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "encoder.json").write_text("{}")
    (bad / "vocab.bpe").write_text("#version: 0.2\n")
    monkeypatch.setenv("GPTCUDA_GPT2_DIR", str(bad))
    with pytest.raises(ValueError) as e:
        toks._gpt2_files()
    assert one_line(e) and "sha256" in str(e.value) and str(bad) in str(e.value)


# --- safe chunk boundaries

def test_safe_chunks_give_whole_text_ids(gpt2, small_bpe):
    text = shakespeare(20000) + ODD * 3 + "word \nNext\n\nPara  \n\tX\nY" + shakespeare(3000)
    for target in (1, 7, 50, 333, 5000):
        pieces = list(safe_chunks(text, target))
        assert "".join(pieces) == text
        for p in pieces[1:]:
            assert p[0] == "\n"
        for tok in (gpt2, small_bpe):
            joined = np.concatenate([tok.encode(p) for p in pieces])
            assert np.array_equal(joined, tok.encode(text)), (target, tok.name)
    assert list(safe_chunks("no newline at all " * 10, 5)) == ["no newline at all " * 10]


def test_cutting_after_a_newline_is_not_safe(gpt2):
    # why the cut goes BEFORE a "\n" that follows a non-space: after "\n\n" the ids change
    assert (gpt2.encode("a\n\n").tolist() + gpt2.encode("B").tolist()) != gpt2.encode("a\n\nB").tolist()
    assert (gpt2.encode("a").tolist() + gpt2.encode("\n\nB").tolist()) == gpt2.encode("a\n\nB").tolist()


def test_large_text_parallel_encode(gpt2, small_bpe, monkeypatch):
    text = shakespeare(40000) + ODD
    whole = {t.name: t.encode(text) for t in (gpt2, small_bpe)}
    monkeypatch.setattr(toks, "_PARALLEL_CHARS", 1000)
    monkeypatch.setattr(toks, "_PIECE_CHARS", 3000)
    monkeypatch.setattr(toks, "_BPE_PIECE_CHARS", 2000)
    for t in (gpt2, small_bpe):
        ids = t.encode(text)
        assert ids.dtype == np.int32 and np.array_equal(ids, whole[t.name])


# --- bpe:N

def test_bpe_train_save_load(small_bpe, tmp_path):
    tok = small_bpe
    assert tok.name == "bpe:400" and tok.vocab_size == 400 and tok.eot_id == 399
    text = shakespeare(2000) + ODD
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 399
    assert tok.decode(ids) == text
    assert 399 not in tok.encode("<|endoftext|>")      # text, not the special token
    assert tok.decode([399]) == "<|endoftext|>"
    assert len(tok.encode(text)) < len(text.encode())  # it learned merges
    d = tok.to_dict()
    assert d["type"] == "bpe" and d["vocab_size"] == 400 and isinstance(d["json"], str)
    p = tmp_path / "tokenizer.json"
    tok.save(p)
    assert os.listdir(tmp_path) == ["tokenizer.json"]
    back = load_tokenizer(p)
    assert isinstance(back, BPETokenizer) and back == tok and back.name == "bpe:400"
    assert np.array_equal(back.encode(text), ids)
    assert 399 not in back.encode("x<|endoftext|>y")
    with pytest.raises(ValueError) as e:
        tok.decode([400])
    assert one_line(e)


def test_bpe_deterministic(small_bpe):
    again = make_tokenizer("bpe:400", lambda: iter([shakespeare(60000), ODD]))
    assert again == small_bpe and again.json == small_bpe.json


def test_bpe_bad_sizes():
    with pytest.raises(ValueError) as e:
        BPETokenizer.train(["tiny corpus"], 300)
    assert one_line(e) and "bpe:300" in str(e.value) and "only" in str(e.value)
    for n in (256, 0, -1, 2 ** 31, "300", True):
        with pytest.raises(ValueError):
            BPETokenizer.train(["abc"], n)


def test_bpe_bad_dict():
    with pytest.raises(ValueError):
        tokenizer_from_dict({"type": "bpe", "vocab_size": 300})
    with pytest.raises(ValueError) as e:
        tokenizer_from_dict({"type": "bpe", "vocab_size": 300, "json": "{not json"})
    assert one_line(e)


# --- char

def test_char_is_todays_tokenizer():
    assert data.CharTokenizer is CharTokenizer
    text = shakespeare(10000) + "Äpfel ✓ 🙂\U0001F600"
    tok = make_tokenizer("char", [text[:5000], text[5000:]])
    assert tok == CharTokenizer.from_text(text) and tok.chars == sorted(set(text))
    assert tok.name == "char" and tok.eot_id is None
    assert tok.to_dict() == {"type": "char", "chars": sorted(set(text))}
    assert tokenizer_from_dict(tok.to_dict()) == tok
    assert tokenizer_from_dict({"chars": ["a", "b"]}) == CharTokenizer(["a", "b"])   # no "type": char
    with pytest.raises(ValueError):
        make_tokenizer("char", [""])


# --- specs and files

def test_parse_spec():
    assert parse_spec("char") == ("char", None)
    assert parse_spec("gpt2") == ("gpt2", None)
    assert parse_spec("bpe:8192") == ("bpe", 8192)
    for bad in ("bpe", "bpe:", "bpe:x", "bpe:256", "bpe:-5", "gpt3", "", "BPE:300", None, 5):
        with pytest.raises(ValueError) as e:
            parse_spec(bad)
        assert one_line(e) and repr(bad) in str(e.value)


def test_load_tokenizer_errors(tmp_path):
    missing = str(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(missing)
    assert one_line(e) and missing in str(e.value)
    p = tmp_path / "tok.json"
    p.write_text(json.dumps(CharTokenizer(list("abc")).to_dict())[:-7])    # truncated
    with pytest.raises(ValueError) as e:
        load_tokenizer(p)
    assert one_line(e) and str(p) in str(e.value)
    p.write_text('{"type": "sentencepiece"}')
    with pytest.raises(ValueError) as e:
        load_tokenizer(p)
    assert one_line(e) and str(p) in str(e.value) and "sentencepiece" in str(e.value)
    p.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError) as e:
        load_tokenizer(p)
    assert one_line(e)
    p.write_text(CharTokenizer(list("xy")).to_json())
    assert load_tokenizer(p) == CharTokenizer(["x", "y"])


def test_safe_chunks_fuzz(gpt2, small_bpe):
    rng = np.random.default_rng(0)
    alphabet = ["a", "b", " ", "  ", "\n", "\t", "\r", "\u00a0", "\u0085", "\x1c", "\u3000", "'", "s", "ll", "1",
                ".", "é", "🙂", "東"]
    for trial in range(30):
        text = "".join(rng.choice(alphabet, size=300).tolist())
        for tok in (gpt2, small_bpe):
            whole = tok.encode(text)
            for target in (3, 17):
                pieces = list(safe_chunks(text, target))
                assert "".join(pieces) == text
                assert np.array_equal(np.concatenate([tok.encode(p) for p in pieces]), whole), (trial, text)
