"""The GPT's forward and backward launch sequence, written once for both backends.

Reads top to bottom like the model: embed, L blocks of (layernorm, attention, residual,
layernorm, MLP, residual), final layernorm, tied head, cross-entropy; then the same in
reverse. Every call records an op into the backend's open program (see backend.py); the
buffers are the memory plan's views, so nothing is allocated here.

Shapes: B batch, T block_size, C n_embd, H n_head, V vocab, L n_layer, N = B*T.
A training step runs A micro-batches (gradient accumulation): micro-batch k reads idx[k] /
targets[k] and writes losses[k]; the activations serve one micro-batch at a time. V may be
padded past the tokenizer's n_vocab: the loss masks the padded columns.
"""
from __future__ import annotations

from gptcuda.config import recompute_layers
from gptcuda.model import rng


class GPT:
    def __init__(self, cfg, ops, bufs, table, n_vocab=None, accum: int = 1):
        self.cfg, self.ops, self.b, self.table = cfg, ops, bufs, table
        self.p = bufs.params      # name -> view
        self.w = bufs.work        # name -> the view the products and the embedding read (bf16: the working copy)
        self.g = bufs.grads       # name -> view
        self.a = bufs.acts        # plan entry name -> view
        self.n_vocab = n_vocab    # the tokenizer's vocabulary (None: all of V)
        self.accum = accum        # micro-batches per training step
        self.micro = 0            # the micro-batch being recorded
        self.rebuilt = recompute_layers(cfg)   # layers 0 .. rebuilt-1 rebuild their GELU output in the backward

    def site(self, site):
        """The random stream of a dropout site in the micro-batch being recorded."""
        return rng.micro_site(site, self.micro)

    def _pb(self, name):
        return self.p.get(name)   # None when the config has no biases

    def forward(self, train: bool, grad_scale: float):
        """Logits, per-token losses, and (grad_scale != 0) the logits' gradient in place."""
        o, a, p, w, cfg = self.ops, self.a, self.p, self.w, self.cfg
        drop = cfg.dropout if train else 0.0
        H = cfg.n_head
        k = self.micro
        o.encoder_fwd(a["res"][0], a["idx"][k], w["wte"], w["wpe"])              # [B,T,C]
        o.dropout_fwd(a["res"][0], a["res"][0], drop, self.site(rng.DROPOUT_EMB))
        pend = None         # a residual add with dropout, made by the layernorm that reads its sum
        for l in range(cfg.n_layer):
            x, mid, out = a["res"][l], a["mid"][l], a["res"][l + 1]              # [B,T,C] each
            h = f"h{l}."
            o.layernorm_fwd(a["ln1"][l], a["ln1_mean"][l], a["ln1_rstd"][l], x, p[h + "ln1.w"], self._pb(h + "ln1.b"),
                            pend)
            o.matmul(a["qkv"][l], a["ln1"][l], w[h + "attn.w"], False, True, bias=self._pb(h + "attn.b"))  # [B,T,3C]
            o.attention_fwd(a["atty"][l], a["qkv"][l], self.saved(l), H, drop, self.site(rng.dropout_site(l, 0)))
            pend = self._residual(mid, x, a["atty"][l], w[h + "proj.w"], self._pb(h + "proj.b"), drop,
                                  self.site(rng.dropout_site(l, 1)))
            o.layernorm_fwd(a["ln2"][l], a["ln2_mean"][l], a["ln2_rstd"][l], mid, p[h + "ln2.w"], self._pb(h + "ln2.b"),
                            pend)
            act = self.fc_act(l)                                                   # [B,T,4C]
            o.matmul(act, a["ln2"][l], w[h + "fc.w"], False, True, bias=self._pb(h + "fc.b"),
                     epilogue="gelu", aux=a["fc_pre"][l])
            pend = self._residual(out, mid, act, w[h + "fcproj.w"], self._pb(h + "fcproj.b"), drop,
                                  self.site(rng.dropout_site(l, 2)))
        L = cfg.n_layer
        o.layernorm_fwd(a["lnf"], a["lnf_mean"], a["lnf_rstd"], a["res"][L], p["lnf.w"], self._pb("lnf.b"), pend)
        o.matmul(a["logits"], a["lnf"], w["wte"], False, True)                   # [B,T,V], tied head
        o.crossentropy(a["losses"][k], a["logits"] if grad_scale else None, a["logits"], a["targets"][k], grad_scale,
                       n_vocab=self.n_vocab)

    def _residual(self, out, resid, x, w, bias, drop, site):
        """out = resid + dropout(x @ w^T + bias): fused into the GEMM epilogue when there is no dropout
        (returns None); with dropout the product goes to the branch buffer and the add is returned,
        (resid, branch, p, site), for the layernorm that reads out to make (layernorm_fwd's residual)."""
        if drop > 0:
            self.ops.matmul(self.b.acts["branch"], x, w, False, True, bias=bias)
            return resid, self.b.acts["branch"], drop, site
        self.ops.matmul(out, x, w, False, True, bias=bias, epilogue="residual", aux=resid)
        return None

    def fc_act(self, l):
        """Where layer l's GELU output lives: stored (fc_act holds the layers from `rebuilt` on), or
        (recompute, the first `rebuilt` layers) in the shared dfc buffer during the forward, rebuilt
        over fc_pre[l] in the backward."""
        return self.a["dfc"] if l < self.rebuilt else self.a["fc_act"][l - self.rebuilt]

    def saved(self, l):
        """Layer l's tensors saved by the attention implementation for its backward (plan entries saved_*)."""
        return {k[len("saved_"):]: v[l] for k, v in self.a.items() if k.startswith("saved_")}

    def backward(self):
        """Every parameter gradient, from the logits' gradient left by forward(grad_scale=1/N). The
        bias and layernorm weight gradients' last sums are held and made together at each hook
        point (_grads_ready), fewer launches for the same values."""
        self.ops.defer_sums(True)
        try:
            self._backward()
        finally:
            self.ops.defer_sums(False)

    def _backward(self):
        o, a, p, w, g, cfg = self.ops, self.a, self.p, self.w, self.g, self.cfg
        drop, H, L = cfg.dropout, cfg.n_head, cfg.n_layer
        dres, dln, dfc, dqkv = a["dres"], a["dln"], a["dfc"], a["dqkv"]
        datty = dln         # the attention output's gradient is dead before dln is written again
        # head: logits = lnf @ wte^T
        o.matmul(dln, a["logits"], w["wte"], False, False)                        # dlnf [B,T,C]
        o.matmul(g["wte"], a["logits"], a["lnf"], True, False)                    # dwte [V,C] =
        o.zero(dres)
        # each layernorm backward also writes the gradient of the branch before it (dropout's
        # backward of the new dres into a["branch"]; dres itself without dropout)
        d = self._branch(dres, drop)
        # each layernorm backward also sums that branch gradient's columns: the bias gradient of the
        # projection whose output the residual took there (ds), so those products' weight gradients sum none
        o.layernorm_bwd(dres, g["lnf.w"], g.get("lnf.b"), dln, a["res"][L], a["lnf_mean"], a["lnf_rstd"], p["lnf.w"],
                        self._drop_out(drop, self.site(rng.dropout_site(L - 1, 2))), ds=g.get(f"h{L - 1}.fcproj.b"))
        self._grads_ready("head")
        for l in reversed(range(L)):
            h = f"h{l}."
            # mlp half: res[l+1] = mid + drop(fc_act @ fcproj^T + b); d: its branch's gradient
            if l < self.rebuilt:  # dfc: the pre-activation's gradient; fc_pre[l]: rebuilt into the GELU output
                pre = a["fc_pre"][l]
                if o.exec.gelu_in_dgelu:
                    o.matmul(dfc, d, w[h + "fcproj.w"], False, False, epilogue="dgelu_gelu", aux=pre)
                else:
                    o.matmul(dfc, d, w[h + "fcproj.w"], False, False, epilogue="dgelu", aux=pre)
                    o.gelu_fwd(pre, pre)
                o.matmul(g[h + "fcproj.w"], d, pre, True, False)
            else:           # (the stored GELU output: dW fcproj does not wait for the dgelu product)
                o.linear_bwd(dfc, g[h + "fcproj.w"], d, self.fc_act(l), w[h + "fcproj.w"], epilogue="dgelu",
                             aux=a["fc_pre"][l])
            o.linear_bwd(dln, g[h + "fc.w"], dfc, a["ln2"][l], w[h + "fc.w"], db=g.get(h + "fc.b"))   # d ln2 [B,T,C]
            o.layernorm_bwd(dres, g[h + "ln2.w"], g.get(h + "ln2.b"), dln, a["mid"][l], a["ln2_mean"][l],
                            a["ln2_rstd"][l], p[h + "ln2.w"], self._drop_out(drop, self.site(rng.dropout_site(l, 1))),
                            ds=g.get(h + "proj.b"))
            # attention half: mid = res[l] + drop(atty @ proj^T + b); d: its branch's gradient
            o.linear_bwd(datty, g[h + "proj.w"], d, a["atty"][l], w[h + "proj.w"])
            o.attention_bwd(dqkv, datty, a["qkv"][l], a["atty"][l], self.saved(l), H, drop,
                            self.site(rng.dropout_site(l, 0)))
            o.linear_bwd(dln, g[h + "attn.w"], dqkv, a["ln1"][l], w[h + "attn.w"], db=g.get(h + "attn.b"))  # d ln1
            below = rng.dropout_site(l - 1, 2) if l > 0 else rng.DROPOUT_EMB   # the branch before res[l]
            o.layernorm_bwd(dres, g[h + "ln1.w"], g.get(h + "ln1.b"), dln, a["res"][l], a["ln1_mean"][l],
                            a["ln1_rstd"][l], p[h + "ln1.w"], self._drop_out(drop, self.site(below)),
                            ds=g.get(f"h{l - 1}.fcproj.b") if l > 0 else None)
            self._grads_ready(l)
        o.encoder_bwd(g["wte"], g["wpe"], d, a["idx"][self.micro])      # d: the embeddings' dropout gradient
        self._grads_ready("embed")

    def _branch(self, dres, drop):
        """Where the gradient of a branch output before dropout lives: a["branch"], written by the
        layernorm backward before it (dres itself when there is no dropout)."""
        return self.a["branch"] if drop > 0 else dres

    def _drop_out(self, drop, site):
        """The layernorm backward's dropout output (a["branch"], p, site), or None without dropout."""
        return (self.a["branch"], drop, site) if drop > 0 else None

    # ---- whole programs -----------------------------------------------------------------
    dp = None               # gptcuda.dist.DataParallel of a data-parallel rank (set by Engine)
    on_grads_ready = None   # while recording the training step: dp.record_grads_ready

    def _grads_ready(self, point):
        """Hook of the backward: every gradient of `point` ("head", a layer index, "embed") is final."""
        self.ops.flush_sums()
        if self.on_grads_ready is not None:
            self.on_grads_ready(point)

    def _refresh_work(self):
        """A program's first op where the products read a bf16 working copy (memory plan entry
        params_bf16): the copy made from the fp32 parameters as they are now, unless the step state says
        it is fresh (work_fresh: the last op to write the parameters was the training step's AdamW, which
        wrote the copy too; the Engine clears it wherever the host writes the parameters)."""
        if "params_bf16" in self.a:
            self.ops.work_copy(self.a["params_bf16"], self.b.flat_params)

    def _points(self):
        """The backward's hook points in the order it reaches them."""
        return ["head", *reversed(range(self.cfg.n_layer)), "embed"]

    def record_train_step(self):
        """batch -> A x (forward -> backward) -> clip -> AdamW -> step += 1, with nothing per step baked in.
        Micro-batches before the last add their gradients into grad_acc; the last adds grad_acc into its
        own (so the gradients hold the sum over the step; the loss's grad_scale 1/(A*B*T) makes it the
        mean), or bf16 gradients its own into grad_acc (final_grads). Data parallel (self.dp): the ranks'
        mean loss and the gradient buckets are all-reduced on the communication stream, during the last
        backward when A = 1, after it otherwise; the history gets the mean over ranks."""
        o, cfg, b, dp, A = self.ops, self.cfg, self.b, self.dp, self.accum
        self._refresh_work()
        o.lr_schedule(cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
        n_tok = A * cfg.batch_size * cfg.block_size
        acc = self.a.get("grad_acc")
        for k in range(A):
            self.micro = k
            last = k == A - 1
            self.forward(train=True, grad_scale=1.0 / n_tok)
            if not last:
                self.backward()
                o.accumulate(acc, b.flat_grads, first=k == 0)
                continue
            final = self.final_grads()
            if dp is None:
                o.loss_reduce(self.a["losses"], self.a["history"])
                self.backward()
                if A > 1:
                    self._add_last(acc)
                o.grad_norm(final)
                o.adamw(b.flat_params, final, b.flat_m, b.flat_v, self.table.n_decay, cfg.beta1,
                        cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip, work=self.a.get("params_bf16"))
            else:
                o.loss_reduce(self.a["losses"], None)                 # this rank's mean
                dp.record_loss_mean()
                self.on_grads_ready = dp.record_grads_ready if A == 1 else None
                try:
                    self.backward()
                finally:
                    self.on_grads_ready = None
                if A > 1:
                    self._add_last(acc)
                    for point in self._points():                    # every bucket is ready now
                        dp.record_grads_ready(point)
                dp.record_join()
                o.loss_reduce(dp.loss_mean, self.a["history"])        # state.loss, history[step]: the world's mean
                dp.record_update(o)
        self.micro = 0
        o.step_advance()

    def final_grads(self):
        """The step's whole gradient, which the norm, AdamW and the ranks' reduction read: the gradient
        region, or with micro-batches and bf16 gradients the fp32 sum grad_acc (the last micro-batch's added
        into it: the sum stays fp32)."""
        b, acc = self.b, self.a.get("grad_acc")
        return acc if acc is not None and self.accum > 1 and str(b.flat_grads.dtype) == "bf16" else b.flat_grads

    def _add_last(self, acc):
        """The last micro-batch's gradients and grad_acc's sum into final_grads(): fp32 gradients take the sum
        (gradients += grad_acc, as before), bf16 ones are added to it (grad_acc += gradients)."""
        if self.final_grads() is acc:
            self.ops.accumulate(acc, self.b.flat_grads, first=False)
        else:
            self.ops.accumulate(self.b.flat_grads, acc, first=False)

    def record_eval_batch(self, split: str):
        """One evaluation batch (already in idx[0] / targets[0]): forward without dropout, mean loss
        into the state, eval_draws += 1."""
        self._refresh_work()
        self.forward(train=False, grad_scale=0.0)
        self.ops.loss_reduce(self.a["losses"][0], None)
        self.ops.eval_advance()

    def record_forward_backward(self):
        """Forward and backward on the batch already in idx[0]/targets[0] (gradcheck, golden tests)."""
        n_tok = self.cfg.batch_size * self.cfg.block_size
        self._refresh_work()
        self.forward(train=True, grad_scale=1.0 / n_tok)
        self.ops.loss_reduce(self.a["losses"][0], None)
        self.backward()

    def record_decode_step(self, d, n_vocab: int):
        """One position of every sequence with the KV cache (d: the views of memory.plan_decode):
        the logits of the token at ctx[:, pos], the next token drawn where the prompt is read,
        then pos advances. Nothing here depends on the position, so the recorded step serves
        every token. The products read the weights through self.w: in a bf16 generation the
        working copy (plan entry params_bf16), which the caller makes once from the loaded weights
        (the parameters do not change between steps); the embedding rows, the layernorms and the
        biases read the fp32 parameters."""
        o, p, w, cfg = self.ops, self.p, self.w, self.cfg
        x, h = d["x"], d["h"]
        o.decode_embed(x, d["ctx"], p["wte"], p["wpe"], d["pos"])                # [S,C]
        for l in range(cfg.n_layer):
            n = f"h{l}."
            o.layernorm_fwd(h, d["h_mean"], d["h_rstd"], x, p[n + "ln1.w"], self._pb(n + "ln1.b"))
            o.decode_linear(d["qkv"], h, w[n + "attn.w"], self._pb(n + "attn.b"))
            o.decode_attention(d["y"], d["qkv"], d["kcache"][l], d["vcache"][l], cfg.n_head, d["pos"],
                               d["attn_part"])
            o.decode_linear(x, d["y"], w[n + "proj.w"], self._pb(n + "proj.b"), "residual", x)
            o.layernorm_fwd(h, d["h_mean"], d["h_rstd"], x, p[n + "ln2.w"], self._pb(n + "ln2.b"))
            o.decode_linear(d["fc_act"], h, w[n + "fc.w"], self._pb(n + "fc.b"), "gelu", d["fc_pre"])
            o.decode_linear(x, d["fc_act"], w[n + "fcproj.w"], self._pb(n + "fcproj.b"), "residual", x)
        o.layernorm_fwd(h, d["h_mean"], d["h_rstd"], x, p["lnf.w"], self._pb("lnf.b"))
        o.decode_linear(d["logits"], h, w["wte"])                                   # [S,V]
        o.decode_sample(d, d["logits"], d["pos"], n_vocab)
        o.decode_advance(d["pos"], cfg.block_size)

    def record_forward(self, train: bool = False):
        self._refresh_work()
        self.forward(train=train, grad_scale=0.0)
        self.ops.loss_reduce(self.a["losses"][0], None)
