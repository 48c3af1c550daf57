"""gptcuda: a GPT trainer on the CUDA driver API and NVRTC, every kernel its own.

The layers, from the device up (README "Layout"):

    runtime/    driver calls, NVRTC and its cache, launches, programs, graphs; which kernels run
    model/      the parameter table, the memory plan, the model written once against the op interface
    ops/        the op interface and its two backends: CUDA launchers (kernels/*.cu) and float64 numpy
    data/       tokenizers, token shards, splits, batches
    training/   the Engine (one session), the training loop, checkpoints, gradcheck
    generate/   generation on the device;  interop/  Hugging Face and llm.c files;  dist/  data parallel
    config.py, cli.py, files.py, faults.py   settings, the scripts' errors, atomic writes, fault injection
"""
