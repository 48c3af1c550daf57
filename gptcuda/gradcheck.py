"""Directional finite-difference check of every parameter gradient (gradcheck.py)."""
from __future__ import annotations

import dataclasses

import numpy as np

from . import faults, rng
from .cli import UsageError
from .data import TextDataset, get_batch
from .engine import Engine

# step h along the unit direction, relative tolerance, and the loss's rounding unit per backend/precision
SETTINGS = {
    "reference": dict(h=1e-4, tol=1e-6, eps=2.2e-16),
    "fp32": dict(h=1e-2, tol=1e-2, eps=1.2e-7),
    "tf32": dict(h=1e-1, tol=5e-2, eps=1e-3),
}


def settings_for(cfg) -> dict:
    return SETTINGS["reference" if cfg.backend == "reference" else cfg.precision]


def run_gradcheck(cfg, broken=(), only=(), log=print) -> bool:
    try:
        faults.set_broken(broken)
    except ValueError as e:
        raise UsageError(str(e)) from None
    data = TextDataset(cfg.data)
    cfg = dataclasses.replace(cfg, max_iters=0)
    eng = Engine(cfg, data.train, data.val, cfg.vocab_size or data.vocab_size, programs=("fwdbwd", "forward_train"))
    x, y = get_batch(data.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    eng.set_batch(x, y)
    s = settings_for(cfg)
    eng.run("fwdbwd")
    loss0 = eng.state()["loss"]
    grads = {k: np.asarray(v, np.float64) for k, v in eng.grads().items()}
    base = {k: np.asarray(v, np.float64) for k, v in eng.params().items()}
    log(f"gradcheck: {cfg.backend} backend, {cfg.precision}, attention {cfg.attention}, dropout {cfg.dropout}, "
        f"loss {loss0:.6f}; h = {s['h']:g}, pass when |measured - ||g||| <= {s['tol']:g} ||g|| + rounding"
        + (f"; BROKEN: {', '.join(broken)}" if broken else ""))
    log(f"{'tensor':<16} {'||g||':>12} {'measured':>12} {'rel err':>10}  verdict")
    ok = True
    for name in (only or list(base)):
        if name not in base:
            raise UsageError(f"--tensors: no parameter {name!r}")
        g = grads[name]
        n = float(np.linalg.norm(g))
        if n == 0.0:
            log(f"{name:<16} {0.0:12.5e} {'-':>12} {'-':>10}  FAIL (zero gradient)")
            ok = False
            continue
        u = g / n
        losses = []
        for sign in (1.0, -1.0):
            eng.set_params({**base, name: base[name] + sign * s["h"] * u})
            eng.run("forward_train")
            losses.append(eng.state()["loss"])
        measured = (losses[0] - losses[1]) / (2 * s["h"])
        noise = 4 * s["eps"] * abs(loss0) / s["h"]
        err = abs(measured - n)
        passed = err <= s["tol"] * n + noise
        ok &= passed
        log(f"{name:<16} {n:12.5e} {measured:12.5e} {err / n:10.2e}  {'pass' if passed else 'FAIL'}")
    eng.set_params(base)
    faults.set_broken(())
    log("gradcheck " + ("PASSED" if ok else "FAILED"))
    return ok
