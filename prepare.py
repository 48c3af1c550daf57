"""Tokenize text into the token shards train.py reads (llm.c's format, see gptcuda/data/shards.py).

usage: python prepare.py INPUT [INPUT ...] --out DIR [--tokenizer gpt2|char|bpe:N] [--val_fraction F]
                         [--shard_tokens N] [--workers N]

    python prepare.py data/tinyshakespeare/input.txt --tokenizer gpt2 --out data/shakespeare_gpt2
    python prepare.py corpus/ --tokenizer bpe:8192 --out data/mycorpus --shard_tokens 100000000
    python prepare.py "books/*.txt" --tokenizer char --out data/books_char --val_fraction 0.05

INPUT            a UTF-8 text file, a directory (its *.txt files, recursively, sorted by path) or a quoted
                 glob pattern. Each file is one document; documents are joined llm.c's way, with
                 <|endoftext|> before each one (char has no end-of-text token: documents are concatenated).
--out DIR        the output directory (required): new, empty, or an earlier output of prepare.py
--tokenizer      gpt2 (default: GPT-2's BPE, works offline), char (the corpus's distinct characters) or
                 bpe:N (a byte-level BPE of N tokens, trained on the inputs first)
--val_fraction   the last fraction of the token stream, which becomes the val split (default 0.1)
--shard_tokens   tokens per shard file (default 100000000)
--workers        encoding processes (default: the number of CPUs it may use)

DIR gets train_000000.bin ... and val_000000.bin ... (llm.c shards: uint16 tokens for vocabularies of up
to 65536, else uint32), tokenizer.json, and prepare.json (the inputs with size, mtime and sha256, the
settings, the tokenizer's name and file sha256, token counts, each split's largest id and the shard
lists: training checks them before its first step). Train on it with data: DIR.

Running again with unchanged inputs (by sha256) and settings prints "up to date" and does nothing; after a
change DIR is prepared anew, its old shards removed. Files in DIR that prepare.py did not write are never
touched. The output is built in a temporary directory beside DIR and moved in at the end, so it appears
complete or not at all (a move into an existing DIR that is interrupted leaves a marker file there: training
refuses the directory and the next run redoes it; a killed run's temporary directory is removed by the next).
One run at a time per DIR: a lock file beside it (.DIR.prepare.lock) names the pid of the run that holds it.
Errors are one line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import codecs
import collections
import glob
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile

try:
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    from gptcuda.data import tokenizers as toks  # noqa: E402
    from gptcuda.errors import RunError  # noqa: E402
    from gptcuda.files import DirLock, atomic_open  # noqa: E402
    from gptcuda.data.checks import file_sha256, max_id  # noqa: E402
    from gptcuda.data.dataset import PREPARE_MARKER as MARKER  # noqa: E402  (lists the files of an install into DIR)
    from gptcuda.data.prepared import (FORMAT, PrepError, install, load_meta, owned, permissions,  # noqa: E402
                                       up_to_date)
    from gptcuda.data.shards import HEADER_BYTES, MAGIC, VERSIONS, DataError, shard_version, write_shard  # noqa: E402
except KeyboardInterrupt:           # Ctrl-C while the modules load: one word, no traceback
    print("interrupted", file=sys.stderr)
    sys.exit(130)

READ_BYTES = 1 << 20             # bytes read from an input at a time
CHUNK_CHARS = 1 << 20            # characters of text encoded per task (cut at safe boundaries)
_GLOB_CHARS = "*?["


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PrepError(message)


def _parse(argv) -> argparse.Namespace:
    p = _Parser(prog="prepare.py", add_help=False, allow_abbrev=False)
    p.add_argument("inputs", nargs="*")
    p.add_argument("--out")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--val_fraction", default="0.1")
    p.add_argument("--shard_tokens", default="100000000")
    p.add_argument("--workers", default=None)
    a = p.parse_args(argv)
    if not a.inputs:
        raise PrepError("no INPUT given (text files, directories or glob patterns); see --help")
    if not a.out:
        raise PrepError("--out DIR is required")
    try:
        toks.parse_spec(a.tokenizer)
    except ValueError as e:
        raise PrepError(f"--tokenizer: {e}") from None
    a.tokenizer = a.tokenizer.strip()
    try:
        a.val_fraction = float(a.val_fraction)
        if not (math.isfinite(a.val_fraction) and 0 < a.val_fraction < 1):
            raise ValueError
    except ValueError:
        raise PrepError(f"--val_fraction must be a number between 0 and 1 (exclusive), got {a.val_fraction!r}") \
            from None
    a.shard_tokens = _int("--shard_tokens", a.shard_tokens, 1, 2 ** 31 - 1)
    a.workers = _cpus() if a.workers is None else _int("--workers", a.workers, 1, 4096)
    return a


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))    # the CPUs this process may use
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _int(opt, s, lo, hi) -> int:
    try:
        v = int(s)
        if not lo <= v <= hi:
            raise ValueError
        return v
    except ValueError:
        raise PrepError(f"{opt} must be an integer in {lo}..{hi}, got {s!r}") from None


# --- inputs

def _find_inputs(specs) -> list[str]:
    """Absolute paths of the input files, in order (directories and globs sorted), each once."""
    files, seen = [], set()
    for s in specs:
        if os.path.isdir(s):
            found = sorted(os.path.join(r, f) for r, _, fs in os.walk(s) for f in fs if f.endswith(".txt"))
            if not found:
                raise PrepError(f"input directory {s} holds no *.txt files")
        elif os.path.isfile(s):
            found = [s]
        elif any(c in s for c in _GLOB_CHARS):
            found = sorted(p for p in glob.glob(s, recursive=True) if os.path.isfile(p))
            if not found:
                raise PrepError(f"no files match the input pattern {s!r}")
        else:
            raise PrepError(f"input not found: {s}")
        for f in found:
            a = os.path.abspath(f)
            if a not in seen:
                seen.add(a)
                files.append(a)
    for f in files:
        if os.path.getsize(f) == 0:
            raise PrepError(f"input {f} is empty")
    return files


def _check_input(path: str, bar) -> dict:
    """{path, size, mtime_ns, sha256} of a readable UTF-8 text file with no NUL bytes; else PrepError."""
    h = hashlib.sha256()
    dec = codecs.getincrementaldecoder("utf-8")()
    pos = 0
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            while True:
                block = f.read(READ_BYTES)
                nul = block.find(b"\0")
                if nul >= 0:
                    raise PrepError(f"input {path} looks binary (NUL byte at offset {pos + nul}), not UTF-8 text")
                held = dec.getstate()[0]     # bytes of an unfinished sequence from the previous block
                try:
                    dec.decode(block, final=not block)
                except UnicodeDecodeError as e:   # e.start counts from the held bytes
                    raise PrepError(f"input {path} is not valid UTF-8 (byte {pos - len(held) + e.start})") from None
                if not block:
                    break
                h.update(block)
                pos += len(block)
                bar.update(len(block))
    except OSError as e:
        raise PrepError(f"cannot read input {path}: {e.strerror}") from None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def _read_pieces(path: str, sha256: str | None = None):
    """Yield (text, bytes) pieces of a document: its text cut at safe boundaries (about CHUNK_CHARS
    characters each; see gptcuda/data/tokenizers.py) and the input bytes read for it. With sha256, a file whose
    content no longer has that hash is a PrepError."""
    h = hashlib.sha256()
    dec = codecs.getincrementaldecoder("utf-8")()
    buf, scanned, unreported = "", 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            h.update(block)
            unreported += len(block)
            try:
                buf += dec.decode(block, final=not block)
            except UnicodeDecodeError:
                raise PrepError(f"input {path} changed while being prepared (no longer valid UTF-8)") from None
            while len(buf) > CHUNK_CHARS:
                # the last safe cut in the first CHUNK_CHARS, else the first one after them; `scanned`: where
                # the buffer (which only grows at its end until it is cut) holds none before
                p = toks.last_safe_cut(buf, 0, CHUNK_CHARS) if not scanned else -1
                if p < 0:
                    p = toks.next_safe_cut(buf, max(CHUNK_CHARS, scanned))
                    if p < 0:  # read on (a document with no safe cut at all is encoded whole)
                        scanned = max(len(buf) - 1, CHUNK_CHARS)
                        break
                yield buf[:p], unreported
                buf, scanned, unreported = buf[p:], 0, 0
            if not block:
                break
    if sha256 is not None and h.hexdigest() != sha256:
        raise PrepError(f"input {path} changed while being prepared")
    if buf or unreported:
        yield buf, unreported


# --- encoding (in worker processes)

_TOK = None


def _init_worker(tok_dict):
    global _TOK
    if _TOK is None:    # a forked worker has the parent's already
        _TOK = toks.tokenizer_from_dict(tok_dict)


def _encode(text: str) -> np.ndarray:
    return _TOK.encode(text).astype(np.uint32)


def _pool(workers: int, tok):
    """A process pool whose workers hold tok (forked where the platform allows: no tokenizer rebuild)."""
    global _TOK
    _TOK = tok
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    # an HF tokenizer that trained (threads) before a fork warns in the child unless this is set
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_dict(),))
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _encode_inputs(inputs, tok, workers: int, tokens_path: str, bar) -> int:
    """Stream every document's ids (each after an end-of-text id, when the tokenizer has one) into
    tokens_path as uint32; return the token count. At most 2 x workers pieces are in flight."""
    global _TOK
    total = sum(i["size"] for i in inputs)
    workers = max(1, min(workers, total // CHUNK_CHARS + 1))
    pool = _pool(workers, tok) if workers > 1 else None
    if pool is None:
        _TOK = tok
    pending = collections.deque()
    count = 0
    try:
        with open(tokens_path, "wb") as out:
            def drain(limit):
                nonlocal count
                while len(pending) > limit:
                    res, nbytes = pending.popleft()
                    ids = res if isinstance(res, np.ndarray) else res.get()
                    ids.tofile(out)
                    count += len(ids)
                    bar.update(nbytes)
            for rec in inputs:
                if tok.eot_id is not None:
                    pending.append((np.array([tok.eot_id], dtype=np.uint32), 0))
                for text, nbytes in _read_pieces(rec["path"], rec["sha256"]):
                    pending.append((pool.apply_async(_encode, (text,)) if pool else _encode(text), nbytes))
                    drain(2 * workers)
            drain(0)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return count


def _texts(inputs, bar):
    for rec in inputs:
        for text, nbytes in _read_pieces(rec["path"], rec["sha256"]):
            yield text
            bar.update(nbytes)


def _bar(total, desc):
    """A progress bar of input bytes on stderr, when stderr is a terminal (so that, in a log, an error
    stays the one line it is)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                mininterval=0.5, dynamic_ncols=True, disable=None)


def _write_shards(tmp: str, tokens: np.ndarray, split: str, shard_tokens: int, vocab: int) -> list[dict]:
    shards = []
    for k, a in enumerate(range(0, len(tokens), shard_tokens)):
        part = tokens[a:a + shard_tokens]
        name = f"{split}_{k:06d}.bin"
        write_shard(os.path.join(tmp, name), part, vocab)
        shards.append({"file": name, "tokens": int(len(part)),
                       "bytes": HEADER_BYTES + int(len(part)) * VERSIONS[shard_version(vocab)].itemsize})
    return shards


# --- main

def _remove_stale(parent: str, base: str) -> None:
    """The temporary directories of killed runs for this DIR (under its lock: no live run owns one)."""
    for n in os.listdir(parent):
        if n.startswith(f".{base}.") and n.endswith(".prepare-tmp") and os.path.isdir(os.path.join(parent, n)):
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
            print(f"removed {os.path.join(parent, n)}, the temporary output of a prepare.py run that was killed")


def prepare(a) -> int:
    """DIR under its lock (a file beside it: DIR may not exist yet); directories this made above DIR are
    removed again when it fails."""
    out = os.path.abspath(a.out)
    files = _find_inputs(a.inputs)
    if os.path.exists(out) and not os.path.isdir(out):
        raise PrepError(f"--out {a.out} exists and is not a directory")
    parent = os.path.dirname(out)
    made = []                        # directories above out that this run creates (removed on failure)
    d = parent
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(parent, exist_ok=True)
    ok = False
    try:
        with DirLock(os.path.join(parent, f".{os.path.basename(out)}.prepare.lock"), f"--out {a.out}"):
            _remove_stale(parent, os.path.basename(out))
            rc = _prepare(a, out, files)
        ok = True
        return rc
    finally:
        if not ok:
            for d in made:
                try:
                    os.rmdir(d)
                except OSError:
                    break


def _prepare(a, out: str, files: list[str]) -> int:
    settings = {"tokenizer": a.tokenizer, "val_fraction": a.val_fraction, "shard_tokens": a.shard_tokens}
    meta, old_owned = None, set()
    if os.path.isdir(out) and os.listdir(out):
        meta = load_meta(out)
        marker = os.path.join(out, MARKER)
        if os.path.isfile(marker):          # an interrupted install: its files are ours
            try:
                with open(marker, encoding="utf-8") as f:
                    old_owned = {n for n in json.load(f)["files"] if os.path.basename(n) == n}
            except (ValueError, KeyError, TypeError, OSError) as e:
                raise PrepError(f"{marker} is unreadable ({' '.join(str(e).split())}): remove {out} or fix it") \
                    from None
            meta = None
        elif meta is None:
            raise PrepError(f"--out {a.out} exists, is not empty and holds no prepare.json: refusing to write "
                            f"into a directory prepare.py did not make")
        else:
            old_owned = owned(meta)
            if up_to_date(out, meta, files, settings):
                tr, va = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
                print(f"{a.out}: up to date ({tr:,} train + {va:,} val tokens, tokenizer {a.tokenizer})")
                return 0

    total = sum(os.path.getsize(f) for f in files)
    with _bar(total, "checking inputs") as bar:
        inputs = [_check_input(f, bar) for f in files]

    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".prepare-tmp", dir=os.path.dirname(out))
    ok = False
    try:
        kind, n = toks.parse_spec(a.tokenizer)
        if kind == "gpt2":
            tok = toks.make_tokenizer("gpt2")
        else:
            with _bar(total, "training " + a.tokenizer if kind == "bpe" else "reading characters") as bar:
                try:
                    tok = toks.make_tokenizer(a.tokenizer, _texts(inputs, bar))
                except PrepError:
                    raise
                except ValueError as e:
                    raise PrepError(f"--tokenizer {a.tokenizer}: {e}") from None
        tokens_path = os.path.join(tmp, "tokens.u32")
        with _bar(total, f"encoding ({tok.name})") as bar:
            count = _encode_inputs(inputs, tok, a.workers, tokens_path, bar)
        n_train = int((1 - a.val_fraction) * count)
        if n_train < 1 or count - n_train < 1:
            raise PrepError(f"the inputs make {count} tokens, too few to split with --val_fraction "
                            f"{a.val_fraction} (each split needs at least one token)")
        tokens = np.memmap(tokens_path, dtype=np.uint32, mode="r", shape=(count,))
        splits = {}
        for split, part in (("train", tokens[:n_train]), ("val", tokens[n_train:])):
            shards = _write_shards(tmp, part, split, a.shard_tokens, tok.vocab_size)
            splits[split] = {"tokens": int(len(part)), "max_id": max_id(part), "shards": shards}
        del tokens, part
        os.unlink(tokens_path)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        meta = {"format": FORMAT, "settings": settings,
                "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
                              "sha256": file_sha256(os.path.join(tmp, "tokenizer.json"))},
                "shard_format": {"magic": MAGIC, "version": shard_version(tok.vocab_size),
                                 "dtype": VERSIONS[shard_version(tok.vocab_size)].name},
                "documents": len(inputs), "bytes": total, "inputs": inputs, "splits": splits}
        with atomic_open(os.path.join(tmp, "prepare.json")) as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        permissions(tmp)
        install(tmp, out, old_owned)
        ok = True
    finally:
        if not ok:
            shutil.rmtree(tmp, ignore_errors=True)
    tr, va = splits["train"], splits["val"]
    print(f"{a.out}: {len(inputs)} document{'s' * (len(inputs) != 1)}, {tr['tokens']:,} train tokens in "
          f"{len(tr['shards'])} shard{'s' * (len(tr['shards']) != 1)}, {va['tokens']:,} val tokens in "
          f"{len(va['shards'])} shard{'s' * (len(va['shards']) != 1)}; tokenizer {tok.name} "
          f"({tok.vocab_size:,} tokens)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0
    try:
        return prepare(_parse(argv))
    except (PrepError, DataError, RunError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
