"""The data-parallel part of the training step (DataParallel)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from gptcuda.model import state
from gptcuda.dist.buckets import plan_buckets, zero_shards
from gptcuda.dist.env import DistError, rank_seed
from gptcuda.dist.nccl import nccl_version, selftest
from gptcuda.dist.rendezvous import Group


class DataParallel:
    """Everything one rank adds to the training step; made by Engine when it gets a Group.

    Recording (model.record_train_step calls these in order):
        record_loss_mean()        the mean of the ranks' losses into `loss_mean`, on the comm stream
        record_grads_ready(pt)    the buckets whose last tensor the backward finished at point pt
        record_join()             the main stream waits for the comm stream
        record_update(ops)        gradient norm and AdamW (ZeRO-1: on this rank's shard, then
                                  the parameters are all-gathered)
    Eagerly: warmup() before graph capture, host_mean() for evaluation losses,
    gather_optimizer_state() before a checkpoint (ZeRO-1), comm_times() after a timed step."""

    def __init__(self, group: Group, backend, bufs, table, cfg, grads=None):
        if getattr(backend, "name", "") != "cuda":
            raise DistError(f"data-parallel training needs the cuda backend, not {cfg.backend!r}")
        self.group, self.rt, self.bufs, self.table, self.cfg = group, backend.rt, bufs, table, cfg
        # the step's whole gradient (GPT.final_grads: the gradient region, fp32 or bf16, or the fp32 grad_acc),
        # reduced over the ranks in its own dtype
        self.grads = bufs.flat_grads if grads is None else grads
        self.gsize = self.grads.itemsize
        self.rank, self.world = group.rank, group.world_size
        self.zero = int(cfg.zero)
        rt = self.rt
        if rt.seed != rank_seed(cfg.seed, self.rank):   # the Engine built the backend with it
            raise DistError(f"rank {self.rank}: the backend's dropout seed {rt.seed} is not the rank's "
                            f"{rank_seed(cfg.seed, self.rank)} (build it with seed=rank_seed(cfg.seed, rank))")
        self.comm = group.connect()
        group.before_close.append(rt.destroy_graphs)
        self.side = rt.side_stream()
        self.timing = bool(group.comm_timing)
        self.cap = max(int(group.bucket_mb * 2 ** 20) // 4, 1)
        self.buckets = [] if self.zero else plan_buckets(table, self.cap)
        self._by_point = defaultdict(list)
        for b in self.buckets:
            self._by_point[b.point].append(b)
        self.shards = zero_shards(table.total, self.world) if self.zero else None
        self._scratch = rt.alloc(256)                 # [0]: the world's mean loss; [64:]: host means (f64)
        from gptcuda.runtime import DeviceView
        self.loss_mean = DeviceView(self._scratch, (1,), "f32", "loss_mean")
        self.timed = []                               # (label, start event, end event)
        self.marks = None                             # (main reached the join, comm stream done)
        if group.selftest:
            self.selftest()

    # ---- set-up ---------------------------------------------------------------------------
    def describe(self) -> str:
        try:
            ver = f"NCCL {nccl_version()}"
        except Exception:                              # a fake communicator (tests)
            ver = "NCCL"
        if self.zero:
            s = self.shards
            how = f"ZeRO-1: gradients reduce-scattered, {s.shard:,} parameters of Adam state per rank"
        else:
            big = max(b.numel for b in self.buckets)
            e = self.gsize
            how = (f"{len(self.buckets)} gradient buckets of {self.grads.dtype} (<= {self.cap * e / 2**20:.1f} MiB, "
                   f"largest {big * e / 2**20:.1f} MiB) all-reduced during the backward")
        return (f"data parallel: {self.world} ranks over {ver}, global batch {self.world} x "
                f"{self.cfg.batch_size}; {how}; self-test passed")

    def selftest(self):
        selftest(self.rt, self.comm, self.rank, self.world, zero=bool(self.zero))

    # ---- recording ---------------------------------------------------------------------------
    def _marks(self, label):
        if not self.timing:
            return None
        m = (self.rt.new_event(timing=True), self.rt.new_event(timing=True))
        self.timed.append((label,) + m)
        return m

    def _call(self, fn, label, nbytes, side=True):
        from gptcuda.runtime import StreamCall
        self.rt.add(StreamCall(fn, label, self.side if side else None, nbytes, self._marks(label)))

    def _fork(self, label):
        from gptcuda.runtime import StreamFork
        self.rt.add(StreamFork(self.side, self.rt.new_event(), label))

    def record_loss_mean(self):
        st, out, comm = self.rt.state.ptr, self.loss_mean.ptr, self.comm
        self._fork("fork loss")
        loss = st + state.byte_offset("loss")
        self._call(lambda s: comm.all_reduce(loss, out, 1, "f32", "avg", s), "allreduce loss", 4)

    def record_grads_ready(self, point):
        """Called by model.backward() at each hook point; issues the buckets that became ready."""
        ready = self._by_point.get(point, [])
        if not ready:
            return
        self._fork(f"fork grads@{point}")
        base, comm, e_, dt = self.grads.ptr, self.comm, self.gsize, self.grads.dtype
        for b in ready:
            def run(s, spans=b.spans):
                if len(spans) > 1:
                    comm.group_start()
                try:
                    for a, e in spans:
                        comm.all_reduce(base + e_ * a, base + e_ * a, e - a, dt, "avg", s)
                finally:
                    if len(spans) > 1:
                        comm.group_end()
            self._call(run, f"allreduce bucket {b.index}", e_ * b.numel)

    def record_join(self):
        from gptcuda.runtime import StreamJoin
        if self.timing:
            self.marks = (self.rt.new_event(timing=True), self.rt.new_event(timing=True))
        self.rt.add(StreamJoin(self.side, self.rt.new_event(), "join comm", self.marks))

    def _sub(self, region, a, b):
        from gptcuda.runtime import DeviceView
        return DeviceView(region.ptr + region.itemsize * a, (b - a,), region.dtype, f"{region.name}[{a}:{b}]")

    def record_update(self, o):
        """Gradient norm of the reduced gradients, clipping and AdamW (backend op `o`)."""
        cfg, b, grads = self.cfg, self.bufs, self.grads
        if not self.zero:
            o.grad_norm(grads)
            o.adamw(b.flat_params, grads, b.flat_m, b.flat_v, self.table.n_decay, cfg.beta1, cfg.beta2,
                    cfg.eps, cfg.weight_decay, cfg.grad_clip)
            return
        sh, r, W, comm = self.shards, self.rank, self.world, self.comm
        g, p, e, dt = grads.ptr, b.flat_params.ptr, self.gsize, grads.dtype
        if sh.shard:
            self._call(lambda s: comm.reduce_scatter(g, g + e * r * sh.shard, sh.shard, dt, "avg", s),
                       "reduce-scatter grads", e * sh.even, side=False)
        if sh.tail:
            gt = g + e * sh.even
            self._call(lambda s: comm.reduce(gt, gt, sh.tail, dt, "avg", W - 1, s), "reduce grads tail",
                       e * sh.tail, side=False)
        lo, hi = sh.owned(r)
        self._record_norm(self._sub(grads, lo, hi), max(sh.owned(q)[1] - sh.owned(q)[0] for q in range(W)))
        if hi > lo:
            n_decay = min(max(self.table.n_decay - lo, 0), hi - lo)
            o.adamw(*(self._sub(v, lo, hi) for v in (b.flat_params, grads, b.flat_m, b.flat_v)), n_decay,
                    cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip)
        if sh.shard:
            self._call(lambda s: comm.all_gather(p + 4 * r * sh.shard, p, sh.shard, "f32", s),
                       "all-gather params", 4 * sh.even, side=False)
        if sh.tail:
            pt = p + 4 * sh.even
            self._call(lambda s: comm.broadcast(pt, pt, sh.tail, "f32", W - 1, s), "broadcast params tail",
                       4 * sh.tail, side=False)

    def _record_norm(self, owned, n_max: int):
        """state.grad_norm of the whole reduced gradient from this rank's shard: optim's norm kernel's
        per-block partial sums (double) are all-reduced before its final pass. Every rank launches the
        same number of blocks (from the longest shard), so the partials line up."""
        from gptcuda.ops.cuda import optim
        comm = self.comm
        part, G = optim.grad_norm_partial(self.rt, owned, blocks=optim.norm_blocks(n_max))
        self._call(lambda s: comm.all_reduce(part.ptr, part.ptr, G, "f64", "sum", s), "allreduce norm partials",
                   8 * G, side=False)
        optim.grad_norm_final(self.rt, part, G)

    # ---- eager -------------------------------------------------------------------------------
    def warmup(self, prog):
        """Run the program's collectives once, eagerly, before it is captured: NCCL connects its
        channels on first use, which must not happen inside a capture. Harmless on a fresh engine:
        the gradients are zero, and ZeRO's all-gather returns the parameters every rank already has."""
        from gptcuda.runtime import StreamCall
        dev, main = self.rt.dev, self.rt.stream
        self.rt.synchronize()
        for rec in prog.items:
            if isinstance(rec, StreamCall):
                stream = rec.side if rec.side is not None else main
                rec.call(int(stream))
                dev.sync(stream)                      # one collective at a time, as in the step

    def host_mean(self, values) -> list:
        """The mean over ranks of a few host numbers (evaluation losses), in float64."""
        a = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        if a.size > 24:
            raise ValueError(f"host_mean takes at most 24 numbers, got {a.size}")
        rt, ptr = self.rt, self._scratch + 64
        rt.synchronize()
        rt.dev.htod(ptr, a)
        self.comm.all_reduce(ptr, ptr, a.size, "f64", "sum", int(rt.stream))
        rt.synchronize()
        rt.dev.dtoh(a, ptr)
        return [float(x) / self.world for x in a]

    def any_of(self, flags) -> list[bool]:
        """For each flag: whether it is set on any rank (every rank calls this at the same point)."""
        return [m > 0 for m in self.host_mean([1.0 if f else 0.0 for f in flags])]

    def gather_optimizer_state(self):
        """ZeRO-1: every rank gets the whole Adam m and v (before a checkpoint); no-op otherwise."""
        if not self.zero:
            return
        sh, r, W, comm, s = self.shards, self.rank, self.world, self.comm, int(self.rt.stream)
        self.rt.synchronize()
        for region in (self.bufs.flat_m, self.bufs.flat_v):
            if sh.shard:
                comm.all_gather(region.ptr + 4 * r * sh.shard, region.ptr, sh.shard, "f32", s)
            if sh.tail:
                t = region.ptr + 4 * sh.even
                comm.broadcast(t, t, sh.tail, "f32", W - 1, s)
        self.rt.synchronize()

    def comm_times(self) -> dict:
        """After a step ran (and synchronised): ms of every timed collective, their sum ('busy': the
        communication stream's work) and 'exposed': how long the main stream waited at the join."""
        dev = self.rt.dev
        per = {label: dev.elapsed_ms(a, b) for label, a, b in self.timed}
        out = {"per_call": per, "busy": sum(per.values())}
        if self.marks:
            out["exposed"] = max(0.0, dev.elapsed_ms(*self.marks))
        return out

    def abort(self):
        self.group.abort()
