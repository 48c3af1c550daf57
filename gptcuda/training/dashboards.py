"""Dashboards beside metrics.jsonl: TensorBoard event files and Weights & Biases, each optional.

    check(cfg)                                   # RunError (one line) when a wanted extra is missing
    dash = Dashboards(cfg, resume, start_step)   # opens what the config asks for (log_tensorboard, wandb_log)
    dash.write({"step": 10, "loss": 2.5, ...})   # a metrics.jsonl record: every number, at its step
    dash.close()

metrics.jsonl stays the record; a dashboard gets the same records, with the record's keys as tags
(loss, lr, grad_norm, ms, tok_s, mfu; eval_train, eval_val; hellaswag, hellaswag_acc). Only the rank
that writes out_dir (rank 0) opens one.

TensorBoard: tensorboardX (pip install -e ".[tensorboard]") writes out_dir/tensorboard/; a resumed run adds
an event file there whose purge step is the step after the checkpoint's, so TensorBoard drops the steps the
interrupted run logged past it and shows one run. A new run (--overwrite) removes the old event files.

W&B (pip install -e ".[wandb]"): the run's id is kept in out_dir/wandb_id; a resumed run continues that W&B
run (resume "allow"), --overwrite starts a new one. W&B keeps only steps above the last it holds, so steps an
interrupted run logged past its checkpoint stay as first logged. WANDB_MODE=offline logs into
out_dir/wandb/ for a later `wandb sync`.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import secrets

from gptcuda.errors import RunError
from gptcuda.files import atomic_open

TB_DIR = "tensorboard"
WANDB_ID = "wandb_id"
EXTRAS = (("log_tensorboard", "tensorboardX", "tensorboard"), ("wandb_log", "wandb", "wandb"))


def check(cfg):
    """RunError naming the key and the extra when the config asks for a dashboard whose package is absent."""
    for key, module, extra in EXTRAS:
        if getattr(cfg, key) and importlib.util.find_spec(module) is None:
            raise RunError(f"{key}: true needs the {module} package: pip install -e \".[{extra}]\" "
                           f"(or set {key}: false)")


def numbers(rec: dict) -> dict:
    """A record's values that a dashboard plots: the numbers other than the step."""
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Dashboards:
    def __init__(self, cfg, resume: bool, start_step: int):
        self.tb = self.wb = None
        out = cfg.out_dir
        if cfg.log_tensorboard:
            from tensorboardX import SummaryWriter
            d = os.path.join(out, TB_DIR)
            if not resume:
                for f in glob.glob(os.path.join(d, "events.out.tfevents.*")):
                    os.unlink(f)                 # a new run's dashboard: the old run's events go
            # a name of its own: tensorboardX names a file by the second and the host alone
            self.tb = SummaryWriter(d, purge_step=start_step + 1 if resume else None,
                                    filename_suffix=f".{secrets.token_hex(4)}")
        if cfg.wandb_log:
            import wandb
            path = os.path.join(out, WANDB_ID)
            run_id = None
            if resume and os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    run_id = f.read().strip() or None
            if run_id is None:
                run_id = secrets.token_hex(4)
                with atomic_open(path) as f:
                    f.write(run_id + "\n")
            name = cfg.wandb_run_name or os.path.basename(os.path.abspath(out))
            try:
                self.wb = wandb.init(project=cfg.wandb_project, name=name, id=run_id, resume="allow", dir=out,
                                     config=cfg.to_dict())
            except Exception as e:               # not logged in, no network: one line, before training
                self.close()
                raise RunError(f"wandb_log: {type(e).__name__}: {e} (WANDB_MODE=offline logs without a "
                               f"network; or set wandb_log: false)") from None

    def write(self, rec: dict):
        step, vals = int(rec["step"]), numbers(rec)
        if self.tb is not None:
            for k, v in vals.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(vals, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            self.wb.finish()
            self.wb = None
