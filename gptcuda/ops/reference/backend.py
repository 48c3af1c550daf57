"""The `reference` backend: the op interface of backend.py in float64 numpy.

Each op records a closure that calls the functions of reference/ops.py on the plan's
arrays; running the program calls them in order. Dropout masks and batches come from the
same counter-based RNG as the GPU's, so both backends take the same random choices.
Runs anywhere (CI has no GPU); slow, so meant for tiny configs and for checking the GPU.
"""
from __future__ import annotations

import numpy as np

from gptcuda import faults
from gptcuda.model import rng, state
from gptcuda.ops.backend import Buffers, Program, check_matmul, rows
from gptcuda.model.memory import ITEMSIZE, unpack_gen_opts
from gptcuda.model.params import unflatten
from gptcuda.ops.reference import ops as R
from gptcuda.runtime import execution


def attention_saved(cfg, ex=None) -> dict:
    B, T, H = cfg.batch_size, cfg.block_size, cfg.n_head
    return {"probs": ((B, H, T, T), "f32")}


def _2d(x):
    return x.reshape(rows(x.shape), x.shape[-1])


def matmul_epilogue(o, r, epilogue, aux, stored=np.asarray):
    """o (2-d) from the product r (bias included) by the op interface's matmul epilogue (backend.Ops.matmul);
    aux 2-d or None. stored: the values a tensor holds once r is stored in it (GELU's output is made from
    the pre-activation as stored; float64: r itself)."""
    if epilogue == "gelu":
        pre = stored(r)
        aux[...] = pre
        o[...] = R.gelu_forward(pre)
    elif epilogue == "residual":
        o[...] = aux + r
    elif epilogue in ("dgelu", "dgelu_gelu"):
        o[...] = R.gelu_backward(r, aux)
        if epilogue == "dgelu_gelu":
            aux[...] = stored(R.gelu_forward(aux))
    else:
        o[...] = r


class ReferenceBackend:
    name = "reference"

    attention_saved = staticmethod(attention_saved)

    @staticmethod
    def workspaces(cfg, ex=None) -> dict:
        return {}

    @staticmethod
    def device_workspaces(ws: dict) -> dict:
        return ws

    def __init__(self, cfg, seed: int | None = None):
        self.cfg = cfg
        self.exec = execution.resolve(cfg)          # the reference plan: float64 numpy ops
        self.seed = cfg.seed if seed is None else int(seed)      # the dropout stream's
        self.state = state.initial()          # the StepState's fields (gptcuda/model/state.py)
        self._prog: Program | None = None

    # ---- memory ---------------------------------------------------------------------
    def free_bytes(self) -> int:
        return 1 << 62

    def allocate(self, plan, table) -> Buffers:
        regions = {n: np.zeros(table.total, dtype=np.float64) for n in plan.regions}
        return Buffers.of(regions, lambda flat: unflatten(table, flat), self.allocate_arena(plan))

    def allocate_arena(self, plan) -> dict:
        """An array an entry; one inside another (Entry.within) a view of its elements there, as on
        the device, so that a plan sharing bytes between values live at once shows here too."""
        acts = {}
        for e in plan.entries:
            if e.within:
                host = plan[e.within]
                at = (e.offset - host.offset) // ITEMSIZE[e.dtype]
                acts[e.name] = acts[e.within].reshape(-1)[at:at + e.numel].reshape(e.shape)
            else:
                acts[e.name] = (np.full(e.shape, np.nan, dtype=np.float64) if e.dtype == "f32"
                                else np.zeros(e.shape, dtype=np.int64))
        return acts

    def upload(self, view, arr):
        view[...] = np.asarray(arr).reshape(view.shape)

    def download(self, view) -> np.ndarray:
        return np.array(view)

    def read_state(self) -> dict:
        return dict(self.state)

    def write_state(self, **fields):
        for k, v in fields.items():
            if k not in self.state:
                raise KeyError(k)
            self.state[k] = v

    # ---- programs -------------------------------------------------------------------
    def begin(self, name) -> Program:
        self._prog = Program(name)
        return self._prog

    def end(self) -> Program:
        prog, self._prog = self._prog, None
        return prog

    def run(self, prog: Program):
        # a diverging run overflows float64 on its way to inf / nan: the trainer reports that in one
        # line (NonFiniteLoss), as the CUDA backend's run does, not numpy's warning at each op
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for fn in prog.items:
                fn()

    def capture(self, prog):
        return None

    def synchronize(self):
        pass

    def _rec(self, fn):
        if self._prog is None:
            fn()
        else:
            self._prog.items.append(fn)

    def _keep(self, site, shape, p, rows=False):
        return rng.dropout_keep(self.seed, self.state["step"], site, shape, p, rows)

    # ---- ops (semantics in backend.py) ----------------------------------------------
    def zero(self, view):
        self._rec(lambda: view.fill(0.0))

    def defer_sums(self, on):
        """Nothing to hold: every op here makes its sums at once."""

    def flush_sums(self):
        """Nothing is held."""

    def lr_schedule(self, learning_rate, min_lr, warmup_iters, lr_decay_iters):
        def f():
            self.state["lr"] = R.lr_at(self.state["step"], learning_rate, min_lr, warmup_iters, lr_decay_iters)
        self._rec(f)

    def step_advance(self):
        self._rec(lambda: self.state.__setitem__("step", self.state["step"] + 1))

    def eval_advance(self):
        self._rec(lambda: self.state.__setitem__("eval_draws", self.state["eval_draws"] + 1))

    def batch_feeder(self, x, y, rows: int, block: int):
        return _Feeder(x.reshape(-1, block), y.reshape(-1, block))

    def work_copy(self, work, params):
        def f():
            if not self.state["work_fresh"]:
                work[...] = params
        self._rec(f)

    def accumulate(self, dst, src, first):
        def f():
            if first:
                dst[...] = src
            else:
                dst[...] += src
        self._rec(f)

    def encoder_fwd(self, out, idx, wte, wpe):
        self._rec(lambda: out.__setitem__(Ellipsis, R.encoder_forward(idx, wte, wpe)))

    def encoder_bwd(self, dwte, dwpe, dout, idx):
        def f():
            gw, gp = R.encoder_backward(dout, idx, dwte.shape[0], dwpe.shape[0])
            dwte[...] += gw
            dwpe[...] = gp
        self._rec(f)

    def dropout_fwd(self, out, x, p, site):
        if p > 0:
            self._rec(lambda: out.__setitem__(Ellipsis, R.dropout_forward(x, self._keep(site, x.shape, p), p)))

    def dropout_bwd(self, dx, dout, p, site):
        if p > 0:
            self._rec(lambda: dx.__setitem__(Ellipsis, R.dropout_backward(dout, self._keep(site, dout.shape, p), p)))

    def residual_dropout(self, out, resid, x, p, site):
        def f():
            d = R.dropout_forward(x, self._keep(site, x.shape, p), p) if p > 0 else x
            out[...] = resid + d
        self._rec(f)

    def layernorm_fwd(self, out, mean, rstd, x, w, b, residual=None):
        if residual is not None:
            self.residual_dropout(x, *residual)

        def f():
            o, m, r = R.layernorm_forward(x, w, b)
            out[...], mean[...], rstd[...] = o, m, r
        self._rec(f)

    def layernorm_bwd(self, dx, dw, db, dout, x, mean, rstd, w, drop=None, ds=None):
        broken = "layernorm" in faults.broken

        def f():
            gx, gw, gb = R.layernorm_backward(dout, x, mean, rstd, w, drop_xhat_term=broken)
            dx[...] += gx
            dw[...] = gw
            if db is not None:
                db[...] = gb
        self._rec(f)
        if drop is not None:
            self.dropout_bwd(drop[0], dx, drop[1], drop[2])
        if ds is not None:          # the branch gradient as stored: after the ops that wrote it
            branch = dx if drop is None else drop[0]
            self._rec(lambda: ds.__setitem__(Ellipsis, _2d(branch).sum(axis=0)))

    def matmul(self, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, a_colsum=None):
        check_matmul(out, trans_a, bias, epilogue, aux, a_colsum)

        def f():
            if a_colsum is not None:
                a_colsum[...] = _2d(a).sum(axis=0)
            r = R.matmul_forward(_2d(a), _2d(b), trans_a, trans_b, bias)
            matmul_epilogue(_2d(out), r, epilogue, None if aux is None else _2d(aux))
        self._rec(f)

    def linear_bwd(self, dx, dw, dy, x, w, db=None, epilogue="none", aux=None):
        self.matmul(dx, dy, w, False, False, epilogue=epilogue, aux=aux)
        self.matmul(dw, dy, x, True, False, a_colsum=db)

    def gelu_fwd(self, out, x):
        self._rec(lambda: out.__setitem__(Ellipsis, R.gelu_forward(x)))

    def attention_fwd(self, y, qkv, saved, n_head, p, site):
        def f():
            B, T = qkv.shape[0], qkv.shape[1]
            keep = self._keep(site, (B, n_head, T, T), p, rows=True) if p > 0 else None
            out, probs = R.attention_forward(qkv, n_head, keep, p)
            y[...] = out
            saved["probs"][...] = probs
        self._rec(f)

    def attention_bwd(self, dqkv, dy, qkv, y, saved, n_head, p, site):
        def f():
            B, T = qkv.shape[0], qkv.shape[1]
            keep = self._keep(site, (B, n_head, T, T), p, rows=True) if p > 0 else None
            dqkv[...] = R.attention_backward(dy, qkv, saved["probs"], n_head, keep, p)
        self._rec(f)

    def crossentropy(self, losses, dlogits, logits, targets, grad_scale, n_vocab=None):
        def f():
            V = logits.shape[-1]
            Vr = V if n_vocab is None else n_vocab       # columns Vr.. are padding: masked out
            lo, probs = R.crossentropy_forward(_2d(logits)[:, :Vr], targets.reshape(-1))
            losses[...] = lo.reshape(losses.shape)
            if grad_scale and dlogits is not None:
                d = _2d(dlogits)
                d[:, :Vr] = R.crossentropy_backward(probs, targets.reshape(-1), grad_scale)
                d[:, Vr:] = 0.0
        self._rec(f)

    def loss_reduce(self, losses, history):
        def f():
            self.state["loss"] = float(np.mean(losses))
            if history is not None and self.state["step"] < history.shape[0]:
                history[self.state["step"]] = self.state["loss"]
        self._rec(f)

    def grad_norm(self, grads):
        self._rec(lambda: self.state.__setitem__("grad_norm", R.global_norm([grads])))

    def decode_embed(self, out, ctx, wte, wpe, pos):
        self._rec(lambda: out.__setitem__(Ellipsis, wte[ctx[:, int(pos[0])]] + wpe[int(pos[0])]))

    def decode_attention(self, y, qkv, kcache, vcache, n_head, pos, part=None):
        def f():
            S, C = y.shape
            hs, t = C // n_head, int(pos[0])
            q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(S, n_head, hs) for i in range(3))
            kcache[:, :, t], vcache[:, :, t] = k, v
            att = np.einsum("shd,shjd->shj", q, kcache[:, :, :t + 1]) / np.sqrt(hs)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            y[...] = np.einsum("shj,shjd->shd", att, vcache[:, :, :t + 1]).reshape(S, C)
        self._rec(f)

    def decode_linear(self, out, a, w, bias=None, epilogue="none", aux=None):
        self.matmul(out, a, w, False, True, bias=bias, epilogue=epilogue, aux=aux)

    def decode_sample(self, g, logits, pos, n_vocab):
        """kernels/decode.cu decode_sample, one sequence at a time."""
        def f():
            o = unpack_gen_opts(g["opts"])
            p, T = int(pos[0]), g["ctx"].shape[1] - 1
            S = logits.shape[0]
            stop = [int(v) for v in g["stop"][:o["n_stop"]]]
            for s in range(S):
                was_done = bool(g["done"][s])
                if not was_done and p + 1 >= g["fill"][s]:
                    k = int(g["n_out"][s])
                    x = R.draw_token(logits[s], n_vocab, o["inv_temp"], o["top_k"], o["top_p"], o["seed"], k, s)
                    g["ctx"][s, p + 1], g["fill"][s] = x, p + 2
                    g["out"][s, k], g["n_out"][s] = x, k + 1
                    tail = [int(v) for v in g["out"][s, k + 1 - len(stop):k + 1]] if k + 1 >= len(stop) else None
                    d = int(k + 1 >= o["max_new"] or (bool(stop) and tail == stop))
                    g["done"][s], g["emit"][0, s], g["emit"][1, s] = d, x, d
                else:
                    g["emit"][0, s], g["emit"][1, s] = -1, int(was_done)
                if p + 1 == T and not was_done:
                    f_, K = int(g["fill"][s]), max(T // 2, 1)
                    g["ctx"][s, :K] = g["ctx"][s, f_ - K:f_].copy()
                    g["fill"][s] = K
        self._rec(f)

    def decode_advance(self, pos, T):
        self._rec(lambda: pos.__setitem__(0, 0 if pos[0] + 1 == T else pos[0] + 1))

    def adamw(self, params, grads, m, v, n_decay, beta1, beta2, eps, weight_decay, grad_clip, work=None):
        decay = np.arange(params.shape[0]) < n_decay

        def f():
            g = grads * R.clip_scale(self.state["grad_norm"], grad_clip)
            p2, m2, v2 = R.adamw_update(params, g, m, v, self.state["lr"], beta1, beta2, eps, weight_decay,
                                        self.state["step"] + 1, decay)
            params[...], m[...], v[...] = p2, m2, v2
            if work is not None:
                work[...] = p2
                self.state["work_fresh"] = 1
        self._rec(f)


class _Feeder:
    """The reference backend's batch feeder: the host arrays are the device arrays."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def put(self, rows: int, fill):
        fill(self.x[:rows], self.y[:rows])
