"""Training: a session on a backend, the loop around it, and its checks.

    engine.py      Engine: plan, allocate, initialise, record the programs, run steps and evaluations
    trainer.py     the loop behind train.py: logging, evaluation, checkpoints, resume, interrupts
    gradcheck.py   finite-difference checks of the backward pass (gradcheck.py)
"""
