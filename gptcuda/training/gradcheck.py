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

bf16: checked as tf32 is (finite differences on a second engine at precision fp32, the same weights,
batch and dropout masks; LOSS_AGREE; the direction u and the COORDS_BF16 largest entries), against the
BF16 error model (`bf16_error_model`, U = 2^-8: bf16 keeps 8 significant bits, and a rounding to
nearest errs by at most half an ulp, 2^-8 of the value at the bottom of a binade):
   - one rounding: relative error in [-U, U], mean 0 (to nearest, ties to even: no truncation bias,
     so nothing adds up coherently along a chain), rms U/sqrt(3) = 0.58 U at the bottom of a binade
     (0.42 U averaged over log-uniform mantissas; the bound is taken).
   - where it rounds: not only the products' operands. Every tensor the memory plan holds in the
     activation dtype is stored bf16 (gptcuda/model/memory.py: the residual stream res and mid, the
     layernorm outputs, qkv, the attention output, the MLP pre-activation and GELU output, the
     logits, the branch outputs before dropout, and the gradients dres, dln, dqkv, dfc, the logits'
     gradient in place), and each store rounds once, also where a kernel adds into one (the
     residual adds, dres += at each layernorm backward, dropout in place); the products and the
     embedding read a bf16 working copy of the weights (biases and layernorm weights stay fp32);
     flash attention rounds P and dS as the A operands of its second products (today to TF32 on
     fp32 copies of qkv, soon to bf16: counted as bf16) and its backward's D = rowsum(dO * O) reads
     the stored O. Statistics, softmax, loss, sums and the weight gradients (fp32 C) add nothing.
   - the chain (`bf16_chain`): the roundings in series on the longest direct path, that of the
     qkv weight of layer 0, d = 1 with dropout, else 0:
       forward   embedding: wte, wpe (working copies), res[0], its dropout in place    3 + d
                 layer 0's attention branch: ln1, attn.w, qkv, P, atty, proj.w          6
                 the residual stream: mid and res of each layer, each branch before
                 its dropout add                                                        2L + 2dL
                 head: lnf, wte, logits                                                 3
       backward  the logits' gradient, dlnf                                             2
                 dres at each layernorm backward down to layer 0's attention (lnf,
                 then ln2 and ln1 of each layer but layer 0's ln1), the branch
                 gradient written by layer 0's ln2 backward                             2L + d
                 layer 0's attention: datty, dS, dqkv                                   3
     17 + 4L + d (2 + 2L) roundings: 25 at L = 2 without dropout, 31 with, 37 at L = 3 with.
     Each adds a zero-mean relative error; they add in quadrature: random = sqrt(chain) U/sqrt(3),
     taken, as in tf32, without the further 1/sqrt(n) that averaging over n entries gives along u.
     The fp32 accumulators add K/8 2^-23 for each product on the path (bf16_chain_ks).
       beta     = 1 * sqrt(chain) U/sqrt(3) + accumulation      (the direction u)
       beta_one = 3 * sqrt(chain) U/sqrt(3) + accumulation      (one entry: 3 sigma)
     At L = 2 with dropout (the break test's model) beta = 1.26% and beta_one = 3.77%; L = 1
     without dropout 1.03% / 3.10%; L = 3 with dropout 1.37% / 4.12%.
   - validated by a float64 model that rounds to bf16 wherever the CUDA bf16 path stores or reads a
     bf16 value (tests/test_gradcheck_bf16.py): at the GPU test's seven bf16 shapes (L 1-3, C 96-192,
     T 19-62, B 1-5, dropout 0 and 0.1), with attention's P and dS rounded to bf16 or (today's
     kernels) to TF32, its gradient erred from the float64 one by at most 0.17% along u (0.15 beta),
     1.5% on the eight largest entries of a tensor (0.41 beta_one), and 0.91% in rms relative to
     the tensor's rms (0.73 of the model's 1 sigma, random).
   - the break: a layernorm backward without its x_hat term (--break=layernorm) errs, in that model
     at those shapes, by 0.003-12% along u, beyond beta for 97 of the 194 tensors upstream of the
     final layernorm: too little along u for half of them, so bf16 checks the COORDS_BF16 = 8 largest
     entries of each tensor (tf32: 2); the largest error among a tensor's eight is 0.7-91%, beyond
     beta_one for 178 of the 194 (among the 2 largest: 105). The whole check (with tau and rho)
     failed all 26 upstream tensors at the GPU break test's shape (L 2, C 96, T 23, B 3), and at the
     others from 13 of the 26 of wte, wpe, h0 and h1 (the weakest, L 2, C 192, T 52, B 5: the break
     is smaller with more tokens) to all of them; a correct gradient passed at every shape, its worst
     error at 0.15 of the tolerance along u and 0.33 on an entry.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from gptcuda import faults
from gptcuda.model import rng
from gptcuda.config import model_vocab, validate_against_data
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
    # bf16: likewise, against the BF16 error model
    "bf16": dict(h=1e-2, eps=1.2e-7),
}
ON_FP32 = ("tf32", "bf16")    # the modes whose finite differences are taken on a second, fp32 engine

U_TF32 = 2.0 ** -11           # TF32 unit roundoff (10 explicit mantissa bits)
EPS_ACC = 2.0 ** -23          # an fp32 accumulator's ulp, relative
TRUNC_BIAS = 1.44             # mean bias of a product of two truncated operands, in U
TRUNC_RMS = 2.0 / math.sqrt(12) * math.sqrt(2)   # rms of its random part, in U (0.82)
TF32_CHAIN = 8                # GEMMs in series on the longest direct path (the qkv weight)
COORDS = 2                    # largest entries of each tensor checked as directions of their own (tf32)
COORDS_BF16 = 8               # ... in bf16 (module docstring: its wider tolerance)
H_COORD = 3e-2                # their step
LOSS_AGREE = 1e-2             # |L_tf32 - L_fp32| <= LOSS_AGREE |L_fp32|: the two engines compute one function
U_BF16 = 2.0 ** -8            # bf16's unit roundoff: 8 significant bits, rounded to nearest
RN_RMS = 1.0 / math.sqrt(3)   # rms of one rounding to nearest, in U (the bottom of a binade: the bound)


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


def bf16_chain(cfg) -> dict:
    """The roundings to bf16 in series on the longest direct path (the qkv weight of layer 0), by
    where they happen, in the order of the module docstring (d: 1 with dropout, else 0)."""
    L, d = int(cfg.n_layer), int(cfg.dropout > 0)
    return {
        "embedding (wte, wpe, res[0], its dropout)": 3 + d,
        "layer 0 attention (ln1, attn.w, qkv, P, atty, proj.w)": 6,
        "residual stream (mid, res; branches before dropout)": 2 * L + 2 * d * L,
        "head (lnf, wte, logits)": 3,
        "loss gradient (dlogits, dlnf)": 2,
        "residual gradient (dres at each layernorm backward; the branch gradient)": 2 * L + d,
        "layer 0 attention backward (datty, dS, dqkv)": 3,
        "the gradient stored (grad_dtype bf16)": int(getattr(cfg, "grad_dtype", "fp32") == "bf16"),
    }


FORWARD_SITES = 4             # bf16_chain's first four entries: the forward's (to the logits)


def bf16_chain_ks(cfg, vocab_size: int | None = None) -> list:
    """The K of each product on bf16_chain's path: forward qkv, q k^T, P V, projection, LM head;
    backward head dX, projection dX, dP, dQ, dW."""
    C, T, hs = cfg.n_embd, cfg.block_size, cfg.head_size
    V = int(vocab_size or cfg.vocab_size or 0)
    return [C, hs, T, C, C, V, C, hs, T, cfg.batch_size * cfg.block_size]


def bf16_error_model(cfg, vocab_size: int | None = None) -> dict:
    """The expected relative error of a BF16 gradient against the exact one (module docstring): no
    bias (rounding to nearest); random (1 sigma, quadrature over the chain's roundings), accum (the
    fp32 accumulators); beta for the direction u, beta_one for a single entry (3 sigma). Also the
    forward's part alone (the logits): chain_fwd, random_fwd, beta_fwd (tests/gpu/test_golden.py)."""
    sites = bf16_chain(cfg)
    chain = sum(sites.values())
    chain_fwd = sum(list(sites.values())[:FORWARD_SITES])
    one = RN_RMS * U_BF16
    random = math.sqrt(chain) * one
    random_fwd = math.sqrt(chain_fwd) * one
    ks = bf16_chain_ks(cfg, vocab_size)
    accum = sum(k / 8 for k in ks) * EPS_ACC
    accum_fwd = sum(k / 8 for k in ks[:5]) * EPS_ACC
    return dict(chain=chain, sites=sites, bias=0.0, random=random, accum=accum,
                beta=random + accum, beta_one=3 * random + accum,
                chain_fwd=chain_fwd, random_fwd=random_fwd, beta_fwd=random_fwd + accum_fwd)


def coords_of(mode: str) -> int:
    """How many of each tensor's largest entries a mode checks (ON_FP32)."""
    return COORDS_BF16 if mode == "bf16" else COORDS


def error_model(cfg, mode: str, vocab_size: int | None = None) -> dict:
    """The error model of a mode checked on a second engine (ON_FP32)."""
    return (tf32_error_model if mode == "tf32" else bf16_error_model)(cfg, vocab_size)


def fd_config(cfg):
    """The config of the engine that takes the finite differences: None for the engine itself
    (reference, fp32); for tf32 and bf16 the same model at precision fp32 (fp32 gradients)."""
    if check_mode(cfg) in ON_FP32:
        return dataclasses.replace(cfg, precision="fp32", grad_dtype="fp32")
    return None


def _validate(cfg, vocab_size, broken, only):
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
    validate_against_data(cfg, len(data.train), len(data.val), data.vocab_size)
    V = model_vocab(cfg, data.vocab_size)       # as training resolves it (vocab_multiple; the loss masks the rest)
    mode = mode or check_mode(cfg)
    try:
        names = _validate(cfg, V, broken, only)
        if make_engine is None:
            def make_engine(c, programs):
                return Engine(c, data.train, data.val, V, programs=programs, n_vocab=data.vocab_size,
                              tune=False)       # tiny shapes, once
        x, y = get_batch(data.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
        eng = make_engine(cfg, ("fwdbwd", "forward_train"))
        eng.set_batch(x, y)
        eng.run("fwdbwd")
        loss0 = eng.state()["loss"]
        grads = {k: np.asarray(v, np.float64) for k, v in eng.grads().items()}
        base = {k: np.asarray(v, np.float64) for k, v in eng.params().items()}
        todo = list(only) or names
        if mode in ON_FP32:
            fcfg = fd_config(cfg) or cfg
            fd = make_engine(fcfg, ("forward_train",))
            fd.set_batch(x, y)
            return _check_on_fp32(mode, cfg, fcfg, eng, fd, loss0, grads, base, todo, broken, V, log)
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
    eng.set_param(name, np.asarray(value, np.float64))


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


def _model_note(mode, em) -> str:
    """The error model's terms, for the tolerance line."""
    if mode == "tf32":
        return (f"TF32 error model: {em['chain']} GEMMs, bias {em['bias']:.2e}, random {em['random']:.2e}, "
                f"accumulation {em['accum']:.2e}")
    return (f"BF16 error model: {em['chain']} roundings to nearest, random {em['random']:.2e}, "
            f"accumulation {em['accum']:.2e}")


def _check_on_fp32(mode, cfg, fcfg, eng, fd, loss0, grads, base, todo, broken, V, log) -> bool:
    """The tf32 / bf16 check: the gradient of eng against finite differences on fd (module docstring)."""
    s = SETTINGS[mode]
    em = error_model(cfg, mode, V)
    fd.set_params(base)
    fd.run("forward_train")
    loss32 = fd.state()["loss"]
    agree = abs(loss0 - loss32) <= LOSS_AGREE * abs(loss32)
    log(f"gradcheck: {cfg.backend} backend, {mode}, attention {cfg.attention}, dropout {cfg.dropout}, loss {loss0:.6f}; "
        f"finite differences on {_fd_name(fcfg)}, loss {loss32:.6f}"
        + ("" if agree else f" DISAGREES with the {mode.upper()} loss (> {LOSS_AGREE:g} relative)")
        + _broken_note(broken))
    log(f"  pass when |measured - ||g||| <= beta ||g|| + tau + rho: beta = {em['beta']:.2e} ({_model_note(mode, em)}), "
        f"tau = |m(h) - m(2h)|/3, rho = 4 eps |L|/h, h = {s['h']:g}; the {coords_of(mode)} largest entries of each "
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
        for i in np.argsort(-np.abs(flat), kind="stable")[:coords_of(mode)]:
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
