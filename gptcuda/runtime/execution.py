"""The execution plan: which kernels run, decided once, from the config, the device and the environment.

    plan = resolve(cfg, arch="sm_90")       # pure: no GPU touched (train.py --plan uses sm_90)
    print(plan.format())                    # the block train.py logs and saves as execution.json

The rules, in one place:

- GEMMs. `precision` picks the base family: fp32 -> SIMT FFMA (kernels/gemm_simt.cu), tf32 ->
  mma.sync tensor cores (kernels/gemm_tf32.cu). On sm_90 (`wgmma`; GPTCUDA_WGMMA=0 turns it off) the
  warpgroup-MMA kernels (kernels/gemm_wgmma.cu, TMA-fed) compete for every product whose layout they
  run, directly or after a re-layout into scratch: x @ W^T directly, dY @ W through a transposed
  copy of W ("gemm_bT"), the weight gradient dY^T @ X with dY read as stored through registers
  (families wgmma_ra*: X as stored, or X^T, or the swapped product's dY^T, in "gemm_aT"). Each TF32 layout has a warp-specialized, persistent TMA kernel among its tiles
  (gemm_wgmma_ws). fp32 with fp32_gemm 3xtf32 (`fp32_as_3xtf32`) runs those products, for aligned
  operands, as three TF32 products of hi / lo splits made in the kernel (family wgmma3_ra: A in the
  consumers' registers, B in shared memory); fp32_gemm ffma keeps every fp32 product on SIMT. bf16
  (sm_90 only) has one family: the persistent TMA kernel with bf16 operands, every layout read as
  stored, C bf16 or (weight gradients) fp32; its activations and their gradients are bf16
  (`act_dtype`), parameters, statistics and losses fp32, the products reading a bf16 working copy of
  the parameters; the parameters' gradients fp32, or bf16 with the config's grad_dtype bf16
  (`grads_bf16`: the weight gradients' products and every other writer round to bf16 once).
  Within what may run, a product's kernel, tile and split-K come from the measured table of this GPU
  and these kernel sources (<compile cache>/tune/, gemm/table.py), else from the cost model
  (gptcuda/ops/cuda/gemm/plan.py `plan`), which also sizes the scratch in the memory plan (gemm/plan.py
  `workspace`). `gemm_tune` (the config's key; the environment's GPTCUDA_GEMM_TUNE overrides it: 0 or
  off, table, auto) says how: "auto" (the default) measures the shapes of the run that the table
  lacks when the Engine is set up (gemm/tune.py `autotune`: a first run on a GPU; never in a
  data-parallel run), then reads the table; "table" reads it as it is (bench/tune.py, or an earlier
  run, wrote it); "off" leaves it unread (`gemm_table` False): the cost model alone. A shape is
  measured once and its entry never changes, so a resumed run launches the plans it launched (bf16
  shapes are timed on bf16 operands, under their own key prefix).
- Attention. `attention: unfused` saves the [B, H, T, T] probabilities (kernels/attention.cu);
  `fused` runs flash attention (kernels/flash_*.cu) saving the log-sum-exp: in tf32 on
  tensor cores (`flash_tc`: the _tc kernels, dK/dV on warpgroup MMA (_wg) up to head size 64 where
  wgmma is on); in fp32 as 3xTF32 on tensor cores where `fp32_as_3xtf32` holds (`flash_3x`: the _x3
  kernels, hi / lo splits at fragment load, as the fp32 GEMMs), else in FFMA (`flash`: fp32_gemm ffma,
  or no wgmma); in bf16 (fused only) `flash_bf16` (flash_bf16.cu: bf16 operands on warpgroup MMA with
  TMA, head sizes FLASH_BF16_HEAD_SIZES), at other head sizes the tf32 flash kernels on fp32 copies of
  qkv and y (attention.py).
- Generation (sample.py) runs its own products: kernels/decode.cu decode_linear for up to 16 rows,
  the GEMMs above beyond; in bf16 with bf16 operands (a working copy of the weights made once) and a
  bf16 KV cache, the bf16 family writing qkv, the residual stream and the logits in fp32.

- Derived here too: whether the memory plan holds the warpgroup-MMA scratch (`wgmma_scratch`), the products'
  mode on those kernels (`wgmma_mode`), flash_tc's dK / dV on warpgroup MMA (`dkv_on_wgmma`), where
  recompute's backward rebuilds the GELU output (`gelu_in_dgelu`: the bf16 dgelu product's epilogue, else a
  gelu pass), whether a layer's weight and input gradients share a launch (`grad_pairs`: bf16, unless
  GPTCUDA_GRAD_PAIRS=0), the peak rate MFU divides by (`peak_tflops`: of what actually multiplies), the GEMM table's
  key prefix.

The runtime is built with its plan (Runtime(cfg=...): resolved once, for its device) and passes it to
the launchers that choose by it (gemm.matmul / matmul_batched, attention_fwd / _bwd read `rt.exec`,
or an `ex=` given). Nothing else reads the config's precision, fp32_gemm or attention, or the
environment's switches.
"""
from __future__ import annotations

import dataclasses
import os

WGMMA_ARCHS = ("sm_90",)
ENV_KEYS = ("GPTCUDA_WGMMA", "GPTCUDA_GEMM_TUNE", "GPTCUDA_GRAD_PAIRS")
GEMM_TUNES = ("auto", "table", "off")
_TUNE_ENV = {"0": "off", "off": "off", "table": "table", "auto": "auto"}     # GPTCUDA_GEMM_TUNE -> gemm_tune
# bf16: activations in bf16, products on the BF16 warpgroup-MMA kernel (sm_90), fp32 master parameters,
# gradients, statistics and sums
PRECISIONS = ("fp32", "tf32", "bf16")
GEMM_FAMILIES = {"fp32": "simt", "tf32": "tf32", "bf16": "bf16"}      # precision -> the base GEMM family
FP32_GEMMS = ("3xtf32", "ffma")
ATTENTION_PATHS = ("unfused", "flash", "flash_tc", "flash_3x", "flash_bf16")
# head sizes of the bf16 flash kernels (flash_bf16); bf16 at other head sizes runs flash_tc on fp32 copies
FLASH_BF16_HEAD_SIZES = (64, 128)
# head sizes whose flash_tc dK / dV backward runs on warpgroup MMA (flash_bwd_dkv_wg)
FLASH_WG_HEAD_SIZES = (32, 64)
# dense peak rates of the H100 / H200 SXM (datasheet), TFLOP/s, by what multiplies: the MFU denominator
PEAK_TFLOPS = {"ffma": 67.0, "tf32": 495.0, "3xtf32": 495.0 / 3, "bf16": 989.0}


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    arch: str                 # the device's ("sm_90"); "cpu" for the reference backend
    precision: str            # fp32 | tf32 | bf16 (reference: float64)
    fp32_gemm: str            # how fp32 multiplies where it may: 3xtf32 | ffma (the config's)
    gemm_family: str          # the base GEMM family: simt | tf32 | bf16
    wgmma: bool               # the warpgroup-MMA kernels compete (sm_90, GPTCUDA_WGMMA != 0)
    gemm_tune: str            # the measured GEMM table: auto (measure what it lacks) | table | off
    attention: str | None     # unfused | flash | flash_tc | flash_3x (None: a runtime not built from a config)
    env: tuple = ()           # (name, value) of each environment variable read
    grad_dtype: str = "f32"   # the parameters' gradients (the config's grad_dtype): f32, or bf16 (precision bf16)

    @property
    def gemm_table(self) -> bool:
        """The measured GEMM table is consulted (gemm_tune auto or table)."""
        return self.gemm_tune != "off"

    @property
    def fp32_as_3xtf32(self) -> bool:
        """fp32 products may run as 3xTF32 on the warpgroup-MMA kernels."""
        return self.precision == "fp32" and self.fp32_gemm == "3xtf32" and self.wgmma

    @property
    def wgmma_mode(self) -> str | None:
        """How products run on the warpgroup-MMA kernels beside the base family: "tf32", "3xtf32" (fp32 as
        three TF32 products of hi / lo halves), or None (they do not: no sm_90, GPTCUDA_WGMMA=0, fp32_gemm
        ffma; bf16, whose base family is the warpgroup-MMA kernel itself)."""
        if not self.wgmma:
            return None
        return "tf32" if self.precision == "tf32" else "3xtf32" if self.fp32_as_3xtf32 else None

    @property
    def wgmma_scratch(self) -> bool:
        """The memory plan holds the warpgroup-MMA kernels' scratch (gemm/plan.py `workspace` sizes it:
        gemm_bT, gemm_aT, operands re-laid out for TF32). Planned from the config alone, so a plan made
        without the GPU (train.py --plan) is the one the GPU runs; a device without the kernels leaves
        it unallocated (gemm.device_workspaces)."""
        return self.precision == "tf32"

    @property
    def act_dtype(self) -> str:
        """The dtype of the activations and their gradients the memory plan holds: bf16 for precision
        bf16 (the statistics, losses and parameters stay fp32; their gradients are grad_dtype's), else fp32."""
        return "bf16" if self.precision == "bf16" else "f32"

    @property
    def grads_bf16(self) -> bool:
        """The parameters' gradients are bf16 (grad_dtype bf16): every writer rounds its fp32 sum once, the
        weight gradients' products store a bf16 C (their split-K reduction too), the norm and AdamW read
        bf16; micro-batches add into the fp32 grad_acc, which the norm and AdamW then read."""
        return self.grad_dtype == "bf16"

    @property
    def table_tag(self) -> str:
        """The measured GEMM table's key prefix (gemm/table.py table_key): the precision's products."""
        return self.precision

    @property
    def check_tolerance(self) -> float:
        """Largest relative difference between two correct candidate plans of one product (gemm/tune.py
        checks each against the cost model's): TF32 truncating (wgmma) against rounding (mma.sync)
        operands ~1e-3; fp32 (SIMT against 3xTF32) ~1e-7; bf16 outputs rounded to within 2^-8 of a value."""
        return {"tf32": 2e-3, "bf16": 1e-2}.get(self.precision, 1e-5)

    @property
    def peak_tflops(self) -> float:
        """The MFU denominator: the dense rate of what multiplies here: TF32 tensor cores, fp32 as
        3xTF32 (a third of TF32's, above the FMA rate) where the warpgroup-MMA kernels run it, else the
        FMA units (fp32_gemm ffma, GPTCUDA_WGMMA=0, a device without them)."""
        if self.precision in ("tf32", "bf16"):
            return PEAK_TFLOPS[self.precision]
        return PEAK_TFLOPS["3xtf32" if self.fp32_as_3xtf32 else "ffma"]

    @property
    def gelu_in_dgelu(self) -> bool:
        """recompute's backward rebuilds the GELU output in the dgelu product's epilogue (matmul epilogue
        dgelu_gelu: the bf16 family's kernels, the bits of the forward's GELU), else in a gelu pass after
        that product."""
        return self.gemm_family == "bf16"

    @property
    def grad_pairs(self) -> bool:
        """A layer's weight and input gradients, which read the same dY, run as one launch (bf16:
        gemm_wgmma_dual, gemm/launch.py matmul_pair), unless GPTCUDA_GRAD_PAIRS=0: two products."""
        return self.gemm_family == "bf16" and dict(self.env).get("GPTCUDA_GRAD_PAIRS", "1").strip() != "0"

    def dkv_on_wgmma(self, head_size: int) -> bool:
        """flash_tc's dK / dV backward runs on warpgroup MMA (flash_bwd_dkv_wg) at this head size (a
        runtime's plan without an attention path: where its precision's fused path is flash_tc)."""
        return (self.attention != "unfused" and self.fused_path() == "flash_tc" and self.wgmma
                and head_size in FLASH_WG_HEAD_SIZES)

    def fused_path(self) -> str:
        """The fused attention kernels this plan's precision runs (the attention path itself where
        the plan has one)."""
        if self.attention not in (None, "unfused"):
            return self.attention
        return fused_path(self.precision, self.fp32_as_3xtf32)

    def with_precision(self, precision: str) -> "ExecutionPlan":
        """The same plan at another precision (benchmarks and tests compare the two)."""
        if precision == self.precision:
            return self
        return resolve(arch=self.arch, precision=precision, attention=_kind(self.attention),
                       fp32_gemm=self.fp32_gemm, gemm_tune=self.gemm_tune, env=dict(self.env))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["env"] = dict(self.env)
        d["fp32_as_3xtf32"] = self.fp32_as_3xtf32
        d["gemm_table"] = self.gemm_table
        return d

    def format(self) -> str:
        if self.arch == "cpu":
            return "execution plan\n  reference backend: float64 numpy ops (gptcuda/ops/reference/ops.py)"
        fam = {"simt": "SIMT FFMA (gemm_simt.cu)", "tf32": "TF32 mma.sync (gemm_tf32.cu)",
               "bf16": "BF16 warpgroup MMA (gemm_wgmma.cu gemm_wgmma_ws), every layout as stored"}[self.gemm_family]
        if not self.wgmma:
            wg = "off" + ("" if self.arch in WGMMA_ARCHS else f" (not on {self.arch})")
        elif self.precision == "tf32":
            wg = ("on (gemm_wgmma.cu): x @ W^T direct, dY @ W via gemm_bT, dW with dY through registers "
                  "(wgmma_ra*, X^T or dY^T via gemm_aT)")
        elif self.precision == "bf16":
            wg = ("on: the base family (bf16 activations, fp32 master weights and statistics, "
                  + ("bf16 gradients); " if self.grads_bf16 else "fp32 gradients); ")
                  + ("a layer's dW and dX in one launch (gemm_wgmma_dual)" if self.grad_pairs
                     else "dW and dX apart (GPTCUDA_GRAD_PAIRS=0)"))
        elif self.fp32_as_3xtf32:
            wg = "on as 3xTF32 (gemm_wgmma.cu): x @ W^T, dY @ W and dW, aligned operands read as stored"
        else:
            wg = "not for fp32 (fp32_gemm ffma)"
        att = {"unfused": "unfused: saved probabilities (attention.cu)",
               "flash": "flash, FFMA (flash_simt.cu)",
               "flash_3x": "flash on tensor cores as 3xTF32 (flash_x3.cu)",
               "flash_bf16": "flash in bf16 on warpgroup MMA and TMA (flash_bf16.cu)",
               "flash_tc": "flash on tensor cores (flash_tc.cu" + ("; dK/dV on warpgroup MMA up to head size 64: flash_wg.cu)"
                                                                           if self.wgmma else ")")
                           + (", on fp32 copies of the bf16 qkv and y" if self.precision == "bf16" else ""),
               None: "as the saved tensors say"}[self.attention]
        env = ", ".join(f"{k}={v}" for k, v in self.env) or "none set"
        return "\n".join([
            "execution plan",
            f"  device               {self.arch}",
            f"  GEMM base family     {fam}",
            f"  warpgroup MMA        {wg}",
            f"  tiles and split-K    {_TUNE_TEXT[self.gemm_tune]}",
            f"  attention            {att}",
            f"  environment          {env}",
        ])


_TUNE_TEXT = {
    "auto": "the measured table (<compile cache>/tune/; gemm_tune auto: a single-GPU run measures the shapes "
            "it lacks at setup), else the cost model (ops/cuda/gemm/plan.py)",
    "table": "the measured table (<compile cache>/tune/; gemm_tune table: as it is) where it has the shape, "
             "else the cost model (ops/cuda/gemm/plan.py)",
    "off": "the cost model (ops/cuda/gemm/plan.py; gemm_tune off: no table)",
}


def fused_path(precision: str, as_3xtf32: bool, head_size: int | None = None) -> str:
    """The fused attention path of a precision: tf32 -> flash_tc; fp32 -> flash_3x where fp32 products
    run as 3xTF32 (ExecutionPlan.fp32_as_3xtf32), else flash (FFMA); bf16 -> flash_bf16 at its head
    sizes (FLASH_BF16_HEAD_SIZES), else (or head size unknown) flash_tc on fp32 copies of qkv and y."""
    if precision == "tf32":
        return "flash_tc"
    if precision == "bf16":
        return "flash_bf16" if head_size in FLASH_BF16_HEAD_SIZES else "flash_tc"
    return "flash_3x" if as_3xtf32 else "flash"


def _kind(path):
    return None if path is None else ("unfused" if path == "unfused" else "fused")


def resolve(cfg=None, arch: str | None = "sm_90", env=None, *, precision=None, fp32_gemm=None,
            attention=None, gemm_tune=None, grad_dtype=None) -> ExecutionPlan:
    """The plan for cfg (or for the keyword settings of a runtime built without one: gemm_tune
    "table", as nothing measures for it) on a device of `arch`, with the environment `env` (default
    os.environ)."""
    env = os.environ if env is None else env
    if cfg is not None:
        if cfg.backend == "reference":
            return ExecutionPlan("cpu", "float64", "", "", False, "off", None)
        # (the config's grad_dtype bf16 counts at precision bf16 only: sample.py --precision fp32 on such a run)
        grad_dtype = grad_dtype or ("bf16" if getattr(cfg, "grad_dtype", "fp32") == "bf16" and
                                    (precision or cfg.precision) == "bf16" else "f32")
        precision = precision or cfg.precision
        fp32_gemm = fp32_gemm or cfg.fp32_gemm
        attention = attention or cfg.attention
        gemm_tune = gemm_tune or cfg.gemm_tune
    precision = precision or "fp32"
    fp32_gemm = fp32_gemm or "3xtf32"
    grad_dtype = grad_dtype or "f32"
    # the environment overrides the config (GPTCUDA_GEMM_TUNE=0 has always meant: no table)
    gemm_tune = _TUNE_ENV.get(env.get("GPTCUDA_GEMM_TUNE", "").strip().lower()) or gemm_tune or "table"
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} ({' | '.join(PRECISIONS)})")
    if fp32_gemm not in FP32_GEMMS:
        raise ValueError(f"unknown fp32_gemm {fp32_gemm!r} (3xtf32 | ffma)")
    if gemm_tune not in GEMM_TUNES:
        raise ValueError(f"unknown gemm_tune {gemm_tune!r} (auto | table | off)")
    read = tuple((k, env[k]) for k in ENV_KEYS if k in env)
    wgmma = arch in WGMMA_ARCHS and env.get("GPTCUDA_WGMMA", "1") != "0"
    if precision == "bf16" and not wgmma and arch != "cpu":
        raise ValueError(f"precision bf16 runs on the warpgroup-MMA kernels: an sm_90 device (this one: {arch}) "
                         f"with GPTCUDA_WGMMA unset or 1")
    if grad_dtype not in ("f32", "bf16") or (grad_dtype == "bf16" and precision != "bf16"):
        raise ValueError(f"grad_dtype {grad_dtype!r}: f32, or bf16 with precision bf16 (got {precision!r})")
    plan = ExecutionPlan(arch or "?", precision, fp32_gemm, GEMM_FAMILIES[precision], wgmma, gemm_tune, None,
                         read, grad_dtype)
    if attention is not None:
        if precision == "bf16" and attention == "unfused":
            raise ValueError("precision bf16 runs fused attention only (attention: fused)")
        hs = cfg.n_embd // cfg.n_head if cfg is not None and cfg.n_head else None
        path = "unfused" if attention == "unfused" else fused_path(precision, plan.fp32_as_3xtf32, hs)
        plan = dataclasses.replace(plan, attention=path)
    return plan
