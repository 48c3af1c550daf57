"""Training: a session on a backend, the loop around it, and its checks.

    engine.py      Engine: plan, allocate, initialise, record the programs, run steps and evaluations
    trainer.py     the loop behind train.py: logging, evaluation, checkpoints, resume, interrupts
    rundir.py      the run directory: does it hold a run, can it be written, its lock, metrics cut back
    interrupts.py  SIGINT / SIGTERM held back inside a step; in a data-parallel run, stopped by a vote
    gradcheck.py   finite-difference checks of the backward pass (gradcheck.py)
    hellaswag.py   HellaSwag's examples, token rows and scores by the forward program (eval.py, the loop)
    dashboards.py  TensorBoard and W&B logging of the metrics records, each optional
"""
