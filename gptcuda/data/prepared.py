"""prepare.py's output directory: its prepare.json (`load_meta`, the files it `owned`), whether it is
`up_to_date` with the inputs, and a new output moved into it (`install`: complete or not at all, MARKER
while it happens). The data layer reads what these write (dataset.py, checks.py)."""
from __future__ import annotations

import json
import os

from gptcuda.files import atomic_open, current_umask
from gptcuda.data.checks import file_sha256
from gptcuda.data.dataset import PREPARE_MARKER as MARKER   # lists the files of an install into DIR

FORMAT = 1                       # prepare.json's format


class PrepError(Exception):
    """A bad input, option or output directory; str(err) is one line."""


def load_meta(out: str):
    """DIR's prepare.json (None when there is none); a corrupt one is a PrepError."""
    p = os.path.join(out, "prepare.json")
    if not os.path.exists(p):
        return None
    try:
        with open(p, encoding="utf-8") as f:
            meta = json.load(f)
        owned(meta)
        return meta
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise PrepError(f"{p} is unreadable ({' '.join(str(e).split())}): remove {out} or fix it") from None


def owned(meta) -> set[str]:
    """The names of the files a prepare.json says prepare.py wrote."""
    names = {"prepare.json", "tokenizer.json"}
    for split in ("train", "val"):
        for s in meta["splits"][split]["shards"]:
            name = s["file"]
            if not isinstance(name, str) or os.path.basename(name) != name:
                raise ValueError(f"bad shard name {name!r}")
            names.add(name)
    return names


def up_to_date(out: str, meta, files, settings) -> bool:
    """Whether DIR already holds the output of these inputs and settings (each input's size and sha256 equal:
    a same-size edit that kept the mtime is seen too)."""
    try:
        if meta.get("format") != FORMAT or meta.get("settings") != settings:
            return False
        old = meta["inputs"]
        if [r["path"] for r in old] != files:
            return False
        for r in old:
            st = os.stat(r["path"])
            if st.st_size != r["size"]:
                return False
            if file_sha256(r["path"]) != r["sha256"]:
                return False
        for split in ("train", "val"):
            for s in meta["splits"][split]["shards"]:
                p = os.path.join(out, s["file"])
                if not os.path.isfile(p) or os.path.getsize(p) != s["bytes"]:
                    return False
        return os.path.isfile(os.path.join(out, "tokenizer.json"))
    except (KeyError, TypeError, OSError):
        return False


def install(tmp: str, out: str, old_owned: set[str]) -> None:
    """Move tmp's files into out; remove old_owned files that the new output does not have.

    A missing or empty out is replaced by tmp in one rename. Otherwise MARKER (listing old and new files) makes
    an interrupted install recognisable as ours, prepare.json goes first and comes back last."""
    if os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    new = sorted(os.listdir(tmp))
    with atomic_open(os.path.join(out, MARKER)) as f:
        json.dump({"files": sorted(old_owned | set(new))}, f)
    for name in ["prepare.json"] + sorted(old_owned - set(new) - {"prepare.json"}):
        try:
            os.unlink(os.path.join(out, name))
        except FileNotFoundError:
            pass
    for name in [n for n in new if n != "prepare.json"] + ["prepare.json"]:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.unlink(os.path.join(out, MARKER))
    os.rmdir(tmp)


def permissions(tmp: str) -> None:
    """Give the temp directory and its files (made private by mkdtemp/mkstemp) the usual umask modes."""
    umask = current_umask()
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
