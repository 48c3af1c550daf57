"""The ops: the interface the model is written against, and its two implementations.

    backend.py       `Ops` (the Protocol every backend implements), Program, Buffers
    cuda_backend.py  the CUDA backend: each op forwards to its family's launcher in cuda/
    cuda/            the launchers, one module per kernel file (kernels/<family>.cu), gemm/ a package
    reference/       float64 numpy ops (ops.py) and the reference backend: the ground truth
"""
