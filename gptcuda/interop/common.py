"""What every interop format shares: the error (`InteropError`), GPT-2's constants, the shape formatting of
the messages, the tokenizer's vocabulary and `check_expressible` (what a format can say)."""
from __future__ import annotations

from gptcuda.config import Config

LN_EPS = 1e-5            # kernels/layernorm.cu LN_EPS, reference/ops.py layernorm_forward
GPT2_VOCAB = 50257
GPT2_EOT = 50256


class InteropError(ValueError):
    """A model or file that cannot be converted; str(err) is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def _fmt(shape) -> str:
    shape = tuple(int(s) for s in shape)
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _round_up(n: int, m: int) -> int:
    m = max(int(m), 1)
    return (int(n) + m - 1) // m * m


def _tokenizer_vocab(d: dict) -> int:
    kind = d.get("type", "char" if "chars" in d else None)
    if kind == "gpt2":
        return GPT2_VOCAB
    if kind == "char" and isinstance(d.get("chars"), list):
        return len(d["chars"])
    if kind == "bpe" and isinstance(d.get("vocab_size"), int):
        return d["vocab_size"]
    raise InteropError(f"unknown tokenizer description {str(d)[:80]!r}")


def check_expressible(cfg: Config, tokenizer: dict, target: str) -> None:
    """Raise InteropError (one line) when the run cannot be written as `target` ("hf" | "llmc")."""
    what = {"hf": "a Hugging Face GPT-2", "llmc": "an llm.c model file"}[target]
    if not cfg.bias:
        raise InteropError(f"bias is false but {what} has biases in every linear and layernorm "
                           f"(GPT-2's architecture); train with bias=true to export")
    kind = tokenizer.get("type", "char" if "chars" in tokenizer else None)
    if target == "hf" and kind == "char":
        raise InteropError("tokenizer is char but a Hugging Face GPT-2 directory needs a GPT-2 style BPE "
                           "tokenizer (gpt2 or bpe:N); export --to llmc instead, or train with tokenizer=gpt2")
    int32 = 2 ** 31 - 1
    if target == "llmc":
        for k in ("block_size", "n_embd", "n_layer", "n_head", "vocab_size"):
            if getattr(cfg, k) > int32:
                raise InteropError(f"{k} {getattr(cfg, k)} does not fit llm.c's int32 header")
