"""gptcuda: a GPT trainer on the CUDA driver API and NVRTC, every kernel its own.

The layers, from the bottom up (README "Layout"); a module imports from its own layer and the layers
below it, never above (tests/test_layers.py):

    files.py, errors.py, faults.py, config.py   atomic writes, the errors behind the scripts' one-line
                exits, fault injection, settings: they import no layer
    runtime/    driver calls, NVRTC and its cache, launches, programs, graphs; which kernels run
    model/      the parameter table, the memory plan, the model written once against the op interface,
                checkpoint files
    ops/        the op interface and its two backends: CUDA launchers (kernels/*.cu) and float64 numpy
    data/       tokenizers, token shards, splits, batches
    dist/       data parallel on NCCL (the Engine's DataParallel)
    interop/    Hugging Face and llm.c files, run directories read back (init_from, export, sampling)
    training/   the Engine (one session), the training loop, gradcheck
    generate/   generation on the device
    cli.py, launch.py   the scripts' arguments, --help and one-line exits; the multi-process launcher
"""
