"""Generation (sample.py, bench/generate.py): a model, a batch of prompts, tokens drawn on the device.

    model = load_model("out/run")                  # or "hf:DIR", "llmc:FILE", a .ckpt; see load_model
    gen = Generator(model, n_seq=4, max_new=200)   # plans the KV cache, records and captures one step
    for emit, done in gen.stream(prompts, temp=0.8, top_k=40, top_p=0.95, seed=7, stop=[50256]):
        ...                                        # every step: each sequence's new token (-1: none)
    tokens = gen.generate(prompts, ...)            # the same, collected: one int32 array per sequence

One step (model.record_decode_step) embeds each sequence's token at the shared position, runs the
layers with the KV cache, draws the next token on the device (kernels/decode.cu decode_sample) and
advances the position; on the GPU it is one CUDA graph replayed per token. Prompts of different
lengths share the batch: a sequence reads its prompt until its last token, then draws. The host
never waits for the GPU while it runs: after each replay a copy of the step's draws into page-locked
memory is queued with an event, and the host reads a step's draws only DEPTH steps later. Past
block_size positions a window restarts from its last half (positions are absolute, so a cache cannot
slide in place).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterator

import numpy as np

from gptcuda.model.checkpoint import CheckpointError
from gptcuda.errors import UsageError
from gptcuda.config import Config
from gptcuda.runtime import compiler
from gptcuda.training.engine import backend_class, workspaces_for
from gptcuda.model.gpt import GPT
from gptcuda.model.memory import STOP_MAX, check_fits, pack_gen_opts, plan_decode
from gptcuda.model.params import flatten, param_table
from gptcuda.data.tokenizers import tokenizer_from_dict
from gptcuda.interop import InteropError, _parse_spec, latest_run, load_weights, run_of


MIN_TEMP = 1e-3     # below this (but above 0) logits / temp can overflow; 0 is greedy
SEED_LIMIT = 2 ** 32
DEPTH = 8           # steps queued ahead of the one whose draws the host reads


@dataclasses.dataclass
class Model:
    """Weights and what they need: cfg (model fields set), tokenizer (None: unknown), named params."""
    cfg: Config
    tokenizer: object | None
    named: dict
    n_vocab: int          # tokens that exist (the rest of wte's rows are padding)
    source: str           # what was read, for the log
    step: int | None = None


GEN_PRECISIONS = ("fp32", "tf32", "bf16")     # the decode step's (Generator)


def load_model(source: str, ckpt: str | None = None) -> Model:
    """source: a run directory (its best.ckpt, else last.ckpt, or ckpt), a run's .ckpt file,
    "hf:DIR" (a Hugging Face GPT-2 directory) or "llmc:FILE" (an llm.c model file). Errors are
    CheckpointError (one line, naming the file, tensor or setting)."""
    try:
        kind, where = _parse_spec(source)
        if kind in ("run", "ckpt"):
            run = run_of(kind, where, ckpt)
            tok = tokenizer_from_dict(run.tokenizer)
            return Model(run.cfg, tok, run.named, run.n_vocab, run.path, run.step)
        named, over, tok_dict = load_weights(source, Config())
        tok = tokenizer_from_dict(tok_dict) if tok_dict is not None else None
    except InteropError as e:
        raise CheckpointError(str(e)) from None
    except ValueError as e:                   # a bad tokenizer description
        raise CheckpointError(f"{source}: {e}") from None
    cfg = dataclasses.replace(Config(), **over)
    n_vocab = tok.vocab_size if tok is not None else named["wte"].shape[0]
    return Model(cfg, tok, named, n_vocab, where)


def steps_needed(lengths, max_new: int, T: int) -> int:
    """How many decode steps draw max_new tokens for every sequence (no stop sequence): the
    bookkeeping of decode_sample / decode_advance, on the host."""
    fill = np.minimum(np.asarray(lengths, np.int64), T)
    n_out = np.zeros_like(fill)
    pos, steps, K = 0, 0, max(T // 2, 1)
    while (n_out < max_new).any():
        live = n_out < max_new
        draw = live & (pos + 1 >= fill)
        n_out[draw] += 1
        fill[draw] = pos + 2
        if pos + 1 == T:
            fill[live] = K
        pos = 0 if pos + 1 == T else pos + 1
        steps += 1
    return steps


class Generator:
    """n_seq sequences of up to max_new new tokens each from one model. precision: "fp32" (the
    default: a few small products a token, where TF32 buys little), "tf32", or "bf16" (sm_90): the
    products read a bf16 working copy of the weights (half the bytes a step reads), made once from
    the loaded fp32 weights, and the activations they multiply and the KV cache are bf16; sums, the
    residual stream, qkv, the softmax, the layernorm statistics and the logits stay fp32
    (memory.plan_decode dtype bf16). The reference backend runs every precision in float64."""

    def __init__(self, model: Model, n_seq: int, max_new: int, backend: str = "cuda", precision: str = "fp32"):
        V = model.named["wte"].shape[0]
        if precision not in GEN_PRECISIONS:
            raise UsageError(f"precision must be {' or '.join(GEN_PRECISIONS)}, got {precision!r}")
        # the op families' scratch is sized for batch_size x block_size rows: batch_size covers the
        # n_seq rows a step multiplies
        over = dict(batch_size=max(1, -(-n_seq // model.cfg.block_size)), max_iters=0, dropout=0.0, backend=backend,
                    graph=False, precision=precision, vocab_size=V)
        if precision == "bf16":
            # the execution plan's rule for bf16 (the decode step has an attention of its own); the bf16
            # products read rows of 16 bytes (the working copy's matrices, the activations they multiply)
            over["attention"] = "fused"
            if backend == "cuda" and model.cfg.n_embd % 8:
                raise UsageError(f"precision bf16 needs n_embd a multiple of 8 (16-byte bf16 rows); this model's "
                                 f"is {model.cfg.n_embd}: use --precision fp32 or tf32")
        cfg = dataclasses.replace(model.cfg, **over)
        try:
            self.be = be = backend_class(cfg)(cfg)
        except ValueError as e:            # the execution plan refuses: bf16 off sm_90
            raise UsageError(f"precision {precision}: {e}") from None
        table = param_table(cfg, V)
        # the parameters, the KV cache, the decode buffers and the scratch: no gradients, Adam state
        # or training activations (bf16: the products' operands and the cache in bf16, and the
        # parameters' bf16 working copy)
        dtype = be.exec.act_dtype
        self.plan = plan_decode(cfg, table, V, n_seq, max_new, workspaces_for(cfg, be), dtype)
        check_fits(self.plan, be.free_bytes(), cfg, hints=[f"fewer sequences at once (now {n_seq})"])
        self.bufs = bufs = be.allocate(self.plan, table)
        be.upload(bufs.flat_params, flatten(table, model.named))
        self.model, self.cfg, self.n_seq, self.max_new = model, cfg, int(n_seq), int(max_new)
        self.d = bufs.acts
        if "params_bf16" in self.d:
            # the working copy of the weights as loaded, made once: nothing changes the parameters
            # while the generator lives, so the replayed step does not remake it
            be.begin("work_copy")
            be.work_copy(self.d["params_bf16"], bufs.flat_params)
            be.run(be.end())
        be.begin("decode")
        GPT(cfg, be, bufs, table, n_vocab=model.n_vocab).record_decode_step(self.d, model.n_vocab)
        self.program = be.end()
        self.cuda = backend == "cuda"
        if self.cuda:
            rt = be.rt
            self.graph = be.capture(self.program)
            self.ring = rt.pinned((DEPTH, 2, n_seq), np.int32)
            self.events = [rt.new_event() for _ in range(DEPTH)]

    def reset(self, prompts, temp: float, top_k: int | None, top_p: float, seed: int, stop=()) -> list[int]:
        """Load the prompts (one int array per sequence, 1..block_size tokens: longer ones keep their
        last block_size) and the options; the lengths used."""
        S, T = self.n_seq, self.cfg.block_size
        if len(prompts) != S:
            raise ValueError(f"{len(prompts)} prompts for {S} sequences")
        stop = [int(t) for t in stop]
        if len(stop) > STOP_MAX:
            raise ValueError(f"a stop sequence has at most {STOP_MAX} tokens, got {len(stop)}")
        ctx = np.zeros((S, T + 1), np.int32)
        lengths = []
        for s, p in enumerate(prompts):
            p = np.asarray(p, np.int64)[-T:]
            if p.size == 0:
                raise ValueError(f"prompt {s} is empty")
            if p.min() < 0 or p.max() >= self.model.n_vocab:
                raise ValueError(f"prompt {s} holds a token outside 0..{self.model.n_vocab - 1}")
            ctx[s, :p.size] = p
            lengths.append(int(p.size))
        d, be = self.d, self.be
        be.upload(d["ctx"], ctx)
        be.upload(d["fill"], np.array(lengths, np.int32))
        for name in ("out", "n_out", "done", "emit", "pos"):
            be.upload(d[name], np.zeros(d[name].shape, np.int32))
        be.upload(d["opts"], pack_gen_opts(seed, top_k or 0, temp, top_p, self.max_new, len(stop)))
        be.upload(d["stop"], np.array(stop + [0] * (STOP_MAX - len(stop)), np.int32))
        return lengths

    def stream(self, prompts, temp: float = 1.0, top_k: int | None = None, top_p: float = 1.0, seed: int = 0,
               stop=()) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(emit [S], done [S]) of every step until every sequence is done: emit the token drawn at
        that step (-1: none)."""
        lengths = self.reset(prompts, temp, top_k, top_p, seed, stop)
        if self.max_new == 0:
            return
        n = steps_needed(lengths, self.max_new, self.cfg.block_size)
        with compiler.forbid_compiles():
            if not self.cuda:
                for _ in range(n):
                    self.be.run(self.program)
                    emit = np.asarray(self.be.download(self.d["emit"]), np.int32)
                    yield emit[0], emit[1]
                    if emit[1].all():
                        return
                return
            rt = self.be.rt
            dev, emit_view, nbytes = rt.dev, self.d["emit"], 2 * self.n_seq * 4
            launched = read = 0
            finished = False
            while read < launched or (launched < n and not finished):
                while launched < n and launched - read < DEPTH and not finished:
                    slot = launched % DEPTH
                    self.graph.launch()
                    dev.dtoh_async(self.ring[slot].ctypes.data, emit_view.ptr, nbytes, rt.stream)
                    dev.record(self.events[slot], rt.stream)
                    launched += 1
                slot = read % DEPTH
                dev.event_sync(self.events[slot])
                emit = self.ring[slot].copy()
                read += 1
                finished = finished or bool(emit[1].all())
                yield emit[0], emit[1]
            # steps launched after the last sequence finished drew nothing; let them end
            rt.synchronize()

    def generate(self, prompts, **kw) -> list[np.ndarray]:
        """The tokens each sequence drew (stream() collected)."""
        for _ in self.stream(prompts, **kw):
            pass
        return self.drawn()

    def drawn(self) -> list[np.ndarray]:
        out = np.asarray(self.be.download(self.d["out"]), np.int32)
        n = np.asarray(self.be.download(self.d["n_out"]), np.int64)
        return [out[s, :n[s]].copy() for s in range(self.n_seq)]


# ---- sample.py ------------------------------------------------------------------------------

def _num(opts, key, cast, default, ok, allowed):
    """opts[key] as cast (else default), checked by ok(value); a UsageError naming the key and `allowed`."""
    if key not in opts:
        return default
    raw = opts[key]
    try:
        v = cast(raw)
    except (TypeError, ValueError, OverflowError):
        v = None
    if v is None or not ok(v):
        raise UsageError(f"--{key} must be {allowed}, got {raw!r}")
    return v


def parse_options(opts) -> dict:
    """The checked sampling options: num_samples, max_new_tokens, temp, top_k (None: all), top_p, seed,
    backend, precision."""
    out = dict(
        num_samples=_num(opts, "num_samples", int, 1, lambda v: v >= 1, "an integer >= 1"),
        max_new_tokens=_num(opts, "max_new_tokens", int, 500, lambda v: v >= 0, "an integer >= 0"),
        temp=_num(opts, "temp", float, 0.8, lambda v: v == 0 or (math.isfinite(v) and v >= MIN_TEMP),
                  f"0 (greedy) or a finite number >= {MIN_TEMP}"),
        top_k=_num(opts, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0 (0: every token)") or None,
        top_p=_num(opts, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1: every token)"),
        seed=_num(opts, "seed", int, 1337, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**32)"),
        backend=opts.get("backend"),
        precision=opts.get("precision", "fp32"),
    )
    if out["backend"] not in (None, "cuda", "reference"):
        raise UsageError(f"--backend must be cuda or reference, got {out['backend']!r}")
    if out["precision"] not in GEN_PRECISIONS:
        raise UsageError(f"--precision must be {', '.join(GEN_PRECISIONS[:-1])} or {GEN_PRECISIONS[-1]}, got "
                         f"{out['precision']!r}")
    return out


def _stop_ids(tok, text) -> list[int]:
    if text is None:
        return []
    if text == "<|endoftext|>" and getattr(tok, "eot_id", None) is not None:
        return [int(tok.eot_id)]
    try:
        ids = [int(i) for i in tok.encode(text)]
    except ValueError as e:
        raise UsageError(f"--stop: {e}") from None
    if not 1 <= len(ids) <= STOP_MAX:
        raise UsageError(f"--stop {text!r} is {len(ids)} tokens; a stop sequence is 1 to {STOP_MAX} tokens")
    return ids


def _prompts(tok, opts) -> list[str]:
    if "prompt" in opts and "prompt_file" in opts:
        raise UsageError("--prompt and --prompt_file exclude each other")
    if "prompt_file" in opts:
        path = opts["prompt_file"]
        try:
            with open(path, encoding="utf-8") as f:
                lines = [ln.rstrip("\n").replace("\\n", "\n") for ln in f]
        except UnicodeDecodeError:
            raise UsageError(f"--prompt_file {path}: not UTF-8 text") from None
        if not lines:
            raise UsageError(f"--prompt_file {path}: no prompt (one a line)")
        blank = [i + 1 for i, ln in enumerate(lines) if not ln]
        if blank:                      # never dropped silently: the samples would not match the lines
            raise UsageError(f"--prompt_file {path}: line {blank[0]} is empty (one prompt a line; write \\n "
                             f"inside a line for a newline)")
        return lines
    return [opts.get("prompt", "\n")]


class _Printer:
    """Prints the samples in order as their tokens arrive: the first unfinished one streams, each
    later one follows when those before it end. Byte-level BPE text is held back while it ends
    in a partial character."""

    def __init__(self, tok, heads: list[str], out=None):
        self.tok, self.heads, self.out = tok, heads, out or sys.stdout
        self.tokens = [[] for _ in heads]
        self.done = [False] * len(heads)
        self.cur, self.started, self.shown = 0, False, 0

    def _flush(self, final: bool):
        while self.cur < len(self.heads):
            s = self.cur
            if not self.started:
                self.out.write(("\n" + "-" * 40 + "\n" if s else "") + self.heads[s])
                self.started, self.shown = True, 0
            finished = self.done[s] or final
            text = self.tok.decode(np.array(self.tokens[s], np.int32))
            if not finished:
                text = text.rstrip("\ufffd")
            if len(text) > self.shown:
                self.out.write(text[self.shown:])
                self.shown = len(text)
            self.out.flush()
            if not finished:
                return
            self.cur, self.started = s + 1, False
            if self.cur == len(self.heads):
                self.out.write("\n")
                self.out.flush()

    def step(self, emit, done):
        for s, t in enumerate(emit):
            if t >= 0:
                self.tokens[s].append(int(t))
            self.done[s] = bool(done[s])
        self._flush(False)

    def finish(self):
        self._flush(True)


def sample_main(opts) -> int:
    o = parse_options(opts)                    # every argument checked before anything is loaded
    source = opts.get("init_from")
    if source is not None and ("out_dir" in opts or "ckpt" in opts):
        raise UsageError("--init_from names the weights; it excludes --out_dir and --ckpt")
    if source is None:
        source = opts.get("out_dir")
        if source is not None:
            if not os.path.isdir(source):
                raise UsageError(f"--out_dir {source}: " + ("not a directory" if os.path.exists(source)
                                                             else "no such directory"))
        else:
            source = latest_run()
            if source is None:
                raise UsageError("no trained run found under out/; train one (python train.py CONFIG), "
                                 "or pass --out_dir or --init_from")
    ckpt = opts.get("ckpt")
    if ckpt is not None and not os.path.isfile(ckpt):
        raise UsageError(f"--ckpt {ckpt}: no such file")
    model = load_model(source, ckpt)
    tok = model.tokenizer
    if tok is None:
        raise UsageError(f"{model.source}: the weights' vocabulary ({model.n_vocab}) is not GPT-2's, and no "
                         f"tokenizer comes with them; sample from a run directory instead")
    texts = _prompts(tok, opts)
    prompts = []
    for text in texts:
        try:
            ids = tok.encode(text) if text else np.zeros(0, np.int32)
        except ValueError as e:
            raise UsageError(f"--prompt: {e}") from None
        prompts.append(ids if len(ids) else np.zeros(1, np.int32))
    stop = _stop_ids(tok, opts.get("stop"))
    S = o["num_samples"] * len(prompts)
    backend = o["backend"] or model.cfg.backend
    gen = Generator(model, S, o["max_new_tokens"], backend, o["precision"])
    temp, top_k, top_p, seed = o["temp"], o["top_k"], o["top_p"], o["seed"]
    step = f" (step {model.step})" if model.step is not None else ""
    print(f"# {model.source}{step}, temperature {temp}{' (greedy)' if temp == 0 else ''}, top_k {top_k}, "
          f"top_p {top_p}, seed {seed}", flush=True)
    rows = [p for p in prompts for _ in range(o["num_samples"])]
    heads = [t for t in texts for _ in range(o["num_samples"])]
    printer = _Printer(tok, heads)
    for emit, done in gen.stream(rows, temp=temp, top_k=top_k, top_p=top_p, seed=seed, stop=stop):
        printer.step(emit, done)
    printer.finish()
    return 0
