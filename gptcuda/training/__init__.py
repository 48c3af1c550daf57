"""Training: a session on a backend, the loop around it, and its files.

    engine.py      Engine: plan, allocate, initialise, record the programs, run steps and evaluations
    trainer.py     the loop behind train.py: logging, evaluation, checkpoints, resume, interrupts
    checkpoint.py  checkpoint files (written through gptcuda/files.py atomic_open)
    gradcheck.py   finite-difference checks of the backward pass (gradcheck.py)
"""
