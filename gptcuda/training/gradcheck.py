"""Directional finite-difference check of every parameter gradient (gradcheck.py).

For each tensor W with gradient g (one forward + backward on a fixed batch, dropout masks fixed
by the step), the central difference m(h) = (L(W + h u) - L(W - h u)) / 2h along u = g/||g||
must equal ||g|| = g . u.

reference, fp32: the finite differences are taken on the same engine; pass when
    |m(h) - ||g||| <= tol ||g|| + 4 eps |L| / h       (SETTINGS: h, tol and eps per mode)

tf32: the finite differences of a TF32 forward are noise (its operands keep 10 mantissa bits,
and moving W by h u changes their rounding: a correct gradient measured 12% off on a 3-layer
model), so they are taken on a second engine, precision fp32 (fp32_gemm as configured, 3xtf32
by default: near-fp32 products on the same tensor cores), holding the same weights, batch and
dropout masks (a pure function of seed, step and site: gptcuda/model/rng.py); its loss at W must agree
with the TF32 one (LOSS_AGREE). The TF32 backward's g is then checked against it:
    |m(h) - ||g||| <= beta ||g|| + tau + rho
with, for the three ways the two sides can differ from the exact directional derivative:

1. the TF32 gradient's own error, beta (`tf32_error_model`, U = 2^-11 the TF32 unit roundoff):
   - one GEMM: every operand is rounded to TF32 (the wgmma kernels truncate, the mma.sync and
     flash-attention kernels round to nearest). Truncation leaves a relative error in (-2U, 0]
     per operand, mean -0.72 U for log-uniform mantissas, so a product a b carries a mean bias
     -1.44 U and a random part of rms 2U/sqrt(12) * sqrt(2) = 0.82 U. Summed over K terms of
     random sign, the random error grows as sqrt(K) and so does the output: 0.82 U relative,
     independent of K; the bias is coherent and does not average away: 1.44 U per GEMM. The fp32
     accumulator loses at most an ulp (2^-23) per k8 step: K/8 * 2^-23 relative.
   - a chain: the bias scales the gradient along itself, so it adds up linearly over the GEMMs in
     series between the loss and the tensor, and a projection onto u = g/||g|| keeps all of it.
     The longest direct path (the residual stream passes upper layers without a GEMM) is that of
     the qkv weight: TF32_CHAIN = 8 GEMMs (forward qkv and q k^T; LM head; backward: head dX,
     attention-projection dX, dP = dY V^T, dQ = dS K, and the weight gradient dW = dY^T X).
     The random parts add in quadrature: sqrt(8) * 0.82 U, taken without the further 1/sqrt(n)
     that averaging over n entries gives along u. The accumulation terms are summed with the K
     of each GEMM of that chain (C, V, C, hs, T, hs, C and B*T).
       beta     = 8 * 1.44 U + 1 * sqrt(8) * 0.82 U + sum_i K_i / 8 * 2^-23   (the direction u)
       beta_one = 8 * 1.44 U + 3 * sqrt(8) * 0.82 U + sum_i K_i / 8 * 2^-23   (one entry: 3 sigma)
     About 0.68% and 0.91% at the test shapes (K terms ~1e-5); a float64 model whose every
     product truncates its operands to TF32 measured at most 0.33% along u and 0.49% on single
     entries (3 layers, C 60). A layernorm backward without its x_hat term (--break=layernorm)
     errs by 1-10% along u upstream of the final layernorm and by 2-16% on single entries.
2. finite-difference truncation, m(h) - L'_u = h^2 L'''_u / 6 + O(h^4): measured, not guessed,
   from a second step 2h: tau = |m(h) - m(2h)| / 3.
3. the fp32 forward's rounding of the loss difference: rho = 4 eps |L| / h, eps = 1.2e-7 (the
   fp32 mode's own noise term).

The direction u alone sees only the part of an error that lies along g (a wrong layernorm
backward errs by 10-35% of ||g|| in norm but often by under 1% along g), so in tf32 mode the
COORDS largest entries of each tensor are checked too, as directions of their own (step H_COORD,
tolerance beta_one |g_i| + tau + rho). A tensor passes when its direction and its entries pass.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from gptcuda import faults
from gptcuda.model import rng
from gptcuda.errors import UsageError
from gptcuda.data.text import TextDataset, get_batch
from gptcuda.training.engine import Engine
from gptcuda.model.params import param_table

# step h along the unit direction, relative tolerance, and the loss's rounding unit per backend/precision
SETTINGS = {
    "reference": dict(h=1e-4, tol=1e-6, eps=2.2e-16),
    "fp32": dict(h=1e-2, tol=1e-2, eps=1.2e-7),
    # tf32: the gradient of the TF32 engine, finite differences on an fp32 engine (module docstring)
    "tf32": dict(h=1e-2, eps=1.2e-7),
}

U_TF32 = 2.0 ** -11           # TF32 unit roundoff (10 explicit mantissa bits)
EPS_ACC = 2.0 ** -23          # an fp32 accumulator's ulp, relative
TRUNC_BIAS = 1.44             # mean bias of a product of two truncated operands, in U
TRUNC_RMS = 2.0 / math.sqrt(12) * math.sqrt(2)   # rms of its random part, in U (0.82)
TF32_CHAIN = 8                # GEMMs in series on the longest direct path (the qkv weight)
COORDS = 2                    # largest entries of each tensor checked as directions of their own (tf32)
H_COORD = 3e-2                # their step
LOSS_AGREE = 1e-2             # |L_tf32 - L_fp32| <= LOSS_AGREE |L_fp32|: the two engines compute one function


def check_mode(cfg) -> str:
    return "reference" if cfg.backend == "reference" else cfg.precision


def settings_for(cfg) -> dict:
    return SETTINGS[check_mode(cfg)]


def chain_ks(cfg, vocab_size: int | None = None) -> list:
    """The K (summed dimension) of each GEMM of the TF32_CHAIN-long path, in the order of the
    module docstring: forward qkv, q k^T, LM head; head dX, projection dX, dP, dQ; dW."""
    C, T, hs = cfg.n_embd, cfg.block_size, cfg.head_size
    V = int(vocab_size or cfg.vocab_size or 0)
    return [C, hs, C, V, C, hs, T, cfg.batch_size * cfg.block_size]


def tf32_error_model(cfg, vocab_size: int | None = None) -> dict:
    """The expected relative error of a TF32 gradient against the exact one (module docstring):
    bias (coherent, per chain), random (1 sigma, quadrature over the chain), accum (the fp32
    accumulators); beta for the direction u, beta_one for a single entry (3 sigma)."""
    ks = chain_ks(cfg, vocab_size)
    assert len(ks) == TF32_CHAIN
    bias = TF32_CHAIN * TRUNC_BIAS * U_TF32
    random = math.sqrt(TF32_CHAIN) * TRUNC_RMS * U_TF32
    accum = sum(k / 8 for k in ks) * EPS_ACC
    return dict(chain=TF32_CHAIN, bias=bias, random=random, accum=accum,
                beta=bias + random + accum, beta_one=bias + 3 * random + accum)


def fd_config(cfg):
    """The config of the engine that takes the finite differences: None for the engine itself
    (reference, fp32); for tf32 the same model at precision fp32."""
    if check_mode(cfg) == "tf32":
        return dataclasses.replace(cfg, precision="fp32")
    return None


def _validate(cfg, vocab_size, broken, only):
    if check_mode(cfg) not in SETTINGS:
        raise UsageError(f"gradcheck: no error model for precision {cfg.precision} yet (it checks "
                         f"{' | '.join(k for k in SETTINGS if k != 'reference')}, or --backend=reference)")
    try:
        faults.set_broken(broken)
    except ValueError as e:
        raise UsageError(str(e)) from None
    names = list(param_table(cfg, vocab_size).shapes())
    for name in only:
        if name not in names:
            raise UsageError(f"--tensors: no parameter {name!r} (this model's {len(names)}: "
                             f"{', '.join(names[:6])}, ..., {names[-1]})")
    return names


def run_gradcheck(cfg, broken=(), only=(), log=print, mode=None, make_engine=None) -> bool:
    """Check every parameter's gradient (only: these tensors); True when all pass. mode: the
    checks of SETTINGS (default: check_mode(cfg)); make_engine(cfg, programs) -> Engine (default:
    an Engine on cfg.data; the tests pass their own, e.g. a TF32-emulating reference backend)."""
    data = TextDataset(cfg.data)
    cfg = dataclasses.replace(cfg, max_iters=0)
    V = cfg.vocab_size or data.vocab_size
    mode = mode or check_mode(cfg)
    try:
        names = _validate(cfg, V, broken, only)
        if make_engine is None:
            def make_engine(c, programs):
                return Engine(c, data.train, data.val, V, programs=programs, tune=False)   # tiny shapes, once
        x, y = get_batch(data.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
        eng = make_engine(cfg, ("fwdbwd", "forward_train"))
        eng.set_batch(x, y)
        eng.run("fwdbwd")
        loss0 = eng.state()["loss"]
        grads = {k: np.asarray(v, np.float64) for k, v in eng.grads().items()}
        base = {k: np.asarray(v, np.float64) for k, v in eng.params().items()}
        todo = list(only) or names
        if mode == "tf32":
            fcfg = fd_config(cfg) or cfg
            fd = make_engine(fcfg, ("forward_train",))
            fd.set_batch(x, y)
            return _check_tf32(cfg, fcfg, eng, fd, loss0, grads, base, todo, broken, V, log)
        return _check_plain(cfg, eng, loss0, grads, base, todo, broken, SETTINGS[mode], log)
    finally:
        faults.set_broken(())


def _broken_note(broken):
    return f"; BROKEN: {', '.join(broken)}" if broken else ""


def _check_plain(cfg, eng, loss0, grads, base, todo, broken, s, log) -> bool:
    log(f"gradcheck: {cfg.backend} backend, {cfg.precision}, attention {cfg.attention}, dropout {cfg.dropout}, "
        f"loss {loss0:.6f}; h = {s['h']:g}, pass when |measured - ||g||| <= {s['tol']:g} ||g|| + rounding"
        + _broken_note(broken))
    log(f"{'tensor':<16} {'||g||':>12} {'measured':>12} {'rel err':>10}  verdict")
    ok = True
    for name in todo:
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
    log("gradcheck " + ("PASSED" if ok else "FAILED"))
    return ok


def directional(fd, base, name, direction, h) -> float:
    """(L(W + h d) - L(W - h d)) / 2h on the engine fd, tensor `name` moved along `direction`."""
    losses = []
    for sign in (1.0, -1.0):
        put(fd, name, base[name] + sign * h * direction)
        fd.run("forward_train")
        losses.append(fd.state()["loss"])
    put(fd, name, base[name])
    return (losses[0] - losses[1]) / (2 * h)


def put(eng, name, value):
    """Write one parameter tensor (the others stay as they are)."""
    eng.be.upload(eng.bufs.params[name], np.asarray(value, np.float64))


def judge(fd, base, name, direction, expected, h, beta, eps, loss) -> dict:
    """One directional check: m(h) against `expected` (g . direction) with the tolerance
    beta |expected| + tau + rho of the module docstring."""
    m1 = directional(fd, base, name, direction, h)
    m2 = directional(fd, base, name, direction, 2 * h)
    tau = abs(m1 - m2) / 3
    rho = 4 * eps * abs(loss) / h
    tol = beta * abs(expected) + tau + rho
    err = abs(m1 - expected)
    return dict(measured=m1, err=err, tol=tol, tau=tau, rho=rho, passed=bool(err <= tol))


def _fd_name(fcfg) -> str:
    if fcfg.backend == "reference":
        return "a second reference (float64) forward"
    return f"the fp32 forward (fp32_gemm {fcfg.fp32_gemm})"


def _check_tf32(cfg, fcfg, eng, fd, loss0, grads, base, todo, broken, V, log) -> bool:
    s = SETTINGS["tf32"]
    em = tf32_error_model(cfg, V)
    fd.set_params(base)
    fd.run("forward_train")
    loss32 = fd.state()["loss"]
    agree = abs(loss0 - loss32) <= LOSS_AGREE * abs(loss32)
    log(f"gradcheck: {cfg.backend} backend, tf32, attention {cfg.attention}, dropout {cfg.dropout}, loss {loss0:.6f}; "
        f"finite differences on {_fd_name(fcfg)}, loss {loss32:.6f}"
        + ("" if agree else f" DISAGREES with the TF32 loss (> {LOSS_AGREE:g} relative)") + _broken_note(broken))
    log(f"  pass when |measured - ||g||| <= beta ||g|| + tau + rho: beta = {em['beta']:.2e} (TF32 error model: "
        f"{em['chain']} GEMMs, bias {em['bias']:.2e}, random {em['random']:.2e}, accumulation {em['accum']:.2e}), "
        f"tau = |m(h) - m(2h)|/3, rho = 4 eps |L|/h, h = {s['h']:g}; the {COORDS} largest entries of each "
        f"tensor likewise (h = {H_COORD:g}, beta = {em['beta_one']:.2e})")
    log(f"{'tensor':<16} {'||g||':>12} {'measured':>12} {'rel err':>10} {'rel tol':>10} {'entries':>8}  verdict")
    ok = agree
    for name in todo:
        g = grads[name]
        n = float(np.linalg.norm(g))
        if n == 0.0:
            log(f"{name:<16} {0.0:12.5e} {'-':>12} {'-':>10} {'-':>10} {'-':>8}  FAIL (zero gradient)")
            ok = False
            continue
        r = judge(fd, base, name, g / n, n, s["h"], em["beta"], s["eps"], loss32)
        worst = 0.0                     # the largest err / tol over the checked entries
        entries_ok = True
        flat = g.reshape(-1)
        for i in np.argsort(-np.abs(flat), kind="stable")[:COORDS]:
            if flat[i] == 0.0:
                continue
            e = np.zeros_like(flat)
            e[i] = 1.0
            c = judge(fd, base, name, e.reshape(g.shape), float(flat[i]), H_COORD, em["beta_one"], s["eps"], loss32)
            worst = max(worst, c["err"] / c["tol"])
            entries_ok &= c["passed"]
        passed = r["passed"] and entries_ok
        ok &= passed
        log(f"{name:<16} {n:12.5e} {r['measured']:12.5e} {r['err'] / n:10.2e} {r['tol'] / n:10.2e} "
            f"{worst:7.2f}x  {'pass' if passed else 'FAIL'}")
    fd.set_params(base)
    eng.set_params(base)
    log("gradcheck " + ("PASSED" if ok else "FAILED"))
    return ok
