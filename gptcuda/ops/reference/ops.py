"""Float64 numpy reference of every op: the ground truth for tests, and a CPU backend.

Pure functions: nothing is modified in place, every result is a fresh array. Float
inputs are converted to float64; integer index arrays (token ids, targets) stay integer.
Each op has a forward and a backward; `gpt_forward_backward` composes them into a whole
GPT-2 style model (used by tests as the end-to-end reference).
"""
import math

import numpy as np

from gptcuda.model import rng

__all__ = [
    "encoder_forward", "encoder_backward",
    "layernorm_forward", "layernorm_backward",
    "matmul_forward", "matmul_backward",
    "gelu_forward", "gelu_backward",
    "dropout_forward", "dropout_backward",
    "attention_forward", "attention_backward",
    "crossentropy_forward", "crossentropy_backward",
    "global_norm", "clip_scale", "adamw_update", "lr_at",
    "gpt_forward_backward",
]

GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _idx(x):
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"index array must be integer, got {x.dtype}")
    return x.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- encoder

def encoder_forward(idx, wte, wpe):
    """out[b, t] = wte[idx[b, t]] + wpe[t]; idx [B, T] int, wte [V, C], wpe [Tmax, C]."""
    idx = _idx(idx)
    wte = _f64(wte)
    wpe = _f64(wpe)
    T = idx.shape[-1]
    if T > wpe.shape[0]:
        raise ValueError(f"sequence length {T} exceeds wpe rows {wpe.shape[0]}")
    return wte[idx] + wpe[:T]


def encoder_backward(dout, idx, V, Tmax):
    """(dwte [V, C], dwpe [Tmax, C]); rows of dwpe at positions >= T are zero."""
    dout = _f64(dout)
    idx = _idx(idx)
    C = dout.shape[-1]
    T = idx.shape[-1]
    dwte = np.zeros((int(V), C))
    np.add.at(dwte, idx.reshape(-1), dout.reshape(-1, C))
    dwpe = np.zeros((int(Tmax), C))
    dwpe[:T] = dout.reshape(-1, T, C).sum(axis=0)
    return dwte, dwpe


# --------------------------------------------------------------------------- layernorm

def layernorm_forward(x, w, b, eps=1e-5):
    """(out, mean, rstd) over the last dim; biased variance (like PyTorch); b may be None."""
    x = _f64(x)
    w = _f64(w)
    mean = x.mean(axis=-1)
    xc = x - mean[..., None]
    var = (xc * xc).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    out = xc * rstd[..., None] * w
    if b is not None:
        out = out + _f64(b)
    return out, mean, rstd


def layernorm_backward(dout, x, mean, rstd, w, drop_xhat_term=False):
    """(dx, dw, db); dw and db are summed over all leading dims.

    drop_xhat_term=True deletes the x_hat * mean(dx_hat * x_hat) term: a deliberately wrong
    backward that gradcheck.py --break=layernorm must catch."""
    dout = _f64(dout)
    x = _f64(x)
    mean = _f64(mean)
    rstd = _f64(rstd)
    w = _f64(w)
    C = x.shape[-1]
    norm = (x - mean[..., None]) * rstd[..., None]
    lead = tuple(range(x.ndim - 1))
    db = dout.sum(axis=lead) if lead else dout.copy()
    dw = (dout * norm).sum(axis=lead) if lead else dout * norm
    dnorm = dout * w
    xhat_term = 0.0 if drop_xhat_term else norm * (dnorm * norm).mean(axis=-1, keepdims=True)
    dx = rstd[..., None] * (dnorm - dnorm.mean(axis=-1, keepdims=True) - xhat_term)
    assert dw.shape == (C,) and db.shape == (C,)
    return dx, dw, db


# --------------------------------------------------------------------------- matmul

def _op(x, trans):
    return np.swapaxes(x, -1, -2) if trans else x


def _reduce_to(g, shape):
    """Sum a broadcast gradient g back down to `shape` (undoing numpy broadcasting)."""
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (gs, s) in enumerate(zip(g.shape, shape)) if s == 1 and gs != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def matmul_forward(a, b, trans_a=False, trans_b=False, bias=None):
    """out = op(a) @ op(b) (+ bias over the last dim); op transposes the last two dims."""
    a = _f64(a)
    b = _f64(b)
    out = np.matmul(_op(a, trans_a), _op(b, trans_b))
    if bias is not None:
        out = out + _f64(bias)
    return out


def matmul_backward(dout, a, b, trans_a=False, trans_b=False, has_bias=False):
    """(da, db, dbias or None); da and db have the stored shapes of a and b."""
    dout = _f64(dout)
    a = _f64(a)
    b = _f64(b)
    A = _op(a, trans_a)
    Bm = _op(b, trans_b)
    dA = np.matmul(dout, np.swapaxes(Bm, -1, -2))   # d op(a)
    dB = np.matmul(np.swapaxes(A, -1, -2), dout)    # d op(b)
    da = _reduce_to(_op(dA, trans_a), a.shape)
    db = _reduce_to(_op(dB, trans_b), b.shape)
    dbias = dout.reshape(-1, dout.shape[-1]).sum(axis=0) if has_bias else None
    return da, db, dbias


# --------------------------------------------------------------------------- gelu

def gelu_forward(x):
    """Tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + GELU_CUBE * x ** 3)))


def gelu_backward(dout, x):
    dout = _f64(dout)
    x = _f64(x)
    u = GELU_SCALE * (x + GELU_CUBE * x ** 3)
    th = np.tanh(u)
    du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x)
    grad = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du
    return dout * grad


# --------------------------------------------------------------------------- dropout

def _dropout_apply(x, keep, p):
    x = _f64(x)
    if p == 0:
        return x.copy()
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != x.shape:
        raise ValueError(f"keep mask shape {keep.shape} != {x.shape}")
    return np.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def dropout_forward(x, keep, p):
    """out = x * keep / (1 - p); p == 0 is the identity (keep may be None)."""
    return _dropout_apply(x, keep, p)


def dropout_backward(dout, keep, p):
    """dx = dout * keep / (1 - p)."""
    return _dropout_apply(dout, keep, p)


# --------------------------------------------------------------------------- attention

def _split_heads(qkv, n_head):
    qkv = _f64(qkv)
    B, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv width {C3} does not split into 3 x {n_head} heads")
    C = C3 // 3
    hs = C // n_head

    def heads(x):  # [B, T, C] -> [B, H, T, hs]
        return x.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)

    return heads(qkv[..., :C]), heads(qkv[..., C:2 * C]), heads(qkv[..., 2 * C:]), hs


def _merge_heads(x):  # [B, H, T, hs] -> [B, T, H*hs]
    B, H, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hs)


def attention_forward(qkv, n_head, keep=None, p=0.0):
    """(y [B, T, C], probs [B, H, T, T]); probs are the causal softmax before dropout (keep: the mask of
    rng.attention_keep, the kept scaled by 1 / (1 - rng.attention_rate(p)))."""
    p = rng.attention_rate(p)
    q, k, v, hs = _split_heads(qkv, n_head)
    T = q.shape[2]
    scale = 1.0 / math.sqrt(hs)
    att = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    causal = np.tril(np.ones((T, T), dtype=bool))
    att = np.where(causal, att, -np.inf)
    att = att - att.max(axis=-1, keepdims=True)
    e = np.exp(att)
    probs = e / e.sum(axis=-1, keepdims=True)
    pd = dropout_forward(probs, keep, p)
    y = _merge_heads(np.matmul(pd, v))
    return y, probs


def attention_backward(dy, qkv, probs, n_head, keep=None, p=0.0):
    """dqkv [B, T, 3C] laid out like qkv (keep and p as attention_forward's)."""
    p = rng.attention_rate(p)
    q, k, v, hs = _split_heads(qkv, n_head)
    B, H, T, _ = q.shape
    probs = _f64(probs)
    dy = _f64(dy)
    scale = 1.0 / math.sqrt(hs)
    dyh = dy.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    pd = dropout_forward(probs, keep, p)
    dv = np.matmul(np.swapaxes(pd, -1, -2), dyh)
    dpd = np.matmul(dyh, np.swapaxes(v, -1, -2))
    dprobs = dropout_backward(dpd, keep, p)
    datt = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    datt = datt * scale  # masked entries are already zero since probs is zero there
    dq = np.matmul(datt, k)
    dk = np.matmul(np.swapaxes(datt, -1, -2), q)
    return np.concatenate([_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)


# --------------------------------------------------------------------------- cross-entropy

def crossentropy_forward(logits, targets):
    """(losses [N], probs [N, V]); leading dims of logits/targets are flattened."""
    logits = _f64(logits)
    V = logits.shape[-1]
    logits = logits.reshape(-1, V)
    targets = _idx(targets).reshape(-1)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {logits.shape[0]} rows")
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=-1, keepdims=True)
    probs = e / s
    rows = np.arange(logits.shape[0])
    losses = np.log(s[:, 0]) - z[rows, targets]
    return losses, probs


def crossentropy_backward(probs, targets, grad_scale):
    """dlogits = (probs - onehot(targets)) * grad_scale (scalar, or one per row)."""
    probs = _f64(probs)
    V = probs.shape[-1]
    probs = probs.reshape(-1, V)
    targets = _idx(targets).reshape(-1)
    d = probs.copy()
    d[np.arange(d.shape[0]), targets] -= 1.0
    gs = _f64(grad_scale)
    if gs.ndim > 0:
        gs = gs.reshape(-1, 1)
    return d * gs


# --------------------------------------------------------------------------- optimizer

def global_norm(arrays) -> float:
    """sqrt of the sum of squares of every element of every array."""
    total = 0.0
    for a in arrays:
        a = _f64(a)
        total += float(np.sum(a * a))
    return math.sqrt(total)


def clip_scale(norm, grad_clip) -> float:
    """torch.nn.utils.clip_grad_norm_: min(1, clip / (norm + 1e-6)); clip <= 0 disables."""
    if grad_clip is None or grad_clip <= 0:
        return 1.0
    return float(min(1.0, grad_clip / (float(norm) + 1e-6)))


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, t, decay):
    """One PyTorch AdamW step (t is 1-based). Returns (p_new, m_new, v_new)."""
    p = _f64(p)
    g = _f64(g)
    m = _f64(m)
    v = _f64(v)
    if t < 1:
        raise ValueError(f"AdamW step t is 1-based, got {t}")
    decay = np.asarray(decay, dtype=bool)
    p_dec = np.where(decay, p * (1.0 - lr * weight_decay), p)
    m_new = beta1 * m + (1.0 - beta1) * g
    v_new = beta2 * v + (1.0 - beta2) * g * g
    mhat = m_new / (1.0 - beta1 ** t)
    vhat = v_new / (1.0 - beta2 ** t)
    p_new = p_dec - lr * mhat / (np.sqrt(vhat) + eps)
    return np.broadcast_to(p_new, p.shape).copy(), m_new, v_new


def draw_token(logits, n_vocab, inv_temp, top_k, top_p, seed, draw, seq) -> int:
    """The token kernels/decode.cu decode_sample draws from one row of logits (same rules, same
    random word; the integer weights come from float64 exp here, so a draw on a boundary may differ).
    inv_temp 0: argmax (the lowest index among equals)."""
    row = np.asarray(logits, np.float64)[:n_vocab]
    if inv_temp == 0:
        return int(np.argmax(row))
    w = np.floor(np.exp((row - row.max()) * inv_temp) * 2.0 ** 32).astype(np.uint64)
    keep = np.ones(n_vocab, bool)
    if 0 < top_k < n_vocab:
        keep = row >= np.sort(row)[-top_k]                       # the k-th largest, ties kept
    if top_p < 1:
        tot = int(w[keep].sum())
        need = min(max(math.ceil(tot * float(top_p)), 1), tot)
        order = np.argsort(-row[keep], kind="stable")
        vals, cum = row[keep][order], np.cumsum(w[keep][order])
        keep &= row >= vals[int(np.searchsorted(cum, need))]    # the fewest most likely reaching need
    cum = np.cumsum(np.where(keep, w, 0).astype(np.uint64))
    k = rng.key(seed, draw, rng.SITE_SAMPLE)
    hi, lo = (int(v) for v in rng.uniform_u32(k, np.array([2 * seq, 2 * seq + 1], np.uint64)))
    target = (((hi << 32) | lo) * int(cum[-1])) >> 64              # in [0, total)
    return int(np.searchsorted(cum, target, side="right"))


def lr_at(step, learning_rate, min_lr, warmup_iters, lr_decay_iters) -> float:
    """nanoGPT's warmup + cosine schedule at 0-based iteration `step`."""
    it = step
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return float(min_lr)
    span = lr_decay_iters - warmup_iters
    if span <= 0:  # degenerate schedule (warmup == decay end): the decay is already over
        return float(min_lr)
    ratio = (it - warmup_iters) / span
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return float(min_lr + coeff * (learning_rate - min_lr))


# --------------------------------------------------------------------------- whole model

def gpt_forward_backward(params, idx, targets, cfg, seed=0, step=0, with_grad=True):
    """Loss (mean cross-entropy over B*T tokens) and grads of a float64 GPT-2 model.

    Built only from the ops above; see the module docstring of the project for the
    parameter layout. Returns (loss, grads) with grads keyed like params (None when
    with_grad is False).
    """
    idx = _idx(idx)
    targets = _idx(targets)
    P = {k: _f64(v) for k, v in params.items()}
    L, H, p = int(cfg.n_layer), int(cfg.n_head), float(cfg.dropout)
    bias = bool(cfg.bias)
    B, T = idx.shape
    V, C = P["wte"].shape
    Tmax = P["wpe"].shape[0]

    def get(name):
        return P[name] if bias else None

    def mask(site, shape, rows=False):
        return rng.dropout_keep(seed, step, site, shape, p, rows) if p > 0 else None

    # ---- forward
    cache = []
    x0 = encoder_forward(idx, P["wte"], P["wpe"])
    keep_emb = mask(rng.DROPOUT_EMB, (B, T, C))
    x = dropout_forward(x0, keep_emb, p)
    for l in range(L):
        h = f"h{l}."
        c = {"x_in": x}
        ln1, c["ln1_mean"], c["ln1_rstd"] = layernorm_forward(x, P[h + "ln1.w"], get(h + "ln1.b"))
        qkv = matmul_forward(ln1, P[h + "attn.w"], trans_b=True, bias=get(h + "attn.b"))
        c["keep_att"] = mask(rng.dropout_site(l, 0), (B, H, T, T), rows=True)
        att, c["probs"] = attention_forward(qkv, H, c["keep_att"], p)
        proj = matmul_forward(att, P[h + "proj.w"], trans_b=True, bias=get(h + "proj.b"))
        c["keep_r1"] = mask(rng.dropout_site(l, 1), (B, T, C))
        x = x + dropout_forward(proj, c["keep_r1"], p)
        c["x_mid"] = x
        ln2, c["ln2_mean"], c["ln2_rstd"] = layernorm_forward(x, P[h + "ln2.w"], get(h + "ln2.b"))
        pre = matmul_forward(ln2, P[h + "fc.w"], trans_b=True, bias=get(h + "fc.b"))
        act = gelu_forward(pre)
        fco = matmul_forward(act, P[h + "fcproj.w"], trans_b=True, bias=get(h + "fcproj.b"))
        c["keep_r2"] = mask(rng.dropout_site(l, 2), (B, T, C))
        x = x + dropout_forward(fco, c["keep_r2"], p)
        c.update(ln1=ln1, qkv=qkv, att=att, ln2=ln2, pre=pre, act=act)
        cache.append(c)
    lnf, lnf_mean, lnf_rstd = layernorm_forward(x, P["lnf.w"], get("lnf.b"))
    logits = matmul_forward(lnf, P["wte"], trans_b=True)
    losses, probs = crossentropy_forward(logits, targets)
    loss = float(losses.mean())
    if not with_grad:
        return loss, None

    # ---- backward
    G = {}

    def take(name, dinput, dw, db):
        """Store a layer's weight grad (and bias grad, when the model has biases); return dinput."""
        G[name + ".w"] = dw
        if bias:
            G[name + ".b"] = db
        return dinput

    dlogits = crossentropy_backward(probs, targets, 1.0 / (B * T)).reshape(B, T, V)
    dlnf, dwte_head, _ = matmul_backward(dlogits, lnf, P["wte"], trans_b=True)
    dx = take("lnf", *layernorm_backward(dlnf, x, lnf_mean, lnf_rstd, P["lnf.w"]))
    for l in reversed(range(L)):
        h = f"h{l}."
        c = cache[l]
        # MLP: x = x_mid + drop(fcproj(gelu(fc(ln2(x_mid)))))
        dfco = dropout_backward(dx, c["keep_r2"], p)
        dact = take(h + "fcproj", *matmul_backward(dfco, c["act"], P[h + "fcproj.w"],
                                                   trans_b=True, has_bias=bias))
        dpre = gelu_backward(dact, c["pre"])
        dln2 = take(h + "fc", *matmul_backward(dpre, c["ln2"], P[h + "fc.w"],
                                               trans_b=True, has_bias=bias))
        dx = dx + take(h + "ln2", *layernorm_backward(dln2, c["x_mid"], c["ln2_mean"],
                                                      c["ln2_rstd"], P[h + "ln2.w"]))
        # attention: x_mid = x_in + drop(proj(attn(ln1(x_in))))
        dproj = dropout_backward(dx, c["keep_r1"], p)
        datt = take(h + "proj", *matmul_backward(dproj, c["att"], P[h + "proj.w"],
                                                 trans_b=True, has_bias=bias))
        dqkv = attention_backward(datt, c["qkv"], c["probs"], H, c["keep_att"], p)
        dln1 = take(h + "attn", *matmul_backward(dqkv, c["ln1"], P[h + "attn.w"],
                                                 trans_b=True, has_bias=bias))
        dx = dx + take(h + "ln1", *layernorm_backward(dln1, c["x_in"], c["ln1_mean"],
                                                      c["ln1_rstd"], P[h + "ln1.w"]))
    dx0 = dropout_backward(dx, keep_emb, p)
    dwte_enc, G["wpe"] = encoder_backward(dx0, idx, V, Tmax)
    G["wte"] = dwte_head + dwte_enc
    missing = set(P) ^ set(G)
    if missing:
        raise KeyError(f"params and grads disagree on keys: {sorted(missing)}")
    return loss, G
