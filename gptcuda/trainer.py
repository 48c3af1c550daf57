"""The training loop behind train.py: logging, evaluation, checkpoints, resume, interrupts.

In a data-parallel run (a gptcuda.dist.Group) every rank runs this loop in step; only rank 0
logs and writes files (metrics, checkpoints, config, tokenizer)."""
from __future__ import annotations

import json
import math
import os
import time

from .cli import UsageError
from .checkpoint import FORMAT_VERSION, CheckpointError, load_checkpoint, save_checkpoint
from .config import accum_steps, format_config, model_vocab, save_config, validate_against_data
from .dataset import open_dataset
from .engine import Engine, plan_for
from .tokenizers import load_tokenizer

PEAK_TFLOPS = {"fp32": 67.0, "tf32": 495.0}   # H100/H200 SXM dense datasheet rates, for MFU


def peak_tflops(cfg) -> float:
    """The MFU denominator: the datasheet rate of the precision, and for fp32 with fp32_gemm 3xtf32
    a third of TF32's (three tensor-core products per multiply), which is above the FMA rate."""
    if cfg.precision == "fp32" and cfg.fp32_gemm == "3xtf32":
        return PEAK_TFLOPS["tf32"] / 3
    return PEAK_TFLOPS[cfg.precision]


def flops_per_token(cfg, n_params: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention (nanoGPT / PaLM estimate)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class NonFiniteLoss(RuntimeError):
    pass


def _quiet(*a, **k):
    pass


class Trainer:
    def __init__(self, cfg, resume: bool = False, log=print, group=None):
        self.group = group
        self.rank = group.rank if group is not None else 0
        self.world = group.world_size if group is not None else 1
        self.main = self.rank == 0
        self.log = log = log if self.main else _quiet
        if self.main:
            os.makedirs(cfg.out_dir, exist_ok=True)
        tok_path = os.path.join(cfg.out_dir, "tokenizer.json")
        ckpt = os.path.join(cfg.out_dir, "last.ckpt")
        saved = None
        if resume:
            if not os.path.exists(ckpt):
                raise CheckpointError(f"--resume: no checkpoint at {ckpt}")
            saved = load_tokenizer(tok_path).to_dict()
        self.data, V, self.accum = open_run_data(cfg, self.world, saved)
        self.cfg = cfg
        log(format_config(cfg))
        log(self.data.describe())
        if self.accum > 1:
            log(f"gradient accumulation: {self.accum} micro-batches of {cfg.batch_size} x {cfg.block_size} tokens"
                + (f" on each of {self.world} GPUs" if self.world > 1 else "") + " a step")
        log(plan_for(cfg, V, accum=self.accum).format())
        self.eng = Engine(cfg, self.data.train, self.data.val, V, group=group, n_vocab=self.data.vocab_size,
                          accum=self.accum)
        if self.eng.dp is not None:
            log(self.eng.dp.describe())
        self.cfg = self.eng.cfg
        self.best_val = math.inf
        self.start_step = 0
        self.evaluated_step = -1      # the step whose evaluation is done (and in the checkpoint)
        if resume:
            arrays, meta = load_checkpoint(ckpt)
            self.eng.check_shapes(arrays, ckpt)
            ranks = int(meta.get("world_size", 1))
            if ranks != self.world:
                raise CheckpointError(f"--resume: {ckpt} was written by a run on {ranks} GPU(s) and this run has "
                                      f"{self.world}; resume it with the same number (the global batch would change)")
            self.eng.load_state_dict(arrays, meta)
            self.best_val = float(meta.get("best_val", math.inf))
            self.start_step = int(meta["step"])
            self.evaluated_step = int(meta.get("evaluated_step", -1))
            log(f"resumed from {ckpt} at step {self.start_step}")
        elif self.main:
            self.data.tokenizer.save(tok_path)
        self.metrics = None
        if self.main:
            save_config(self.cfg, os.path.join(cfg.out_dir, "config.yaml"))
            self.metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
        n_params = self.eng.table.n_params
        self.flops_tok = flops_per_token(self.cfg, n_params)
        log(f"{n_params / 1e6:.2f}M parameters; setup (compile + record + capture) {self.eng.setup_seconds:.1f} s")

    def profile(self) -> str:
        """The phase table of one training step (CUDA backend), after a few warm-up steps."""
        if self.cfg.backend != "cuda":
            raise UsageError("--profile needs the cuda backend")
        from .profile import phase_table
        for _ in range(3):
            self.eng.train_step()
        return phase_table(self.eng.be.rt, self.eng.programs["train"])

    def write_metrics(self, **rec):
        if self.metrics is None:
            return
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()

    def save(self, name: str, step: int):
        arrays, meta = self.eng.state_dict()          # every rank: ZeRO-1 gathers the Adam state
        if not self.main:
            return
        if int(meta["step"]) != step:
            raise RuntimeError(f"state step {meta['step']} != loop step {step}")
        meta.update(format_version=FORMAT_VERSION, best_val=self.best_val, evaluated_step=self.evaluated_step,
                    config=self.cfg.to_dict(), tokenizer=json.dumps(self.data.tokenizer.to_dict()))
        if self.group is not None:
            meta["world_size"] = self.world           # --resume needs as many GPUs (absent: one)
        save_checkpoint(os.path.join(self.cfg.out_dir, f"{name}.ckpt"), arrays, meta)

    def train(self, bar=True):
        cfg, eng = self.cfg, self.eng
        tokens_step = cfg.batch_size * cfg.block_size * self.world * self.accum
        step = self.start_step
        t_last, step_last = time.perf_counter(), step
        pbar = None
        if bar and self.main:
            from tqdm import tqdm
            pbar = tqdm(total=cfg.max_iters, initial=step, dynamic_ncols=True, unit="step")
        try:
            while True:
                # a resumed run does not repeat the evaluation its checkpoint was written after:
                # that would draw extra evaluation batches and shift every later estimate
                if (step % cfg.eval_interval == 0 or step == cfg.max_iters) and step != self.evaluated_step:
                    self._evaluate(step)
                    t_last, step_last = time.perf_counter(), step
                if step >= cfg.max_iters:
                    break
                eng.train_step()
                step += 1
                if step % cfg.log_interval == 0 or step == cfg.max_iters:
                    st = eng.state()     # synchronises
                    now = time.perf_counter()
                    ms = (now - t_last) * 1e3 / max(step - step_last, 1)
                    t_last, step_last = now, step
                    if not math.isfinite(st["loss"]) or not math.isfinite(st["grad_norm"]):
                        raise NonFiniteLoss(f"loss became {st['loss']} (grad norm {st['grad_norm']}) at step "
                                            f"{step}; stopped, the last good checkpoint is left as it was")
                    tok_s = tokens_step / ms * 1e3
                    mfu = (self.flops_tok * tok_s / (peak_tflops(cfg) * 1e12 * self.world)
                           if cfg.backend == "cuda" else 0.0)
                    rec = dict(step=step, loss=st["loss"], lr=st["lr"], grad_norm=st["grad_norm"], ms=ms,
                               tok_s=tok_s, mfu=mfu)
                    self.write_metrics(**rec)
                    if pbar is not None:
                        pbar.set_postfix(loss=f"{st['loss']:.4f}", ms=f"{ms:.2f}", tok_s=f"{tok_s:,.0f}",
                                         mfu=f"{100 * mfu:.1f}%")
                        pbar.update(step - pbar.n)
                    else:
                        self.log(f"step {step:6d} loss {st['loss']:.4f} lr {st['lr']:.2e} {ms:7.2f} ms "
                                 f"{tok_s:,.0f} tok/s mfu {100 * mfu:.1f}%")
        except KeyboardInterrupt:
            if eng.dp is not None:
                # the other ranks may be a step ahead or behind: no collective (checkpoint) can be
                # trusted to complete, and a pending one must not keep the GPU
                self.log(f"\ninterrupted at step {step}; a multi-GPU run keeps its last evaluation checkpoint")
                eng.dp.abort()
                return self.best_val
            st = eng.state()
            if cfg.checkpoint and math.isfinite(st["loss"]):
                self.save("last", step)
                self.log(f"\ninterrupted at step {step}; saved {cfg.out_dir}/last.ckpt (resume with --resume)")
            return self.best_val
        finally:
            if pbar is not None:
                pbar.close()
            if self.metrics is not None:
                self.metrics.close()
        return self.best_val

    def _evaluate(self, step):
        losses = self.eng.evaluate()
        if not all(math.isfinite(v) for v in losses.values()):
            raise NonFiniteLoss(f"evaluation loss became {losses} at step {step}; stopped, the last good "
                                "checkpoint is left as it was")
        self.evaluated_step = step
        self.write_metrics(step=step, eval_train=losses["train"], eval_val=losses["val"])
        self.log(f"\nstep {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if self.cfg.checkpoint:
            if losses["val"] < self.best_val:
                self.best_val = losses["val"]
                self.save("best", step)
            self.save("last", step)
        else:
            self.best_val = min(self.best_val, losses["val"])


def open_run_data(cfg, world: int = 1, saved_tokenizer: dict | None = None):
    """(dataset, the model's vocabulary, micro-batches a step) of a config, checked against each other."""
    data = open_dataset(cfg.data, cfg.tokenizer, saved_tokenizer=saved_tokenizer, val_data=cfg.val_data)
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    return data, model_vocab(cfg, data.vocab_size), accum_steps(cfg, world)


def print_plan(cfg, log=print):
    data, V, accum = open_run_data(cfg)
    log(format_config(cfg))
    log(data.describe())
    log(plan_for(cfg, V, accum=accum).format(detail=True))
