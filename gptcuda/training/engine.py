"""A training session: plan, allocate, initialise, record the programs, run steps.

    eng = Engine(cfg, train, val, V)  # eng.plan.format() is the memory plan
    eng.train_step()                  # one optimizer step (graph replay or eager launches)
    eng.evaluate()                    # {"train": loss, "val": loss}

train / val are token streams (gptcuda/data/dataset.py: memory-mapped shards) or numpy arrays; the
batches of each program are gathered on the host and fed before its replay (gptcuda/data/batches.py).
    eng.state_dict() / eng.load_state_dict(arrays, meta)

Used by train.py, gradcheck.py and the tests, with either backend; generation plans its own buffers
(gptcuda/generate/sampler.py Generator). With a gptcuda.dist.Group (one rank of a data-parallel
run) the training step also all-reduces (eng.dp, gptcuda/dist/); evaluation losses are the mean
over the ranks.

It prints nothing, but for one progress line (stderr) on a GPU whose GEMM table lacks shapes of
its programs (gemm_tune auto: gptcuda/ops/cuda/gemm/tune.py autotune measures them before the
programs are recorded); eng.tuning is a line for the log about the table (None where nothing is
measured for this Engine: gemm_tune table or off, no GPU, no programs, nothing a data-parallel
run lacks).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from gptcuda.runtime import bf16, compiler, driver, execution
from gptcuda.model.checkpoint import CheckpointError
from gptcuda.data.batches import Batches
from gptcuda.model.memory import check_fits, plan_memory
from gptcuda.model.gpt import GPT
from gptcuda.model.params import flatten, init_params, param_table, unflatten


def backend_class(cfg):
    if cfg.backend == "reference":
        from gptcuda.ops.reference.backend import ReferenceBackend
        return ReferenceBackend
    from gptcuda.ops.cuda_backend import CudaBackend
    return CudaBackend


def plan_for(cfg, vocab_size: int, backend=None, accum: int = 1):
    """The memory plan of a config; pure arithmetic, no GPU touched (train.py --plan: the plan of an
    sm_90 device; an Engine's backend leaves out the scratch its device never reads)."""
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    be = backend or backend_class(cfg)
    ex = backend.exec if backend is not None else None
    ex = ex or execution.resolve(cfg)
    return plan_memory(cfg, param_table(cfg, vocab_size), vocab_size, accum,
                       be.attention_saved(cfg, ex), workspaces_for(cfg, backend), cfg.max_iters + 1, ex.act_dtype,
                       ex.grad_dtype)


def workspaces_for(cfg, backend=None) -> dict:
    """The op families' scratch for cfg's batch_size x block_size rows {name: (shape, dtype)} under the
    backend's execution plan (none: the config's on sm_90); with a backend, only the scratch its
    device reads."""
    if backend is None:
        return backend_class(cfg).workspaces(cfg)
    return backend.device_workspaces(backend.workspaces(cfg, backend.exec))


class Engine:
    """programs: what to record (each compiled and packed once): "train" (the optimizer step),
    "eval" (one evaluation batch of each split), "fwdbwd" (forward and backward on the batch in
    place), "forward" (logits and losses without dropout), "forward_train" (with dropout).

    vocab_size: the model's (padded) vocabulary; n_vocab: the tokenizer's (None: the same), the loss
    masks the rest. accum: micro-batches per training step (gradient accumulation). tune False: the
    GEMM shapes the table lacks are not measured even where the execution plan says gemm_tune auto."""

    def __init__(self, cfg, train_tokens, val_tokens, vocab_size: int,
                 backend=None, programs=("train", "eval"), group=None, n_vocab: int | None = None,
                 accum: int = 1, tune: bool = True):
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
        self.cfg = cfg
        self.n_vocab = vocab_size if n_vocab is None else int(n_vocab)
        if not 0 < self.n_vocab <= vocab_size:
            raise ValueError(f"the tokenizer's vocabulary ({self.n_vocab}) exceeds the model's ({vocab_size})")
        self.accum = int(accum)
        world, rank = (group.world_size, group.rank) if group is not None else (1, 0)
        # the dropout stream: the run's seed, each data-parallel rank its own (dist rank_seed; the
        # batches keep the world's seed and take the rank's rows)
        if group is None:
            self.dropout_seed = cfg.seed
        else:
            from gptcuda.dist.env import rank_seed
            self.dropout_seed = rank_seed(cfg.seed, rank)
        self.be = backend = backend or backend_class(cfg)(cfg, seed=self.dropout_seed)
        self.exec = backend.exec                # which kernels run (gptcuda/runtime/execution.py)
        self.plan = plan_for(cfg, vocab_size, backend, self.accum)
        self.table = self.plan.table
        self.batches = Batches(train_tokens, val_tokens, cfg.batch_size, cfg.block_size, cfg.seed, self.accum,
                               world, rank)
        check_fits(self.plan, backend.free_bytes(), cfg)
        wanted = {"train": ["train"], "eval": ["eval_train", "eval_val"]}
        names = list(dict.fromkeys(n for p in programs for n in wanted.get(p, [p])))
        # before the arena is allocated (the timing buffers come and go) and before the programs are
        # recorded (their launches read the table)
        self.tuning = self._tune_gemms(names, world) if tune else None
        self.bufs = backend.allocate(self.plan, self.table)
        a = self.bufs.acts
        self.feeder = backend.batch_feeder(a["idx"], a["targets"], self.batches.rows("train"), cfg.block_size)
        backend.upload(self.bufs.flat_params, init_params(self.table, cfg, cfg.seed))
        for r in (self.bufs.flat_grads, self.bufs.flat_m, self.bufs.flat_v):
            backend.upload(r, np.zeros(self.table.total, np.float32))
        backend.write_state(step=0, eval_draws=0, work_fresh=0)   # (work_fresh: after every write of the parameters)
        self.counters = {"step": 0, "eval_draws": 0}   # the host's copy of the StepState's counters
        self.model = GPT(cfg, backend, self.bufs, self.table, n_vocab=self.n_vocab, accum=self.accum)
        self.dp = None
        if group is not None:
            from gptcuda.dist import DataParallel
            self.dp = self.model.dp = DataParallel(group, backend, self.bufs, self.table, cfg,
                                                   grads=self.model.final_grads())
        t = time.perf_counter()
        m = self.model
        recorders = {
            "train": m.record_train_step,
            "eval_train": lambda: m.record_eval_batch("train"),
            "eval_val": lambda: m.record_eval_batch("val"),
            "fwdbwd": m.record_forward_backward,
            "forward": m.record_forward,
            "forward_train": lambda: m.record_forward(train=True),
        }
        self.programs = {n: self._record(n, recorders[n]) for n in names}
        self.graphs = {}
        if cfg.graph and cfg.backend == "cuda":
            if self.dp is not None and "train" in self.programs:
                self.dp.warmup(self.programs["train"])       # NCCL connects before the capture
            for name in ("train", "eval_train", "eval_val"):
                if name in self.programs:
                    self.graphs[name] = backend.capture(self.programs[name])
        self.setup_seconds = time.perf_counter() - t

    def _tune_gemms(self, names, world: int) -> str | None:
        """gemm_tune auto, the CUDA backend on a GPU: measure the GEMM shapes of these programs that
        the GPU's table lacks (gemm/tune.py autotune; none where no program is recorded).
        Returns the line for the log, None where the table is not measured for this Engine."""
        from gptcuda.ops.cuda.gemm import tune
        rt = getattr(self.be, "rt", None)
        if not names or self.exec.gemm_tune != "auto" or self.cfg.backend != "cuda" or not driver.drives_gpu(rt):
            return None          # a test's stand-in runtime has no device: never measured on
        cfg, backward = self.cfg, bool({"train", "fwdbwd"} & set(names))
        if world > 1:
            # data parallel: every rank must launch the same plans. A rank measuring for itself would
            # pick by its own timings, and ranks could read the file while another writes it; there is
            # no barrier before the programs are recorded (NCCL connects after). So the table is read
            # as it is: a single-GPU run of the config (or bench/tune.py) fills it.
            missing = tune.missing_ops(rt, cfg, cfg.vocab_size, backward)
            return (f"GEMM table: {len(missing)} shapes of this run are not measured (a data-parallel run does "
                    f"not measure them: a single-GPU run of this config does)") if missing else None
        return tune.autotune(rt, cfg, cfg.vocab_size, backward=backward).format()

    def _record(self, name, fn):
        self.be.begin(name)
        try:
            fn()
        finally:
            prog = self.be.end()
        return prog

    def run(self, name: str):
        """Run a recorded program: its graph when captured, else its launches one by one."""
        with compiler.forbid_compiles():
            g = self.graphs.get(name)
            if g is not None:
                g.launch()
            else:
                self.be.run(self.programs[name])

    def feed(self, program: str, counter: int):
        """Gather the batch of `program` ("train", "eval_train", "eval_val") at the counter's value
        on the host and queue its copy into idx / targets, ahead of the program's replay."""
        b = self.batches
        self.feeder.put(b.rows(program), lambda x, y: b.fill(program, counter, x, y))

    def train_step(self):
        step = self.counters["step"]
        self.feed("train", step)
        self.run("train")
        self.counters["step"] = step + 1

    def evaluate(self) -> dict:
        out = {}
        for split in ("train", "val"):
            losses = []
            for _ in range(self.cfg.eval_iters):
                draw = self.counters["eval_draws"]
                self.feed(f"eval_{split}", draw)
                self.run(f"eval_{split}")
                self.counters["eval_draws"] = draw + 1
                losses.append(self.be.read_state()["loss"])
            out[split] = float(np.mean(losses))
        if self.dp is not None:
            out = dict(zip(out, self.dp.host_mean(list(out.values()))))
        return out

    def state(self) -> dict:
        return self.be.read_state()

    def sync_counters(self) -> dict:
        """Take the device's StepState counters as the host's (Engine.counters) and return them: after
        a program was interrupted in Python (KeyboardInterrupt) the device may have run it while the
        host copy was not advanced yet. (Reading the state waits for the launched work.)"""
        st = self.be.read_state()
        self.counters = {"step": int(st["step"]), "eval_draws": int(st["eval_draws"])}
        return dict(self.counters)

    def set_counters(self, step: int, eval_draws: int):
        """Set the counters on the device and on the host alike (an interrupted evaluation is undone
        by putting eval_draws back to its value before the evaluation)."""
        self.be.write_state(step=int(step), eval_draws=int(eval_draws))
        self.counters = {"step": int(step), "eval_draws": int(eval_draws)}

    def loss_history(self, upto: int) -> np.ndarray:
        h = self.be.download(self.bufs.acts["history"])
        return np.asarray(h[:upto], dtype=np.float64)

    # ---- parameters and checkpoints ----------------------------------------------------
    def params(self) -> dict:
        return unflatten(self.table, self.be.download(self.bufs.flat_params))

    def grads(self) -> dict:
        """name -> the parameters' gradients as the last backward left them (bf16 ones widened to fp32)."""
        g = self.be.download(self.bufs.flat_grads)
        return unflatten(self.table, bf16.values(g) if self.plan.dtype_of("grads") == "bf16" else g)

    def set_params(self, named: dict):
        self.be.upload(self.bufs.flat_params, flatten(self.table, named))
        self.be.write_state(work_fresh=0)

    def set_param(self, name: str, value):
        """Write one parameter tensor (the others stay as they are)."""
        self.be.upload(self.bufs.params[name], value)
        self.be.write_state(work_fresh=0)

    def set_batch(self, x: np.ndarray, y: np.ndarray):
        """[B, T] ids into micro-batch 0 (the programs forward, fwdbwd, forward_train read it)."""
        self.be.upload(self.bufs.acts["idx"][0], x.astype(np.int32))
        self.be.upload(self.bufs.acts["targets"][0], y.astype(np.int32))

    def state_dict(self):
        """Every rank must call this in a data-parallel run (ZeRO-1 gathers the Adam state first)."""
        b = self.bufs
        if self.dp is not None:
            self.dp.gather_optimizer_state()
        # at the backend's own precision (float64 for the reference), so a resume is exact there too
        arrays = {
            "params": self.be.download(b.flat_params),
            "adam_m": self.be.download(b.flat_m),
            "adam_v": self.be.download(b.flat_v),
            "history": self.be.download(b.acts["history"]),
        }
        st = self.be.read_state()
        meta = {"step": int(st["step"]), "eval_draws": int(st["eval_draws"]),
                "param_shapes": {k: list(v) for k, v in self.table.shapes().items()},
                "n_slots": self.table.total}
        return arrays, meta

    def expected_shapes(self) -> dict:
        """Shapes a checkpoint must have (the loss history may differ: max_iters can change on resume)."""
        n = self.table.total
        return {"params": (n,), "adam_m": (n,), "adam_v": (n,)}

    def check_shapes(self, arrays: dict, path: str):
        for name, shape in self.expected_shapes().items():
            have = tuple(arrays[name].shape) if name in arrays else None
            if have != shape:
                raise CheckpointError(f"checkpoint {path}: tensor {name!r} has shape {have}, this model expects "
                                      f"{shape}: from another model shape")

    def load_state_dict(self, arrays: dict, meta: dict):
        b = self.bufs
        self.be.upload(b.flat_params, arrays["params"])
        self.be.upload(b.flat_m, arrays["adam_m"])
        self.be.upload(b.flat_v, arrays["adam_v"])
        hist = np.zeros(b.acts["history"].shape[0], np.float64)
        old = np.asarray(arrays.get("history", hist))[:hist.size]
        hist[:old.size] = old
        self.be.upload(b.acts["history"], hist)
        self.be.write_state(step=int(meta["step"]), eval_draws=int(meta["eval_draws"]), work_fresh=0)
        self.counters = {"step": int(meta["step"]), "eval_draws": int(meta["eval_draws"])}
