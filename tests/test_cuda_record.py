"""Record the CUDA backend's whole training step on a machine without a GPU.

A fake runtime (tests/fakes.py: a Runtime over a fake device) checks that every kernel the launchers ask for is a listed variant (each launcher's
VARIANTS, all compiled by tests/test_compiler.py) and packs every argument block, but hands out fake
device addresses and launches nothing. This runs
the model's launch sequence, the launchers' shape checks, argument typing and workspace
lookups for each precision and attention kind, so a mistake there shows in CI, not on the GPU.
Every launch's arguments are checked against the kernel's parameters as its source declares them
(the check a real runtime makes with cuFuncGetParamInfo)."""
import itertools

import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.ops.cuda_backend import CudaBackend
from gptcuda.training.engine import Engine
from gptcuda.runtime import Launch
from tests.fakes import RecordingRuntime

pytest.importorskip("cuda.bindings.nvrtc")


CASES = [c + (r,) for c in itertools.product(["fp32", "tf32"], ["unfused", "fused"], [0.0, 0.1], [True, False])
         for r in (False, True)]


@pytest.mark.parametrize("precision,attention,dropout,bias,recompute", CASES)
def test_record_whole_training_step(precision, attention, dropout, bias, recompute):
    cfg = load_config("configs/tiny.yaml", [f"--precision={precision}", f"--attention={attention}",
                                            f"--dropout={dropout}", f"--bias={str(bias).lower()}",
                                            f"--recompute={str(recompute).lower()}"])
    rt = RecordingRuntime(cfg)
    be = CudaBackend(cfg, rt=rt)
    toks = np.arange(1000, dtype=np.int32) % 65
    eng = Engine(cfg, toks, toks[:200], 65, backend=be, programs=("train", "eval"))
    n = len(eng.programs["train"])
    L = cfg.n_layer
    assert n > 20 * L, n                    # every layer's forward and backward was recorded
    labels = [getattr(r, "label", "") for r in eng.programs["train"].items]
    assert labels[0].startswith("lr_schedule") or "lr" in labels[0]
    # recompute (fp32, tf32): the GELU output rebuilt by a gelu pass after each dgelu product
    gelu = [getattr(r, "label", "") for r in eng.programs["train"].items].count("gelu_fwd")
    assert gelu == (L if recompute else 0), gelu
    for rec in eng.programs["train"].items:
        if isinstance(rec, Launch):
            assert rec.grid[0] <= 2**31 - 1 and rec.grid[1] <= 65535 and rec.grid[2] <= 65535, rec.label
            assert rec.block[0] * rec.block[1] * rec.block[2] <= 1024, rec.label


def test_record_training_step_with_accumulation():
    """total_batch_tokens = 3 micro-batches: three forwards and backwards in one program, the first two
    summed into grad_acc, the last adding it into the gradients before one optimizer update; the
    host feeds all three micro-batches' ids in one pair of copies before the program runs."""
    cfg = load_config("configs/tiny.yaml", ["--total_batch_tokens=" + str(3 * 4 * 16), "--batch_size=4",
                                            "--block_size=16", "--precision=tf32", "--attention=fused"])
    rt = RecordingRuntime(cfg)
    be = CudaBackend(cfg, rt=rt)
    toks = np.arange(1000, dtype=np.int32) % 65
    eng = Engine(cfg, toks, toks[:200], 128, backend=be, programs=("train",), n_vocab=65, accum=3)
    labels = [getattr(r, "label", "") for r in eng.programs["train"].items]
    assert labels.count("accumulate") == 3 and labels.count("adamw") == 1
    assert labels.count("encoder_fwd") == 3 and labels.count("loss_reduce") == 1
    acc = eng.bufs.acts["grad_acc"]
    accs = [r for r in eng.programs["train"].items if getattr(r, "label", "") == "accumulate"]
    assert [int(a.slots[0]) for a in accs] == [acc.ptr, acc.ptr, eng.bufs.flat_grads.ptr]
    ce = [r for r in eng.programs["train"].items if getattr(r, "label", "") == "crossentropy"]
    assert len(ce) == 3 and all(c.slots[5] == 128 and c.slots[6] == 65 for c in ce)   # row length V, n_vocab
    eng.train_step()
    idx, tg = eng.bufs.acts["idx"], eng.bufs.acts["targets"]
    assert rt.dev.copies[-2:] == [(idx.ptr, idx.nbytes), (tg.ptr, tg.nbytes)]


def test_graphs_leave_the_live_list_once_destroyed():
    # bench/tune.py destroys its graphs one by one; Runtime.destroy_graphs (run before an NCCL
    # communicator is closed) frees the rest, each exactly once
    from gptcuda.ops.backend import Program
    from gptcuda.runtime import Graph
    rt = RecordingRuntime("fp32")
    graphs = [Graph(rt, f"g{i}", f"e{i}", Program(f"p{i}")) for i in range(3)]
    rt._graphs.extend(graphs)
    graphs[1].destroy()
    graphs[1].destroy()
    assert rt._graphs == [graphs[0], graphs[2]] and rt.dev.destroyed == ["e1"]
    rt.destroy_graphs()
    assert rt._graphs == [] and sorted(rt.dev.destroyed) == ["e0", "e1", "e2"]
    with pytest.raises(RuntimeError, match="destroyed"):
        graphs[0].launch()


def test_launch_arguments_checked_against_the_kernel():
    """A launch whose arguments disagree with the kernel's parameters (count or size) is an error
    naming the kernel, raised when the launch is recorded; unknown parameters go unchecked."""
    from gptcuda.runtime import Function, Launch, i32, u64
    fn = Function(None, "k", "x.cu", params=(8, 4))
    Launch(fn, (1,), (32,), [None, i32(3)], 0, "k")
    with pytest.raises(ValueError, match=r"x.cu:k takes 2 parameters of \[8, 4\] bytes; the launch passes 3"):
        Launch(fn, (1,), (32,), [None, i32(3), i32(4)], 0, "k")
    with pytest.raises(ValueError, match="passes 2 of \\[8, 8\\]"):
        Launch(fn, (1,), (32,), [None, u64(3)], 0, "k")
    Launch(Function(None, "k", "x.cu"), (1,), (32,), [None, u64(3), i32(1)], 0, "k")


def test_crossentropy_kernel_choice():
    """loss.crossentropy's kernel by row length and alignment: the warp kernel up to WARP_MAX_V, then the
    row-in-registers kernel (smallest NV4 with NV4 * 2048 >= V) where V % 4 == 0 and the rows are
    16-byte aligned, crossentropy_block otherwise (and past the largest NV4); bf16 rows of V % 8 == 0 go
    to shared memory (crossentropy_smem) where they fit."""
    from gptcuda.ops.cuda import loss as L
    from gptcuda.runtime import DeviceView
    rt = RecordingRuntime("fp32")

    def choice(V, grad=True, n_vocab=None, shift=(0, 0), inplace=False, dtype="f32"):
        logits = rt.empty((3, V), dtype)
        logits = DeviceView(logits.ptr + shift[0], logits.shape, dtype)
        d = rt.empty((3, V), dtype)
        d = logits if inplace else DeviceView(d.ptr + shift[1], d.shape, dtype)
        L.crossentropy(rt, rt.empty((3,)), d if grad else None, logits, rt.empty((3,), "i32"),
                       0.5 if grad else 0.0, n_vocab=n_vocab)
        rec = rt.launched[-1]
        assert rec.grid == (1 if rec.fn.name.startswith("crossentropy_warp") else 3, 1, 1), rec.grid
        return rec.fn.name, rec.block[0]

    assert choice(1024) == (L.ce_name("warp", True), L.THREADS)
    assert choice(1028) == (L.ce_name("rows", True, 8), L.ROWS_THREADS)
    assert choice(1025) == (L.ce_name("block", True), L.THREADS)
    assert choice(16384, grad=False) == (L.ce_name("rows", False, 8), L.ROWS_THREADS)
    assert choice(16388) == (L.ce_name("rows", True, 16), L.ROWS_THREADS)
    assert choice(50304, n_vocab=50257) == (L.ce_name("rows", True, 25), L.ROWS_THREADS)
    assert choice(50304, inplace=True) == (L.ce_name("rows", True, 25), L.ROWS_THREADS)
    assert choice(51200) == (L.ce_name("rows", True, 25), L.ROWS_THREADS)
    assert choice(51204) == (L.ce_name("rows", True, 28), L.ROWS_THREADS)
    assert choice(2048 * max(L.ROWS_NV4)) == (L.ce_name("rows", True, 28), L.ROWS_THREADS)
    assert choice(2048 * max(L.ROWS_NV4) + 4) == (L.ce_name("block", True), L.THREADS)
    assert choice(50257) == (L.ce_name("block", True), L.THREADS)
    assert choice(50304, shift=(4, 0)) == (L.ce_name("block", True), L.THREADS)
    assert choice(50304, shift=(0, 8)) == (L.ce_name("block", True), L.THREADS)
    assert choice(50304, shift=(4, 0), inplace=True) == (L.ce_name("block", True), L.THREADS)
    assert choice(50304, grad=False, shift=(4, 0)) == (L.ce_name("block", False), L.THREADS)
    assert choice(50304, grad=False, shift=(0, 4)) == (L.ce_name("rows", False, 25), L.ROWS_THREADS)
    # bf16: V % 8 == 0 with 16-byte aligned rows up to SMEM_ROW_MAX bytes: the row in shared memory
    smem = L.ce_name("smem", True, dtype="bf16")
    assert choice(50304, n_vocab=50257, dtype="bf16") == (smem, L.ROWS_THREADS)
    assert choice(50304, inplace=True, dtype="bf16") == (smem, L.ROWS_THREADS)
    assert choice(L.SMEM_ROW_MAX // 2, dtype="bf16") == (smem, L.ROWS_THREADS)
    assert choice(L.SMEM_ROW_MAX // 2 + 8, dtype="bf16") == (L.ce_name("block", True, dtype="bf16"), L.THREADS)
    assert choice(1028, dtype="bf16") == (L.ce_name("rows", True, 8, "bf16"), L.ROWS_THREADS)
    assert choice(50304, shift=(8, 8), dtype="bf16") == (L.ce_name("rows", True, 25, "bf16"), L.ROWS_THREADS)
    assert choice(50304, grad=False, shift=(0, 8), dtype="bf16") == (L.ce_name("smem", False, dtype="bf16"),
                                                                     L.ROWS_THREADS)
    assert rt.launched[-1].smem == 2 * 50304


@pytest.mark.parametrize("dropout,bias,recompute", [(0.0, True, "false"), (0.1, True, "false"), (0.1, False, "true"),
                                                    (0.0, True, "1")])
def test_record_bf16_training_step(dropout, bias, recompute):
    """precision bf16: the step's first launch makes the bf16 working copy of the parameters, every product
    runs on the bf16 family (gemm_wgmma_ws or gemm_wgmma_pp with DT 1; a layer's weight and input gradients
    as one gemm_wgmma_dual) over bf16 activations, the attention on fp32 copies of qkv and y (accumulate's
    converting variants), and AdamW updates the fp32 parameters."""
    cfg = load_config("configs/tiny.yaml", ["--precision=bf16", "--attention=fused", f"--dropout={dropout}",
                                            f"--bias={str(bias).lower()}", f"--recompute={recompute}",
                                            "--vocab_multiple=8"])
    rt = RecordingRuntime(cfg)
    be = CudaBackend(cfg, rt=rt)
    toks = np.arange(1000, dtype=np.int32) % 65
    eng = Engine(cfg, toks, toks[:200], 72, backend=be, programs=("train", "eval"), n_vocab=65)
    items = [r for r in eng.programs["train"].items if isinstance(r, Launch)]
    assert items[0].fn.name.startswith("to_bf16")
    products = [r.fn.name for r in items if r.fn.name.startswith("gemm")]
    assert products and all(n.startswith(("gemm_wgmma_ws<", "gemm_wgmma_pp<")) and ",1," in n or
                            n.startswith("gemm_wgmma_dual<") for n in products
                            if not n.startswith("gemm_splitk_reduce")), products
    # recompute: the dgelu products rebuild the GELU output in their epilogue (code 5), no gelu pass;
    # an integer: the first that many layers (the backward's last dgelu products), the others store it
    epis = [n.split("<")[1].split(",")[3] for n in products if n.startswith("gemm_wgmma")]
    rebuilt = {"false": 0, "true": cfg.n_layer, "1": 1}[recompute]
    assert [e for e in epis if e in "45"] == ["4"] * (cfg.n_layer - rebuilt) + ["5"] * rebuilt, epis
    assert not any(r.fn.name.startswith("gelu_fwd") for r in items)
    # the pairs: fc, the attention projection and qkv in every layer, fcproj where the GELU output is stored
    # (a rebuilt one is the dgelu product's output, which dW fcproj reads after it)
    assert sum(n.startswith("gemm_wgmma_dual<") for n in products) == 4 * cfg.n_layer - rebuilt
    assert eng.bufs.acts["qkv"].dtype == eng.bufs.acts["res"].dtype == "bf16"
    assert eng.bufs.acts["ln1_mean"].dtype == eng.bufs.flat_grads.dtype == "f32"
    # AdamW writes the working copy too (adamw_copy sets work_fresh), and the next program's to_bf16 does
    # nothing then (its step-state argument: tests/gpu/test_optim.py)
    assert [r.fn.name.split("<")[0] for r in items].count("adamw_copy") == 1
    assert items[0].slots[-1] == rt.state.ptr and items[0].fn.name.split("<")[0] == "to_bf16"
    evals = [r for r in eng.programs["eval_val"].items if isinstance(r, Launch)]
    assert evals[0].fn.name.startswith("to_bf16")


def test_record_bf16_grad_pairs_off(monkeypatch):
    """GPTCUDA_GRAD_PAIRS=0: a layer's weight and input gradients are two products again (no gemm_wgmma_dual),
    the input gradient first; the plan says so."""
    monkeypatch.setenv("GPTCUDA_GRAD_PAIRS", "0")
    cfg = load_config("configs/tiny.yaml", ["--precision=bf16", "--attention=fused", "--vocab_multiple=8"])
    rt = RecordingRuntime(cfg)
    assert not rt.exec.grad_pairs and "GPTCUDA_GRAD_PAIRS=0" in rt.exec.format()
    eng = Engine(cfg, np.arange(1000, dtype=np.int32) % 65, np.arange(200, dtype=np.int32) % 65, 72,
                 backend=CudaBackend(cfg, rt=rt), programs=("train",), n_vocab=65)
    names = [r.fn.name for r in eng.programs["train"].items if isinstance(r, Launch)]
    assert names and not any(n.startswith("gemm_wgmma_dual") for n in names)
    monkeypatch.delenv("GPTCUDA_GRAD_PAIRS")
    assert RecordingRuntime(cfg).exec.grad_pairs


def test_record_bf16_flash_walks_at_long_sequences():
    """At T >= 1024 (head size 64) all three bf16 flash kernels walk their work items: a grid of one block an
    SM (the runtime's count) where the items outnumber the SMs, B*H and the items their last arguments."""
    cfg = load_config("configs/tiny.yaml", ["--precision=bf16", "--attention=fused", "--n_embd=128", "--n_head=2",
                                            "--vocab_multiple=8", "--block_size=1024", "--batch_size=12"])
    rt = RecordingRuntime(cfg)
    eng = Engine(cfg, np.arange(40000, dtype=np.int32) % 65, np.arange(20000, dtype=np.int32) % 65, 72,
                 backend=CudaBackend(cfg, rt=rt), programs=("train",), n_vocab=65)
    att = [r for r in eng.programs["train"].items if isinstance(r, Launch) and r.fn.name.startswith("flash")]
    BH = cfg.batch_size * cfg.n_head
    assert len(att) == 3 * cfg.n_layer
    for r in att:
        rows = 128 if r.fn.name.startswith("flash_bwd_dkv") else 192           # dK/dV 192 items, the others 144
        assert BH * -(-1024 // rows) > 132 and r.grid == (132, 1, 1), (r.fn.name, r.grid)
        assert (int(r.slots[-2]), int(r.slots[-1])) == (BH, BH * -(-1024 // rows))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_record_bf16_step_on_flash_bf16(dropout):
    """precision bf16 at head size 64: the attention is flash_bf16's three kernels, with no fp32 copies of
    qkv and y around it and no rowsum pass (dQ's kernel writes D = rowsum(dO * O), which dK / dV's, after it,
    reads); a flash_bf16 plan refuses fp32 tensors in one line."""
    from gptcuda.ops.cuda import attention as attn
    cfg = load_config("configs/tiny.yaml", ["--precision=bf16", "--attention=fused", f"--dropout={dropout}",
                                            "--n_embd=128", "--n_head=2", "--vocab_multiple=8"])
    rt = RecordingRuntime(cfg)
    eng = Engine(cfg, np.arange(1000, dtype=np.int32) % 65, np.arange(200, dtype=np.int32) % 65, 72,
                 backend=CudaBackend(cfg, rt=rt), programs=("train",), n_vocab=65)
    names = [r.fn.name for r in eng.programs["train"].items if isinstance(r, Launch)]
    att = [n.split("<")[0] for n in names if n.startswith("flash")]
    L = cfg.n_layer
    assert att.count("flash_fwd_bf16") == att.count("flash_bwd_dq_bf16") == att.count("flash_bwd_dkv_bf16") == L
    assert "flash_rowsum_do" not in att
    bwd = [r for r in eng.programs["train"].items if isinstance(r, Launch) and r.fn.name.startswith("flash_bwd")]
    assert [r.fn.name.split("<")[0] for r in bwd] == ["flash_bwd_dq_bf16", "flash_bwd_dkv_bf16"] * L
    assert all(dq.slots[7] == dkv.slots[9] == rt.workspace("attention_d").ptr for dq, dkv in zip(bwd[::2], bwd[1::2]))
    # dK/dV walks its work items (b*H + h, key tile): a grid of one block an SM at most, B*H and the items its
    # last arguments; at T 16 the forward and dQ take an item a block (pipelined, and walking, at T >= 1024)
    items = cfg.batch_size * cfg.n_head * -(-cfg.block_size // 128)
    assert all(dkv.grid == (min(items, 132), 1, 1) for dkv in bwd[1::2])
    fwd = [r for r in eng.programs["train"].items if isinstance(r, Launch) and r.fn.name.startswith("flash_fwd")]
    assert all(r.grid == (items, 1, 1) for r in fwd + bwd[::2])
    assert not any("_tc<" in n for n in names) and "attention_f32" not in rt._workspace
    assert all(f"<64,{'true' if dropout else 'false'}," in n for n in names if n.startswith("flash") and "_bf16<" in n)
    saved = {"lse": rt.empty((2, 2, 16))}
    qkv, y = rt.empty((2, 16, 384)), rt.empty((2, 16, 128))
    with pytest.raises(TypeError, match="bf16 flash kernels take bf16"):
        attn.attention_fwd(rt, y, qkv, saved, 2, 0.0, 0, eng.exec)


@pytest.mark.parametrize("accum,grad_pairs", [(1, "1"), (1, "0"), (2, "1")])
def test_record_bf16_gradients(monkeypatch, accum, grad_pairs):
    """grad_dtype bf16: the gradient region is bf16 (half the bytes) and every writer of it is a bf16 variant:
    the weight gradients' products (a bf16 C: gemm_wgmma_ws / _pp OUT 1, gemm_wgmma_dual OUT_W 1, or fp32 split-K
    partials and gemm_splitk_reduce OUT 1), the row sums (layernorm and bias gradients: sum_rows TO 1), the
    embedding's (encoder TG 1); the norm and AdamW read bf16 (TG 1). With micro-batches the last one's
    gradients are added into the fp32 grad_acc, which the norm and AdamW read."""
    monkeypatch.setenv("GPTCUDA_GRAD_PAIRS", grad_pairs)
    n_tok = 4 * 16
    cfg = load_config("configs/tiny.yaml", ["--precision=bf16", "--attention=fused", "--vocab_multiple=8",
                                            "--grad_dtype=bf16", "--batch_size=4", "--block_size=16",
                                            f"--total_batch_tokens={accum * n_tok}"])
    rt = RecordingRuntime(cfg)
    assert rt.exec.grads_bf16 and "bf16 gradients" in rt.exec.format()
    eng = Engine(cfg, np.arange(1000, dtype=np.int32) % 65, np.arange(200, dtype=np.int32) % 65, 72,
                 backend=CudaBackend(cfg, rt=rt), programs=("train",), n_vocab=65, accum=accum)
    g = eng.bufs.flat_grads
    assert g.dtype == "bf16" and eng.plan.bytes_of("grads") == 2 * eng.table.total
    assert eng.bufs.flat_m.ptr == g.ptr + eng.plan.bytes_of("grads") and eng.bufs.flat_m.ptr % 16 == 0
    assert all(v.dtype == "bf16" for v in eng.bufs.grads.values())
    items = [r for r in eng.programs["train"].items if isinstance(r, Launch)]
    names = [r.fn.name for r in items]
    lo, hi = g.ptr, g.ptr + g.nbytes

    def targs(name):                 # a name expression's template arguments
        return [a.strip() for a in name.split("<", 1)[1].rstrip(">").split(",")]

    def bf16_variant(name):          # the C / output element type argument of each kernel that writes gradients
        a = targs(name)
        if name.startswith(("gemm_wgmma_ws<", "gemm_wgmma_pp<")):
            return a[10] == "1"                       # OUT (after DT, MN_A, MN_B)
        return a[-1] == "1"                           # OUT_W, OUT, TO, TG: the last

    # every launch whose first argument (its output) lies in the gradient region is a bf16 variant
    writers = [r.fn.name for r in items if isinstance(r.slots[0], (int, np.integer)) and lo <= int(r.slots[0]) < hi]
    assert any(n.startswith(("gemm_wgmma", "gemm_splitk")) for n in writers) and all(map(bf16_variant, writers)), \
        writers
    sums = [n for n in names if n.startswith("sum_rows")]      # (their outputs ride in the SumBatch argument)
    assert sums and all(targs(n)[-1] == "1" for n in sums), sums
    assert any(n.startswith("encoder_bwd_wpe<") and targs(n)[-2:] == ["1", "1"] for n in names)
    final = eng.bufs.acts["grad_acc"] if accum > 1 else g
    norm = [r for r in items if r.fn.name.startswith("grad_norm_partial")]
    adam = [r for r in items if r.fn.name.startswith("adamw")]
    assert len(norm) == len(adam) == 1 and int(norm[0].slots[1]) == int(adam[0].slots[1]) == final.ptr
    assert (len(targs(norm[0].fn.name)) == 3) == (len(targs(adam[0].fn.name)) == 3) == (accum == 1)  # TG 1
    if accum > 1:                # each micro-batch's bf16 gradients added into the fp32 sum, the last one's too
        accs = [r for r in items if r.fn.name.startswith("accumulate") and int(r.slots[1]) == g.ptr]
        assert [(int(a.slots[0]), int(a.slots[1])) for a in accs] == [(final.ptr, g.ptr)] * accum
        assert all(targs(a.fn.name)[-2:] == ["0", "1"] for a in accs)
