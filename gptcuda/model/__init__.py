"""The model, independent of any backend.

    params.py   the one parameter table (names, shapes, offsets in the flat buffer) and initialisation
    memory.py   the static memory plan: every activation, gradient and scratch buffer of a step
    gpt.py      GPT: forward, backward, the training step and the decode step, written once against
                the op interface (gptcuda/ops/backend.py)
    products.py the matrix products a config's GPT runs (what the GEMM layer plans and measures)
    state.py    the StepState the captured step reads and writes on the device
    rng.py      the counter-based RNG shared bit for bit by the kernels and the reference
    checkpoint.py  checkpoint files: named arrays and JSON metadata, checksummed (written by training,
                read by interop and generation; through gptcuda/files.py atomic_open)
"""
