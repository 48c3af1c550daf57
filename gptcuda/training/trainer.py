"""The training loop behind train.py: logging, evaluation, checkpoints, resume, interrupts.

In a data-parallel run (a gptcuda.dist.Group) every rank runs this loop in step; only rank 0
logs and writes files (metrics, checkpoints, config, tokenizer)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time

from gptcuda.runtime import execution
from gptcuda.errors import RunError, UsageError, describe_os_error
from gptcuda.files import atomic_open, temp_files
from gptcuda.training.interrupts import EXIT_CODES, Signals  # noqa: F401  (EXIT_CODES: train.py)
from gptcuda.training.rundir import RUN_FILES, check_out_dir, cut_metrics, holds_run, lock_run_dir
from gptcuda.model.checkpoint import (FORMAT_VERSION, CheckpointError, load_checkpoint, read_checkpoint_meta,
                                      save_checkpoint)
from gptcuda.config import (accum_steps, compare_for_resume, format_config, model_vocab, save_config,
                            validate_against_data)
from gptcuda.data.dataset import DataError, open_dataset
from gptcuda.training.engine import Engine, plan_for
from gptcuda.training import dashboards, hellaswag
from gptcuda.interop import init_for_training
from gptcuda.data.tokenizers import GPT2_VOCAB, load_tokenizer, parse_spec

def flops_per_token(cfg, n_params: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention (nanoGPT / PaLM estimate)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def fmt_loss(x: float) -> str:
    """A loss for the log: 4 decimals, or 4 digits and an exponent once it is huge (a diverging run)."""
    return f"{x:.4f}" if abs(x) < 1e6 else f"{x:.4g}"


class NonFiniteLoss(RuntimeError):
    pass


def _quiet(*a, **k):
    pass




def check_device(cfg):
    """Raise NoDeviceError (one line) before anything is printed or created when the cuda backend has
    no GPU to run on."""
    if cfg.backend == "cuda":
        from gptcuda.runtime.driver import Device
        Device(cfg.device)


class Trainer:
    """resume: continue out_dir/last.ckpt; overwrite: start afresh in an out_dir that holds a run
    (replacing its files); without either such an out_dir is refused. files=False: touch no file
    (train.py --profile). Nothing is written to out_dir before every check has passed and the engine
    is set up. After train(), `interrupted` is the signal number of an interrupt (else None). A writer
    holds out_dir's lock (rundir.lock_run_dir) from set-up to the end of train() (or close())."""

    def __init__(self, cfg, resume: bool = False, log=print, group=None, overwrite: bool = False,
                 files: bool = True):
        self.lock = None
        if files and (group is None or group.rank == 0) and not (resume and overwrite):
            check_out_dir(cfg.out_dir)
            if os.path.isdir(cfg.out_dir):
                self.lock = lock_run_dir(cfg.out_dir)      # before anything in it is read
        try:
            self._setup(cfg, resume, log, group, overwrite, files)
        except BaseException:
            self.close()
            raise

    def close(self):
        """Give up out_dir's lock (a finished or failed run)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _setup(self, cfg, resume, log, group, overwrite, files):
        if resume and overwrite:
            raise UsageError("--resume continues the run in out_dir and --overwrite replaces it: pass one")
        check_device(cfg)
        init = init_for_training(cfg) if cfg.init_from else None
        if init is not None:
            cfg = init.cfg
        self.group = group
        self.rank = group.rank if group is not None else 0
        self.world = group.world_size if group is not None else 1
        self.main = self.rank == 0
        self.writes = files and self.main
        self.log = log = log if self.main else _quiet
        self.interrupted = None
        self.signals = Signals()         # installed by train()
        out = cfg.out_dir
        tok_path = os.path.join(out, "tokenizer.json")
        ckpt = os.path.join(out, "last.ckpt")
        if self.writes:
            check_out_dir(out)
        saved, changes = None, []
        if resume:
            if not os.path.isfile(ckpt):
                why = (f" (no directory {out})" if not os.path.isdir(out) else
                       " (the run there saved none: start it again without --resume)"
                       if os.path.lexists(os.path.join(out, "metrics.jsonl")) else "")
                raise CheckpointError(f"--resume: no checkpoint at {ckpt}{why}")
            meta = read_checkpoint_meta(ckpt)
            saved = self._run_tokenizer(tok_path)
            changes = self._compare(cfg, meta, ckpt, saved)
        elif self.writes:
            held = holds_run(out)
            if held and not overwrite:
                raise RunError(f"out_dir {out} already holds a run ({', '.join(held)}): continue it with --resume, "
                               f"or start over with --overwrite (replaces its files), or choose another out_dir")
        tok_dict = saved.to_dict() if saved is not None else init.tokenizer if init is not None else None
        self.data, V, self.accum = open_run_data(cfg, self.world, tok_dict)
        cfg = dataclasses.replace(cfg, tokenizer=self.data.tokenizer.name)    # the one used (shards carry theirs)
        self.hellaswag = (hellaswag.render(hellaswag.read_examples(cfg.hellaswag), self.data.tokenizer,
                                           cfg.block_size) if cfg.hellaswag else None)
        if self.writes:
            dashboards.check(cfg)
        self.dash = None
        self.cfg = cfg
        log(format_config(cfg))
        if init is not None and init.changes:
            log(f"init_from {cfg.init_from} sets " + "; ".join(init.changes))
        log(self.data.describe())
        if self.accum > 1:
            log(f"gradient accumulation: {self.accum} micro-batches of {cfg.batch_size} x {cfg.block_size} tokens"
                + (f" on each of {self.world} GPUs" if self.world > 1 else "") + " a step")
        log(plan_for(cfg, V, accum=self.accum).format())
        self.eng = Engine(cfg, self.data.train, self.data.val, V, group=group, n_vocab=self.data.vocab_size,
                          accum=self.accum, programs=("train", "eval") + (("forward",) if cfg.hellaswag else ()))
        log(self.eng.exec.format())
        if self.eng.tuning:
            log(self.eng.tuning)            # the measured GEMM table: what setup measured, where it lives
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
        elif init is not None:
            self.eng.set_params(init.named)            # the optimizer state starts at zero
            log(f"initialised from {cfg.init_from}")
        self.metrics = None
        if self.writes:
            self._create_files(resume, overwrite)
        if resume:
            if changes:
                log(f"settings changed since the checkpoint: {'; '.join(changes)}")
            log(f"resumed from {ckpt} at step {self.start_step}")
        n_params = self.eng.table.n_params
        self.flops_tok = flops_per_token(self.cfg, n_params)
        log(f"{n_params / 1e6:.2f}M parameters; setup (compile + record + capture) {self.eng.setup_seconds:.1f} s")

    # ---- the run directory ------------------------------------------------------------------
    @staticmethod
    def _run_tokenizer(path):
        try:
            return load_tokenizer(path)
        except FileNotFoundError:
            raise CheckpointError(f"--resume: the run's tokenizer file {path} is missing") from None
        except ValueError as e:
            raise CheckpointError(f"--resume: {e}") from None
        except OSError as e:
            raise CheckpointError(f"--resume: cannot read {path}: {e.strerror}") from None

    def _compare(self, cfg, meta, ckpt, saved_tok) -> list[str]:
        """Every model difference between the checkpoint's config and cfg in one CheckpointError; the
        other (recipe) changes, to be logged."""
        saved = meta.get("config")
        if not isinstance(saved, dict):
            return []
        if cfg.tokenizer == "char":      # the default: token shards' own tokenizer (the run's, saved beside it)
            cfg = dataclasses.replace(cfg, tokenizer=saved_tok.name)
        saved = dict(saved, tokenizer=saved_tok.name)       # older runs saved "char" for gpt2 / bpe shards
        model, other = compare_for_resume(saved, cfg, model_vocab(cfg, saved_tok.vocab_size))
        if model:
            raise CheckpointError(f"--resume: {ckpt} holds another model than this config: {'; '.join(model)} "
                                  f"(these must match; start a new run in another out_dir, or with --overwrite)")
        return other

    def _create_files(self, resume: bool, overwrite: bool):
        """The first writes to out_dir: stale temporary files removed, then (a new run) the old run's files
        replaced, or (--resume) metrics.jsonl cut back to the checkpoint's step. An OSError is one line
        naming the path; a directory this made is removed again."""
        out = self.cfg.out_dir
        made = None                      # the topmost directory this makes (removed again on failure)
        p = os.path.abspath(out)
        while not os.path.lexists(p):
            made, p = p, os.path.dirname(p)
        try:
            os.makedirs(out, exist_ok=True)
            if self.lock is None:
                self.lock = lock_run_dir(out)
            for t in temp_files(out, RUN_FILES):
                os.unlink(t)
                self.log(f"removed {t}, a temporary file a killed writer left behind")
            mpath = os.path.join(out, "metrics.jsonl")
            if resume:
                dropped = cut_metrics(mpath, self.start_step, self.evaluated_step)
                if dropped:
                    self.log(f"{mpath}: dropped {dropped} record(s) past the checkpoint (step {self.start_step}); "
                             f"those steps run again")
            else:
                for f in ("last.ckpt", "best.ckpt"):
                    p = os.path.join(out, f)
                    if os.path.lexists(p):
                        os.unlink(p)         # --overwrite: the old run's checkpoints go first
                with atomic_open(mpath) as f:
                    pass
                self.data.tokenizer.save(os.path.join(out, "tokenizer.json"))
            save_config(self.cfg, os.path.join(out, "config.yaml"))
            with atomic_open(os.path.join(out, "execution.json")) as f:     # which kernels run (execution.py)
                f.write(json.dumps(self.eng.exec.to_dict(), indent=1) + "\n")
            self.metrics = open(mpath, "a", encoding="utf-8")
            self.dash = dashboards.Dashboards(self.cfg, resume, self.start_step)
        except BaseException as e:          # an OSError, or Ctrl-C while setting up
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
            if made is not None and self.lock is not None:     # not when another run holds it
                shutil.rmtree(made, ignore_errors=True)
            if isinstance(e, OSError):
                raise RunError(describe_os_error(e, "cannot write")) from None
            raise

    # -----------------------------------------------------------------------------------------
    def profile(self) -> str:
        """The phase table of one training step (CUDA backend), after a few warm-up steps."""
        if self.cfg.backend != "cuda":
            raise UsageError("--profile needs the cuda backend")
        from gptcuda.runtime.profile import phase_table
        for _ in range(3):
            self.eng.train_step()
        return phase_table(self.eng.be.rt, self.eng.programs["train"])

    def write_metrics(self, **rec):
        if self.metrics is None:
            return
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        if self.dash is not None:
            self.dash.write(rec)

    def save(self, name: str, step: int):
        arrays, meta = self.eng.state_dict()          # every rank: ZeRO-1 gathers the Adam state
        if not self.writes:
            return
        if int(meta["step"]) != step:
            raise RuntimeError(f"state step {meta['step']} != loop step {step}")
        meta.update(format_version=FORMAT_VERSION, best_val=self.best_val, evaluated_step=self.evaluated_step,
                    config=self.cfg.to_dict(), tokenizer=json.dumps(self.data.tokenizer.to_dict()))
        if self.group is not None:
            meta["world_size"] = self.world           # --resume needs as many GPUs (absent: one)
        path = os.path.join(self.cfg.out_dir, f"{name}.ckpt")
        try:
            with self.signals.critical():
                save_checkpoint(path, arrays, meta)
        except OSError as e:
            keep = f"; the previous {name}.ckpt is left as it was" if os.path.exists(path) else ""
            raise CheckpointError(describe_os_error(e, "cannot write checkpoint") + keep) from None

    def train(self, bar=True):
        self.signals = sig = Signals(deferred=self.eng.dp is not None)   # data parallel: see _stop_vote
        sig.install()
        try:
            return self._train(bar)
        finally:
            sig.restore()
            self.close()

    def _stop_vote(self):
        """Data parallel, at a step boundary, on every rank: whether any rank was sent SIGINT or SIGTERM
        (one small all-reduce); then every rank stops here, and rank 0 saves last.ckpt as one GPU does."""
        sig = self.signals
        term, other = self.eng.dp.any_of([sig.signum == signal.SIGTERM, sig.signum not in (None, signal.SIGTERM)])
        if term or other:
            sig.signum = signal.SIGTERM if term else signal.SIGINT
            sig.agreed = True
            raise KeyboardInterrupt

    def _log_step(self, step, st, ms, tokens_step, pbar):
        cfg = self.cfg
        tok_s = tokens_step / ms * 1e3 if ms > 0 else 0.0
        mfu = (self.flops_tok * tok_s / (self.eng.exec.peak_tflops * 1e12 * self.world)
               if cfg.backend == "cuda" else 0.0)
        self.write_metrics(step=step, loss=st["loss"], lr=st["lr"], grad_norm=st["grad_norm"], ms=ms,
                           tok_s=tok_s, mfu=mfu)
        if pbar is not None:
            pbar.set_postfix(loss=fmt_loss(st['loss']), ms=f"{ms:.2f}", tok_s=f"{tok_s:,.0f}",
                             mfu=f"{100 * mfu:.1f}%")
            pbar.update(step - pbar.n)
        else:
            self.log(f"step {step:6d} loss {fmt_loss(st['loss'])} lr {st['lr']:.2e} {ms:7.2f} ms "
                     f"{tok_s:,.0f} tok/s mfu {100 * mfu:.1f}%")

    def _logs(self, step):
        return step % self.cfg.log_interval == 0 or step == self.cfg.max_iters

    def _train(self, bar):
        cfg, eng, sig = self.cfg, self.eng, self.signals
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
                if sig.deferred:
                    self._stop_vote()
                with sig.critical():         # a signal waits for the step and its record
                    eng.train_step()
                    step += 1
                    if self._logs(step):
                        st = eng.state()     # synchronises
                        now = time.perf_counter()
                        ms = (now - t_last) * 1e3 / max(step - step_last, 1)
                        t_last, step_last = now, step
                        if not math.isfinite(st["loss"]) or not math.isfinite(st["grad_norm"]):
                            raise NonFiniteLoss(f"loss became {fmt_loss(st['loss'])} (grad norm "
                                                f"{fmt_loss(st['grad_norm'])}) at step "
                                                f"{step}; stopped, the last good checkpoint is left as it was")
                        self._log_step(step, st, ms, tokens_step, pbar)
        except KeyboardInterrupt:
            sig.stopping = True                  # a second Ctrl-C must not break the save below
            self.interrupted = sig.signum or signal.SIGINT
            what = "terminated (SIGTERM)" if self.interrupted == signal.SIGTERM else "interrupted"
            if eng.dp is not None and not sig.agreed:
                # not stopped by a vote: the other ranks may be a step ahead or behind, no collective
                # (checkpoint) can be trusted to complete, and a pending one must not keep the GPU
                self.log(f"\n{what} at step {step}; a multi-GPU run keeps its last evaluation checkpoint")
                eng.dp.abort()
                return self.best_val
            # the device's counters are the truth: a step interrupted in Python may have run there
            done = eng.sync_counters()["step"]
            st = eng.state()
            if done == step + 1:
                step = done
                if self._logs(step) and math.isfinite(st["loss"]):
                    self._log_step(step, st, (time.perf_counter() - t_last) * 1e3 / max(step - step_last, 1),
                                   tokens_step, pbar)
            elif done != step:
                raise RuntimeError(f"the device is at step {done} and the loop at step {step}")
            if cfg.checkpoint and math.isfinite(st["loss"]):
                self.save("last", step)
                self.log(f"\n{what} at step {step}; saved {cfg.out_dir}/last.ckpt (resume with --resume)")
            else:
                self.log(f"\n{what} at step {step}; nothing saved")
            return self.best_val
        finally:
            if pbar is not None:
                pbar.close()
            if self.metrics is not None:
                self.metrics.close()
            if self.dash is not None:
                self.dash.close()
        return self.best_val

    def _eval_losses(self, step) -> dict:
        losses = self.eng.evaluate()
        if not all(math.isfinite(v) for v in losses.values()):
            raise NonFiniteLoss(f"evaluation loss became {losses} at step {step}; stopped, the last good "
                                "checkpoint is left as it was")
        return losses

    def evaluate_only(self) -> dict:
        """train.py --eval_only: one evaluation (eval_iters batches of each split) of the weights as set
        up: resumed, init_from or the fresh initialisation. Always on the batches of a run's first
        evaluation, so that any two sets of weights are compared on the same tokens (and fresh weights
        give a run's step-0 losses). {"train": loss, "val": loss}; build the Trainer with files=False
        and nothing is written."""
        self.eng.set_counters(self.start_step, 0)
        return self._eval_losses(self.start_step)

    def _evaluate(self, step):
        """The evaluation at `step`, its checkpoints and its record, or (interrupted anywhere in it) none
        of them: the counters, best_val and evaluated_step are put back, so that the checkpoint of the
        interrupt describes the point before it and a resumed run redoes the whole evaluation."""
        before = (self.eng.counters["eval_draws"], self.best_val, self.evaluated_step)
        try:
            losses = self._eval_losses(step)
            losses.update(hellaswag.at_step(self.eng, self.hellaswag, step, self.rank, self.world))
            self.evaluated_step = step
            if self.cfg.checkpoint:
                if losses["val"] < self.best_val:
                    self.best_val = losses["val"]
                    self.save("best", step)
                self.save("last", step)
            else:
                self.best_val = min(self.best_val, losses["val"])
            self.write_metrics(step=step, eval_train=losses["train"], eval_val=losses["val"],
                               **{k: v for k, v in losses.items() if k.startswith("hellaswag")})
        except KeyboardInterrupt:
            if self.eng.dp is None:
                self.eng.set_counters(step, before[0])
                self.best_val, self.evaluated_step = before[1], before[2]
            raise
        self.log(f"\nstep {step}: train loss {fmt_loss(losses['train'])}, val loss {fmt_loss(losses['val'])}"
                 + hellaswag.describe(losses))


def open_run_data(cfg, world: int = 1, saved_tokenizer: dict | None = None, check: bool = True):
    """(dataset, the model's vocabulary, micro-batches a step) of a config, checked against each other."""
    data = open_dataset(cfg.data, cfg.tokenizer, saved_tokenizer=saved_tokenizer, val_data=cfg.val_data,
                        check=check)
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    return data, model_vocab(cfg, data.vocab_size), accum_steps(cfg, world)


def known_vocab(cfg) -> int | None:
    """The tokenizer's vocabulary where the config alone fixes it (gpt2, bpe:N, or vocab_size set);
    None for char, whose vocabulary is the text's characters."""
    kind, n = parse_spec(cfg.tokenizer)
    if cfg.vocab_size:
        return cfg.vocab_size
    return {"gpt2": GPT2_VOCAB, "bpe": n}.get(kind)


def print_plan(cfg, log=print):
    """train.py --plan. Data that is not there yet (shards still to be downloaded or prepared) does
    not stop it where the config alone fixes the vocabulary: the plan is the same."""
    try:
        data, V, accum = open_run_data(cfg, check=False)       # --plan writes nothing (no id cache)
        described = data.describe()
    except (DataError, FileNotFoundError) as e:
        n = known_vocab(cfg)
        if n is None:
            raise
        V, accum = model_vocab(cfg, n), accum_steps(cfg)
        described = (f"data: not read ({e}); the plan takes the {cfg.tokenizer} tokenizer's {n} tokens"
                     if not cfg.vocab_size else f"data: not read ({e}); the plan takes vocab_size {n}")
    log(format_config(cfg))
    log(described)
    log(plan_for(cfg, V, accum=accum).format(detail=True))
    log(execution.resolve(cfg, arch="sm_90").format() + ("\n  (for an sm_90 device; a run logs its own and saves it "
                                                         "as execution.json)" if cfg.backend == "cuda" else ""))
