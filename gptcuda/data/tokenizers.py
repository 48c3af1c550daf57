"""Tokenizers: one interface, three kinds.

    spec        class            vocabulary                                  end of text
    "char"      CharTokenizer    the corpus's sorted distinct characters      none (eot_id None)
    "gpt2"      GPT2Tokenizer    GPT-2's byte-level BPE, 50257 tokens         <|endoftext|> = 50256
    "bpe:N"     BPETokenizer     a byte-level BPE of N tokens trained on      <|endoftext|> = N - 1
                                 the user's corpus (256 bytes + merges + eot)

Every tokenizer has `name` (its spec), `vocab_size` (the real vocabulary, no padding), `eot_id`,
`encode(text) -> int32 ids`, `decode(ids) -> str`, `to_dict()` (JSON-able and self-contained:
`tokenizer_from_dict` rebuilds the exact tokenizer from it alone), `save(path)` (atomic) and `==`.

encode() treats "<|endoftext|>" in the text as ordinary text: the end-of-text id never comes from
text, only from whoever joins documents (prepare.py puts it before each document, as llm.c does).
decode() of a byte-level BPE replaces a partial UTF-8 sequence by U+FFFD instead of raising.

GPT-2 works offline: the encoding is built from the OpenAI files shipped in data/gpt2/ (checked
against the sha256s tiktoken itself checks) or, when those are missing (a non-editable install),
from tiktoken's download cache if a network-connected run ever filled it; never from the network.

Safe chunk boundaries (`safe_chunks`): GPT-2's pre-tokenizer regex (and HF's ByteLevel one) never
lets a pre-token span from a non-whitespace character into the whitespace that follows it, and it
has no look-behind. So cutting a text just before a "\\n" whose previous character is not
whitespace gives the same ids as encoding it whole. (Cutting just AFTER a "\\n" is not safe: in
"a\\n\\nB" the whole text pre-tokenizes "\\n" "\\n" but the piece "a\\n\\n" ends in one "\\n\\n" token,
because a whitespace run's look-ahead sees the end of the piece instead of "B".)
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading

import numpy as np

from gptcuda.files import atomic_open

__all__ = ["CharTokenizer", "GPT2Tokenizer", "BPETokenizer", "ENDOFTEXT", "parse_spec", "tokenizer_from_dict",
           "load_tokenizer", "make_tokenizer", "safe_chunks", "last_safe_cut", "next_safe_cut"]

ENDOFTEXT = "<|endoftext|>"

# GPT-2's files, as tiktoken_ext/openai_public.py names and checks them
GPT2_FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
GPT2_VOCAB = 50257
GPT2_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "data", "gpt2"))

BPE_MIN = 257            # 256 byte tokens + <|endoftext|>
BPE_MAX = 2 ** 31 - 1    # ids are int32

# encode() of a text longer than this splits it at safe boundaries and encodes the pieces in parallel
_PARALLEL_CHARS = 1 << 22
_PIECE_CHARS = 1 << 20
_BPE_PIECE_CHARS = 1 << 14


def _one_line(e) -> str:
    return " ".join(str(e).split())


def _check_ids(ids, vocab_size: int) -> np.ndarray:
    """ids as a flat int64 array, every one in [0, vocab_size); else ValueError naming the first bad one."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        return ids.astype(np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"token id {int(ids[i])} at position {i} is outside the vocabulary (0..{vocab_size - 1})")
    return ids.astype(np.int64, copy=False)


# --- safe chunk boundaries (see the module docstring)

def last_safe_cut(text: str, lo: int, hi: int) -> int:
    """The largest p with lo < p <= hi, p < len(text), text[p] == "\\n" and text[p-1] not whitespace; -1 if none.

    Encoding text[:p] and text[p:] apart gives the ids of encoding text whole."""
    hi = min(hi, len(text) - 1)
    p = text.rfind("\n", lo + 1, hi + 1)
    while p > lo:
        if not text[p - 1].isspace():   # str.isspace covers every character \\s matches in the BPE regexes
            return p
        p = text.rfind("\n", lo + 1, p)
    return -1


_SAFE_CUT = re.compile(r"(?<=\S)\n")     # (Python's \S is "not str.isspace()")


def next_safe_cut(text: str, start: int) -> int:
    """The smallest p >= start with text[p] == "\\n" and text[p-1] not whitespace; -1 if none."""
    m = _SAFE_CUT.search(text, max(start, 1))
    return m.start() if m else -1


def safe_chunks(text: str, target: int = _PIECE_CHARS):
    """Yield consecutive pieces of text, each about `target` characters (longer where no safe cut is near),
    cut only at safe boundaries: "".join(pieces) == text and their ids concatenated equal text's ids."""
    pos, n = 0, len(text)
    while n - pos > target:
        p = last_safe_cut(text, pos, pos + target)
        if p < 0:                       # none in the window: the first one after it, or the rest
            p = next_safe_cut(text, pos + target)
        if p < 0:
            break
        yield text[pos:p]
        pos = p
    if pos < n:
        yield text[pos:]


# --- char

class CharTokenizer:
    """Maps each of a fixed list of characters to its index."""

    name = "char"
    eot_id = None

    def __init__(self, chars: list[str]):
        chars = list(chars)
        seen: dict[str, int] = {}
        for i, c in enumerate(chars):
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"tokenizer entry {i} must be a single character, got {c!r}")
            if c in seen:
                raise ValueError(f"tokenizer character {c!r} appears twice (entries {seen[c]} and {i})")
            seen[c] = i
        if not chars:
            raise ValueError("tokenizer needs at least one character")
        self.chars = chars
        self.stoi = seen
        # code point -> id lookup table (-1: not in the vocabulary)
        cps = np.array([ord(c) for c in chars], dtype=np.int64)
        self._lut = np.full(int(cps.max()) + 1, -1, dtype=np.int32)
        self._lut[cps] = np.arange(len(chars), dtype=np.int32)
        self._chars_arr = np.array(chars, dtype="<U1")

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of text; a character outside the vocabulary raises ValueError."""
        if not text:
            return np.zeros(0, dtype=np.int32)
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        in_range = cps < len(self._lut)
        ids = np.where(in_range, self._lut[np.where(in_range, cps, 0)], -1).astype(np.int32)
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            pos = int(bad[0])
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the tokenizer's vocabulary "
                f"({self.vocab_size} characters)")
        return ids

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return ""
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token id {int(ids[i])} at position {i} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return "".join(self._chars_arr[ids].tolist())

    # --- serialisation
    def to_dict(self) -> dict:
        return {"type": "char", "chars": list(self.chars)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, obj) -> "CharTokenizer":
        """From to_json()'s string (or the equivalent dict)."""
        d = json.loads(obj) if isinstance(obj, (str, bytes)) else obj
        if not isinstance(d, dict) or d.get("type", "char") != "char" or not isinstance(d.get("chars"), list):
            raise ValueError("not a character tokenizer description")
        return cls(d["chars"])

    def save(self, path: str | os.PathLike) -> None:
        with atomic_open(os.fspath(path)) as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(f.read())
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer file not found: {path}") from None
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"bad tokenizer file {path}: {' '.join(str(e).split())}") from None


def _char_vocabulary(texts) -> list[str]:
    """sorted(set(all the texts' characters)), streaming: code points < 65536 in a bitmap, the rest in a set."""
    small = np.zeros(1 << 16, dtype=bool)
    big: set[int] = set()
    for t in texts:
        cps = np.frombuffer(t.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        low = cps < (1 << 16)
        small[cps[low]] = True
        if not low.all():
            big.update(np.unique(cps[~low]).tolist())
    return [chr(c) for c in np.flatnonzero(small).tolist()] + [chr(c) for c in sorted(big)]


# --- shared by the two BPE kinds

class _Base:
    name: str
    vocab_size: int
    eot_id: int | None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | os.PathLike) -> None:
        with atomic_open(os.fspath(path)) as f:
            f.write(self.to_json())

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


# --- GPT-2 through tiktoken

_gpt2_lock = threading.Lock()
_gpt2_encoding = None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tiktoken_cache_dir() -> str | None:
    """Where tiktoken's read_file_cached keeps downloads (None: caching disabled)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        import tempfile
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return d or None


def _gpt2_files() -> dict[str, str]:
    """{"vocab.bpe": path, "encoder.json": path}, checked against their sha256; one-line errors."""
    shipped = os.environ.get("GPTCUDA_GPT2_DIR") or GPT2_DIR
    paths = {name: os.path.join(shipped, name) for name in GPT2_FILES}
    if all(os.path.isfile(p) for p in paths.values()):
        for name, p in paths.items():
            if _sha256(p) != GPT2_FILES[name][1]:
                raise ValueError(f"{p} is not GPT-2's {name} (sha256 differs from {GPT2_FILES[name][1]})")
        return paths
    cache = _tiktoken_cache_dir()     # a cache filled by a tiktoken download, keyed by sha1(url)
    if cache:
        cached = {name: os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
                  for name, (url, _) in GPT2_FILES.items()}
        if all(os.path.isfile(p) and _sha256(p) == GPT2_FILES[n][1] for n, p in cached.items()):
            return cached
    raise FileNotFoundError(
        f"GPT-2 tokenizer files not found: {paths['encoder.json']} and {paths['vocab.bpe']} (shipped in the "
        f"repository's data/gpt2/; set GPTCUDA_GPT2_DIR to a directory holding them)")


def _gpt2() -> "tiktoken.Encoding":  # noqa: F821
    """tiktoken's gpt2 Encoding built from local files (once per process)."""
    global _gpt2_encoding
    with _gpt2_lock:
        if _gpt2_encoding is None:
            import tiktoken
            from tiktoken.load import data_gym_to_mergeable_bpe_ranks
            from tiktoken_ext.openai_public import r50k_pat_str
            files = _gpt2_files()   # hashes checked there
            # TIKTOKEN_CACHE_DIR="" makes tiktoken read the local files directly instead of copying them into
            # its download cache under a key made from our paths
            saved = os.environ.get("TIKTOKEN_CACHE_DIR")
            os.environ["TIKTOKEN_CACHE_DIR"] = ""
            try:
                ranks = data_gym_to_mergeable_bpe_ranks(
                    vocab_bpe_file=files["vocab.bpe"], encoder_json_file=files["encoder.json"],
                    vocab_bpe_hash=GPT2_FILES["vocab.bpe"][1], encoder_json_hash=GPT2_FILES["encoder.json"][1])
            finally:
                if saved is None:
                    del os.environ["TIKTOKEN_CACHE_DIR"]
                else:
                    os.environ["TIKTOKEN_CACHE_DIR"] = saved
            # as tiktoken_ext/openai_public.py's gpt2()
            _gpt2_encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                               special_tokens={ENDOFTEXT: GPT2_VOCAB - 1},
                                               explicit_n_vocab=GPT2_VOCAB)
        return _gpt2_encoding


class GPT2Tokenizer(_Base):
    """GPT-2's byte-level BPE: tiktoken's `gpt2` ids, <|endoftext|> = 50256."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB
    eot_id = GPT2_VOCAB - 1

    def __init__(self):
        self.enc = _gpt2()

    def __eq__(self, other) -> bool:
        return isinstance(other, GPT2Tokenizer)

    def encode(self, text: str) -> np.ndarray:
        if len(text) > _PARALLEL_CHARS:
            parts = self.enc.encode_ordinary_batch(list(safe_chunks(text)), num_threads=os.cpu_count() or 1)
            return np.concatenate([np.array(p, dtype=np.int32) for p in parts])
        return np.array(self.enc.encode_ordinary(text), dtype=np.int32)

    def decode(self, ids) -> str:
        return self.enc.decode(_check_ids(ids, self.vocab_size).tolist(), errors="replace")

    def to_dict(self) -> dict:
        return {"type": "gpt2"}


# --- byte-level BPE trained with HF tokenizers

class BPETokenizer(_Base):
    """A byte-level BPE of N tokens trained on the user's corpus: ids 0..N-2 the 256 bytes and the learned
    merges, N-1 <|endoftext|>. Built with HF `tokenizers` (ByteLevel pre-tokenizer, no prefix space)."""

    def __init__(self, hf, n: int, json_str: str):
        self.hf = hf
        self.hf.encode_special_tokens = True      # "<|endoftext|>" in text is text
        self.json = json_str
        self.vocab_size = n
        self.name = f"bpe:{n}"
        self.eot_id = hf.token_to_id(ENDOFTEXT)

    @staticmethod
    def _check_n(n) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not BPE_MIN <= n <= BPE_MAX:
            raise ValueError(f"bpe vocabulary size must be an integer in {BPE_MIN}..{BPE_MAX} "
                             f"(256 bytes + merges + <|endoftext|>), got {n!r}")
        return int(n)

    @classmethod
    def train(cls, texts, n: int) -> "BPETokenizer":
        """Train on an iterable of strings (streamed; the pieces should be cut at safe boundaries)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        n = cls._check_n(n)
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=n - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      min_frequency=0, show_progress=False)
        hf.train_from_iterator(iter(texts), trainer)
        got = hf.get_vocab_size() + 1
        if got < n:
            raise ValueError(f"bpe:{n}: the corpus yields only {got} tokens (256 bytes + {got - 257} merges + "
                             f"<|endoftext|>); use bpe:{got} or less, or a larger corpus")
        hf.add_special_tokens([ENDOFTEXT])        # id n-1
        return cls(hf, n, hf.to_str())

    @classmethod
    def from_dict(cls, d: dict) -> "BPETokenizer":
        from tokenizers import Tokenizer
        n = cls._check_n(d.get("vocab_size"))
        if not isinstance(d.get("json"), str):
            raise ValueError("bpe tokenizer description has no \"json\" string")
        try:
            hf = Tokenizer.from_str(d["json"])
        except Exception as e:
            raise ValueError(f"bpe tokenizer JSON does not load: {_one_line(e)}") from None
        if hf.get_vocab_size() != n or hf.token_to_id(ENDOFTEXT) != n - 1:
            raise ValueError(f"bpe tokenizer JSON holds {hf.get_vocab_size()} tokens with <|endoftext|> at "
                             f"{hf.token_to_id(ENDOFTEXT)}, not {n} with it at {n - 1}")
        return cls(hf, n, d["json"])

    def __eq__(self, other) -> bool:
        return isinstance(other, BPETokenizer) and self.json == other.json

    def encode(self, text: str) -> np.ndarray:
        if len(text) > _BPE_PIECE_CHARS:
            # a batch of small safe pieces: HF encodes them on its own threads (when it may), and even on one
            # thread encode_batch_fast (no offsets) of small pieces beats one encode() of the whole
            batch = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
            encs = batch(list(safe_chunks(text, _BPE_PIECE_CHARS)), add_special_tokens=False)
            return np.concatenate([np.array(e.ids, dtype=np.int32) for e in encs])
        return np.array(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        # the ByteLevel decoder turns bytes into text with from_utf8_lossy: partial UTF-8 becomes U+FFFD
        return self.hf.decode(_check_ids(ids, self.vocab_size).tolist(), skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {"type": "bpe", "vocab_size": self.vocab_size, "json": self.json}


# --- construction

def parse_spec(spec) -> tuple[str, int | None]:
    """"char" -> ("char", None), "gpt2" -> ("gpt2", None), "bpe:N" -> ("bpe", N); else one-line ValueError."""
    if isinstance(spec, str):
        s = spec.strip()
        if s in ("char", "gpt2"):
            return s, None
        m = re.fullmatch(r"bpe:(\d+)", s)
        if m:
            n = int(m.group(1))
            if not BPE_MIN <= n <= BPE_MAX:
                raise ValueError(f"tokenizer {spec!r}: N must be in {BPE_MIN}..{BPE_MAX} "
                                 f"(256 bytes + merges + <|endoftext|>)")
            return "bpe", n
    raise ValueError(f"unknown tokenizer {spec!r} (char, gpt2 or bpe:N)")


def tokenizer_from_dict(d):
    """The tokenizer a to_dict() describes."""
    if not isinstance(d, dict):
        raise ValueError(f"a tokenizer description must be a JSON object, got {type(d).__name__}")
    kind = d.get("type", "char" if "chars" in d else None)
    if kind == "char":
        return CharTokenizer.from_json(d)
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        return BPETokenizer.from_dict(d)
    raise ValueError(f"unknown tokenizer type {kind!r} (char, gpt2, bpe)")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved at path (a to_dict() as JSON)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"bad tokenizer file {path}: a directory") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"bad tokenizer file {path}: {_one_line(e)}") from None
    try:
        return tokenizer_from_dict(d)
    except ValueError as e:
        raise ValueError(f"bad tokenizer file {path}: {_one_line(e)}") from None


def make_tokenizer(spec: str, texts=()):
    """A new tokenizer for spec. texts (an iterable of strings, or a callable returning one) is read only
    by char (its sorted distinct characters) and bpe:N (its training corpus)."""
    kind, n = parse_spec(spec)
    if kind == "gpt2":
        return GPT2Tokenizer()
    if callable(texts):
        texts = texts()
    if kind == "char":
        chars = _char_vocabulary(texts)
        if not chars:
            raise ValueError("a char tokenizer needs a non-empty text")
        return CharTokenizer(chars)
    return BPETokenizer.train(texts, n)
