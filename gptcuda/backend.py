"""The op interface the model is written against, once, for both backends.

Every op is destination-passing: outputs are views the memory plan allocated, never
returned arrays. A backend does not run an op when it is called; it *records* it into the
open `Program`, and the program is run (eagerly, or as a replayed CUDA graph) later. So
model.py builds a step's launch sequence once, and the `cuda` backend's argument blocks
are packed once, at record time.

Tensors are the backend's views: numpy float64 arrays for `reference`, `DeviceView` for
`cuda`. Model code only reads `.shape`. A view's leading dimensions flatten into rows
where an op says [N, C] (N = B*T).

Ops (shapes; "+=" means the op accumulates into its destination, "=" that it overwrites):

  zero(view)                                 view = 0
  lr_schedule(state)                         state.lr = schedule(state.step)
  step_advance(state)                        state.step += 1
  eval_advance(state)                        state.eval_draws += 1
  encoder_fwd(out[B,T,C], idx[B,T], wte[V,C], wpe[Tmax,C])     out = wte[idx] + wpe[t]
  encoder_bwd(dwte[V,C], dwpe[Tmax,C], dout[B,T,C], idx[B,T])  dwte += ; dwpe = (rows >= T zeroed)
  dropout_fwd(out, x, p, site)               out = x * keep / (1-p)  (out may be x)
  dropout_bwd(dx, dout, p, site)             dx = dout * keep / (1-p) (dx may be dout)
  residual_dropout(out, resid, x, p, site)   out = resid + dropout(x)  (element index = row-major index of x)
  layernorm_fwd(out[N,C], mean[N], rstd[N], x[N,C], w[C], b[C]|None)
  layernorm_bwd(dx[N,C], dw[C], db[C]|None, dout[N,C], x, mean, rstd, w)   dx += ; dw = ; db =
  matmul(out[M,N], a, b, trans_a, trans_b, bias=None, epilogue="none"|"gelu"|"residual"|"dgelu", aux=None)
      a is [M,K] (stored [K,M] when trans_a), b is [K,N] (stored [N,K] when trans_b), row-major;
      out = op(a) @ op(b) + bias; "gelu": aux = that pre-activation, out = gelu_tanh(aux);
      "residual": out = aux + op(a) @ op(b) + bias (aux may be out);
      "dgelu": out = (op(a) @ op(b)) * gelu_tanh'(aux) (no bias; the GELU backward folded in).
  bias_grad(db[N], dout[M,N])                db = dout.sum(0)   (deterministic)
  gelu_fwd(out, x)                           out = gelu_tanh(x)
  attention_fwd(y[B,T,C], qkv[B,T,3C], saved, n_head, p, site)
  attention_bwd(dqkv[B,T,3C], dy[B,T,C], qkv, y, saved, n_head, p, site)     dqkv =
      `saved` is the dict of views `memory.attention_saved(cfg)` plans for the layer
  crossentropy(losses[N], dlogits[N,V], logits[N,V], targets[N], grad_scale, n_vocab=None)
      losses = -log softmax(logits[:, :n_vocab])[target]; dlogits = (softmax - onehot) * grad_scale,
      0 in the padded columns n_vocab.. (dlogits may be logits; with grad_scale 0 no gradient is written)
  accumulate(dst, src, first)                dst = src (first) or dst += src (gradient accumulation)
  loss_reduce(state, losses[N], history)      state.loss = mean(losses); history[state.step] = it
  grad_norm(state, grads)                    state.grad_norm = ||grads||_2 (deterministic)
  adamw(params, grads, m, v, state, n_decay, beta1, beta2, eps, weight_decay, grad_clip)
      one pass over the flat buffer: g *= min(1, clip / (norm + 1e-6)) when clip > 0;
      decoupled decay lr*wd*p on the first n_decay elements only; bias correction with t = step+1.

Generation with a KV cache (S sequences, one position per step, pos a device int):
  decode_embed(out[S,C], tok[S], wte, wpe, pos)      out = wte[tok] + wpe[pos]
  decode_attention(y[S,C], qkv[S,3C], kcache, vcache, n_head, pos)
      k, v of qkv appended to kcache/vcache [S,H,Tmax,hs] at pos; y = causal attention of q over 0..pos
  pos_advance(pos)                                   pos += 1

Batches are not an op: `batch_feeder(x, y, rows, T)` returns an object whose `put(rows, fill)` has
fill(x_host, y_host) write [rows, T] ids and queues them into x / y ahead of the next run
(gptcuda/batches.py decides which windows).

Each backend also provides: `allocate(plan, table)` -> Buffers, `allocate_arena(plan)` -> views,
`upload`/`download`, `read_state`/`write_state`, `begin()`/`end()` -> Program, `run(program)`,
`capture(program)`, `synchronize()`, and the plan's inputs `attention_saved(cfg)`, `workspaces(cfg)`.
"""

ATTENTION_KINDS = ("unfused", "fused")
EPILOGUES = ("none", "gelu", "residual", "dgelu")


class Program:
    """A recorded sequence of ops. `items` holds backend-specific launch records."""

    def __init__(self, name: str):
        self.name = name
        self.items = []

    def __len__(self):
        return len(self.items)


def rows(shape) -> int:
    """Leading dimensions of a view, flattened (the N of an op written for [N, C])."""
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    return n


class Buffers:
    """The views a model runs on: parameters, gradients and Adam state by name and as flat
    regions, and every arena entry of the memory plan by name."""

    def __init__(self, params, grads, flat_params, flat_grads, flat_m, flat_v, acts):
        self.params, self.grads = params, grads
        self.flat_params, self.flat_grads, self.flat_m, self.flat_v = flat_params, flat_grads, flat_m, flat_v
        self.acts = acts
