"""The ops: the interface the model is written against, and its two implementations.

    backend.py       `Ops` (the Protocol every backend implements), Program, Buffers
    cuda_backend.py  the CUDA backend: each op forwards to its family's launcher in cuda/
    cuda/            the launchers, one module per kernel file (kernels/<family>.cu), gemm/ a package
    reference/       float64 numpy ops (ops.py) and the reference backend: the ground truth

A new op: its signature in backend.py, its float64 op in reference/ops.py, its kernel in
kernels/<family>.cu and launcher in cuda/<family>.py (VARIANTS, workspace(cfg, ex)), registered in
cuda_backend.FAMILIES. A new dtype: a template parameter of the kernels, chosen by the execution plan
(gptcuda/runtime/execution.py), not a second family. README.md's Layout says more.
"""
