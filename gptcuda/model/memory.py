"""The memory plan: every byte the run will use, decided from the config before allocating.

Two device allocations:
  * the flat buffer  params | grads | Adam m | Adam v  (four regions of the parameter table's size,
                     fp32 but the gradients where grad_dtype is bf16; generation's plan holds the
                     parameters only)
  * the arena        activations (saved for the backward), backward scratch, op workspaces,
                     the step's batch of token ids, the step state and the loss history

Backward scratch whose values never meet the logits' (SHARED_WITH_LOGITS) lies inside the logits
buffer where it fits: the logits are written by the head's product, turned into their gradient in
place and last read by the head's two backward products, and that scratch is used before the head's
product (the forward's rebuilt GELU outputs in dfc, the branch before the last layernorm) and after
its backward products, never between (tests/test_memory_sharing.py checks both backends' programs).

The dataset itself never reaches the GPU: each step's windows are gathered on the host and
copied into `idx` / `targets` (gptcuda/data/batches.py).

`plan_memory` is pure arithmetic (no GPU), so `train.py CONFIG --plan` prints it anywhere,
and a plan larger than the device's free memory is refused before anything is allocated.
Every entry starts on a 256-byte boundary (16-byte vector access needs only 16).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gptcuda.config import recompute_layers
from gptcuda.model import state
from gptcuda.model.params import ParamTable

ARENA_ALIGN = 256
REGIONS = ("params", "grads", "adam_m", "adam_v")     # the flat buffer of training, in order
ITEMSIZE = {"f32": 4, "i32": 4, "u8": 1, "bf16": 2}
KINDS = ("activation", "backward", "workspace", "data", "state")
# the backward scratch placed inside the logits buffer where it fits (first come, first placed); () plans
# each on its own bytes (tests compare the two)
SHARED_WITH_LOGITS = ("dfc", "dqkv", "dres", "branch")


@dataclass
class Entry:
    name: str
    shape: tuple
    dtype: str
    kind: str
    comment: str = ""
    offset: int = 0     # bytes from the arena's start
    within: str = ""    # the entry whose bytes it shares (its own none), or ""

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass
class MemoryPlan:
    table: ParamTable
    entries: list = field(default_factory=list)
    arena_bytes: int = 0
    regions: tuple = REGIONS        # the flat buffer's regions, each the parameter table's size
    grads: str = "f32"              # the gradients' region's dtype (the others are fp32)

    def dtype_of(self, region: str) -> str:
        return self.grads if region == "grads" else "f32"

    def bytes_of(self, region: str) -> int:
        """A region's bytes: the parameter table's elements of its dtype, to a whole 16 (each region starts
        on a 16-byte boundary: float4 access; fp32 regions are whole already, the table's size being)."""
        n = self.table.total * ITEMSIZE[self.dtype_of(region)]
        return (n + 15) // 16 * 16

    def offset_of(self, region: str) -> int:
        """A region's bytes from the flat buffer's start."""
        return sum(self.bytes_of(r) for r in self.regions[:self.regions.index(region)])

    @property
    def region_bytes(self) -> int:
        """The parameters' region (fp32)."""
        return self.bytes_of("params")

    @property
    def flat_bytes(self) -> int:
        return sum(self.bytes_of(r) for r in self.regions)

    @property
    def total_bytes(self) -> int:
        return self.flat_bytes + self.arena_bytes

    def add(self, name, shape, dtype="f32", kind="activation", comment="", within=None):
        """within: an entry of the same dtype whose bytes this one may share (the caller's word that
        their values are never live at once): placed after what already shares it where it fits there,
        else on bytes of its own."""
        if kind not in KINDS:
            raise ValueError(kind)
        if any(e.name == name for e in self.entries):
            raise ValueError(f"memory plan: {name} planned twice")
        e = Entry(name, tuple(int(s) for s in shape), dtype, kind, comment, self.arena_bytes)
        host = self[within] if within else None
        if host is not None and host.dtype != dtype:
            raise ValueError(f"memory plan: {name} ({dtype}) inside {within} ({host.dtype})")
        used = sum(_aligned(x.nbytes) for x in self.entries if within and x.within == within)
        if host is not None and used + _aligned(e.nbytes) <= _aligned(host.nbytes):
            e.offset, e.within = host.offset + used, within
        else:
            self.arena_bytes += _aligned(e.nbytes)
        self.entries.append(e)
        return e

    def add_workspaces(self, workspaces: dict):
        """The op families' scratch {name: (shape, dtype)}, shared by all layers."""
        for name, (shape, dtype) in sorted(workspaces.items()):
            self.add(name, shape, dtype, "workspace", "op scratch, shared by all layers")

    def by_kind(self) -> dict:
        """Each kind's bytes of the arena (an entry inside another counts none)."""
        out = {k: 0 for k in KINDS}
        for e in self.entries:
            out[e.kind] += 0 if e.within else _aligned(e.nbytes)
        return out

    def __getitem__(self, name) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def format(self, detail: bool = False) -> str:
        def gib(n):
            return f"{n / 2**30:9.3f} GiB" if n >= 2**30 else f"{n / 2**20:9.2f} MiB"
        rb = self.region_bytes
        lines = ["memory plan",
                 f"  parameters       {gib(rb)}  ({self.table.n_params:,} parameters, {self.table.total:,} slots)"]
        lines += [f"  {name:<17}{gib(self.bytes_of(r))}" + ("  (bf16)" if self.dtype_of(r) == "bf16" else "")
                  for r, name in (("grads", "gradients"), ("adam_m", "adam m"), ("adam_v", "adam v"))
                  if r in self.regions]
        kinds = self.by_kind()
        label = {"activation": "activations", "backward": "backward scratch", "workspace": "op workspace",
                 "data": "batch tokens", "state": "step state"}
        for k in KINDS:
            lines.append(f"  {label[k]:<17}{gib(kinds[k])}")
        if detail:
            for e in self.entries:
                inside = f" (inside {e.within}: no bytes of its own)" if e.within else ""
                lines.append(f"    {e.name:<28} {str(list(e.shape)):<22} {e.dtype} {gib(e.nbytes)}  {e.comment}{inside}")
        lines.append(f"  total            {gib(self.total_bytes)}")
        return "\n".join(lines)


def _aligned(n: int) -> int:
    return (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN


class PlanTooLarge(RuntimeError):
    pass


def check_fits(plan: MemoryPlan, free_bytes: int, cfg, hints: list | None = None) -> None:
    """Refuse a plan that does not fit, with the plan and what to change (hints: the changes to
    name; default: those of a training run)."""
    if plan.total_bytes <= free_bytes:
        return
    if hints is None:
        hints = [f"--batch_size={max(1, cfg.batch_size // 2)}", f"--block_size={max(1, cfg.block_size // 2)}"]
        stored = next((e for e in plan.entries if e.name == "fc_act"), None)
        if stored is not None:     # the fewest more layers rebuilding their GELU output that make it fit
            per_layer = stored.nbytes // stored.shape[0]
            more = -(-(plan.total_bytes - free_bytes) // per_layer)
            if more <= stored.shape[0]:
                n = recompute_layers(cfg) + more
                hints.insert(0, f"--recompute={n} (the GELU output rebuilt in {n} of {cfg.n_layer} layers: "
                                f"{(plan.total_bytes - more * per_layer) / 2**30:.2f} GiB)")
        if cfg.attention == "unfused":
            hints.insert(0, "--attention=fused (no [B,H,T,T] probabilities saved)")
    raise PlanTooLarge(
        f"{plan.format()}\nthe plan needs {plan.total_bytes / 2**30:.2f} GiB but the GPU has "
        f"{free_bytes / 2**30:.2f} GiB free; try " + ", or ".join(hints))


def plan_memory(cfg, table: ParamTable, vocab_size: int, accum: int,
                attention_saved: dict, workspaces: dict, history: int, act: str = "f32",
                grads: str = "f32") -> MemoryPlan:
    """The whole arena for training at cfg.batch_size x cfg.block_size, `accum` micro-batches a step.

    attention_saved: per-layer saved tensors of the attention implementation {name: (shape, dtype)}
    workspaces: scratch shared by all layers {name: (shape, dtype)} from the op families
    act: the dtype of the activations and their gradients (ExecutionPlan.act_dtype); bf16 also plans
    the parameters' bf16 working copy the products read. Statistics and losses stay fp32.
    grads: the gradients' dtype (ExecutionPlan.grad_dtype; bf16 halves their region); the micro-batches'
    sum (grad_acc) stays fp32.
    The activations serve one micro-batch at a time; only the token ids and the per-token losses
    are kept for every micro-batch of the step.
    """
    B, T, C, L, V, A = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer, vocab_size, accum
    p = MemoryPlan(table, grads=grads)
    p.add("idx", (A, B, T), "i32", "data", "input tokens of each micro-batch [A, B, T]")
    p.add("targets", (A, B, T), "i32", "data", "target tokens of each micro-batch [A, B, T]")
    p.add("res", (L + 1, B, T, C), act, "activation", "residual stream into each block and out of the last")
    p.add("mid", (L, B, T, C), act, "activation", "residual stream after each attention half")
    p.add("ln1", (L, B, T, C), act, "activation", "layernorm 1 outputs")
    p.add("ln1_mean", (L, B, T), "f32", "activation")
    p.add("ln1_rstd", (L, B, T), "f32", "activation")
    p.add("qkv", (L, B, T, 3 * C), act, "activation", "q|k|v projections [B, T, 3C]")
    p.add("atty", (L, B, T, C), act, "activation", "attention outputs, heads interleaved [B, T, C]")
    for name, (shape, dtype) in attention_saved.items():
        p.add(f"saved_{name}", (L, *shape), dtype, "activation", f"attention saves {name} per layer")
    p.add("ln2", (L, B, T, C), act, "activation", "layernorm 2 outputs")
    p.add("ln2_mean", (L, B, T), "f32", "activation")
    p.add("ln2_rstd", (L, B, T), "f32", "activation")
    p.add("fc_pre", (L, B, T, 4 * C), act, "activation",
          "mlp pre-activation (for GELU backward; with recompute rebuilt into the GELU output there)")
    r = recompute_layers(cfg)           # the first r layers rebuild their GELU output, the rest store it
    if r < L:
        p.add("fc_act", (L - r, B, T, 4 * C), act, "activation",
              "mlp GELU output" + (f" of layers {r}-{L - 1} (recompute rebuilds the first {r})" if r else ""))
    p.add("lnf", (B, T, C), act, "activation", "final layernorm output")
    p.add("lnf_mean", (B, T), "f32", "activation")
    p.add("lnf_rstd", (B, T), "f32", "activation")
    p.add("logits", (B, T, V), act, "activation", "logits, turned into their gradient in place")
    p.add("losses", (A, B, T), "f32", "activation", "per-token losses of each micro-batch")
    # the backward scratch: inside the logits where it fits (SHARED_WITH_LOGITS), in that order
    scratch = {"dfc": ((B, T, 4 * C), "gradient of the mlp activation; with recompute also the forward's GELU "
                                      "output of the layer at hand"),
               "dqkv": ((B, T, 3 * C), "gradient of qkv"),
               "dres": ((B, T, C), "gradient of the residual stream"),
               "dln": ((B, T, C), "gradient of a layernorm output, or of the attention output")}
    if cfg.dropout > 0:        # (without dropout the residual adds are fused into the products' epilogues)
        scratch["branch"] = ((B, T, C), "a branch output before dropout + residual (forward); its gradient (backward)")
    shared = [n for n in SHARED_WITH_LOGITS if n in scratch]
    for name in shared + [n for n in scratch if n not in shared]:
        shape, comment = scratch[name]
        p.add(name, shape, act, "backward", comment, within="logits" if name in shared else None)
    if act == "bf16":
        p.add("params_bf16", (table.total,), "bf16", "activation",
              "the parameters' bf16 working copy, the products' (written at each program's start)")
    p.add_workspaces(workspaces)
    if A > 1:
        p.add("grad_acc", (table.total,), "f32", "backward",
              "gradient accumulation: the sum of the step's earlier micro-batches")
    p.add("state", (state.WORDS,), "i32", "state", "StepState (gptcuda/model/state.py)")
    p.add("history", (max(history, 1),), "f32", "state", "training loss of every step")
    return p


def plan_decode(cfg, table: ParamTable, vocab_size: int, n_seq: int, max_new: int = 1,
                workspaces: dict | None = None, dtype: str = "f32") -> MemoryPlan:
    """Buffers of generation with a KV cache: S sequences, one position a step, up to block_size,
    and the device-side state of drawing up to max_new tokens each (kernels/decode.cu). The flat
    buffer is the parameters alone: no gradients, no Adam state, no training activations.
    workspaces (the op families' scratch {name: (shape, dtype)}): planned too, with the step state,
    for a plan that is allocated on its own (Generator); None: the decode buffers only.
    dtype bf16: what the products read (the layernorm outputs h, the attention output y, the GELU
    output and its pre-activation) and the KV cache in bf16, with the parameters' bf16 working copy
    (params_bf16) the products and the head read; the residual stream x, qkv, the logits, the
    statistics and the attention's partial results stay fp32."""
    S, T, C, L, H = n_seq, cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"plan_decode: dtype {dtype!r} (f32 or bf16)")
    p = MemoryPlan(table, regions=("params",))
    p.add("ctx", (S, T + 1), "i32", "state", "the tokens of each sequence's cache window")
    p.add("fill", (S,), "i32", "state", "how many tokens of ctx are known (prompt, then drawn)")
    p.add("out", (S, max(max_new, 1)), "i32", "state", "the tokens drawn, in order")
    p.add("n_out", (S,), "i32", "state", "how many tokens were drawn")
    p.add("done", (S,), "i32", "state", "1 once a sequence drew max_new tokens or the stop sequence")
    p.add("emit", (2, S), "i32", "state", "this step's draw (-1: none) and done, for the host")
    p.add("opts", (GEN_OPTS_WORDS,), "i32", "state", "the sampling options (pack_gen_opts)")
    p.add("stop", (STOP_MAX,), "i32", "state", "the stop sequence")
    p.add("pos", (1,), "i32", "state", "the position being decoded")
    p.add("x", (S, C), "f32", "activation", "residual stream at this position")
    p.add("h", (S, C), dtype, "activation", "a layernorm output")
    p.add("h_mean", (S,), "f32", "activation")
    p.add("h_rstd", (S,), "f32", "activation")
    p.add("qkv", (S, 3 * C), "f32", "activation")
    p.add("y", (S, C), dtype, "activation", "attention output")
    p.add("attn_part", (S, H, -(-T // DECODE_ATT_CHUNK), C // H + 2), "f32", "activation",
          "the split attention's partial results, a chunk of keys each")
    p.add("fc_pre", (S, 4 * C), dtype, "activation")
    p.add("fc_act", (S, 4 * C), dtype, "activation")
    p.add("logits", (S, vocab_size), "f32", "activation")
    p.add("kcache", (L, S, H, T, C // H), dtype, "activation", "keys of every layer, head and position")
    p.add("vcache", (L, S, H, T, C // H), dtype, "activation", "values")
    if dtype == "bf16":
        p.add("params_bf16", (table.total,), "bf16", "activation",
              "the parameters' bf16 working copy, the products' (made once, from the loaded weights)")
    if workspaces is not None:
        p.add_workspaces(workspaces)
        p.add("state", (state.WORDS,), "i32", "state", "StepState (gptcuda/model/state.py)")
    return p


DECODE_ATT_CHUNK = 64  # keys a block of the split decode attention (decode.py passes it to the kernels)

# kernels/decode.cu GenOpts: the words of the `opts` buffer
GEN_OPTS_WORDS = 8
STOP_MAX = 16          # kernels/decode.cu STOP_MAX


def pack_gen_opts(seed: int, top_k: int, temp: float, top_p: float, max_new: int, n_stop: int) -> np.ndarray:
    """GenOpts as int32 words: seed, top_k, 1/temp (0: greedy), top_p, max_new, n_stop, 0, 0."""
    words = np.zeros(GEN_OPTS_WORDS, np.int32)
    words[[0, 1, 4, 5]] = [np.uint32(seed).view(np.int32), top_k, max_new, n_stop]
    words[2:4] = np.array([0.0 if temp == 0 else 1.0 / temp, top_p], np.float32).view(np.int32)
    return words


def unpack_gen_opts(words) -> dict:
    w = np.asarray(words).astype(np.int64).astype(np.int32)
    f = w[2:4].view(np.float32)
    return dict(seed=int(w[0].view(np.uint32)), top_k=int(w[1]), inv_temp=float(f[0]), top_p=float(f[1]),
                max_new=int(w[4]), n_stop=int(w[5]))
