"""A training run: the builder that makes its parts once, the step's phases and what survives a kill.

    trainer_builder.py       TrainerBuilder / build_trainer(): THE builder (tokenizer, policy, bounds,
                             rollout backend, token rule, loss), used by the train stage and the benches
    trainer.py               the step as phases -> typed records; validation; the loop with resume
    rollout_phase.py         phase 1: sample, score, gather rewards, group-relative advantages
    passes.py                phases 2 and 3: the no-grad passes and the update's micro-batches
    updater.py, zero.py      ONE updater interface: AdamW + gradient all-reduce; DeepSpeed ZeRO behind it
    metrics.py, step_loggers.py   each logged statistic declared once; the per-step loggers (dvclive, wandb)
    run_dir.py, checkpoint.py     the run directory and the shipped adapter; checksummed checkpoints
    run.py                   a whole run, ``run(params)`` (the train stage is this call)
    launcher.py              N processes through torch.distributed's launcher

May import: every package below it (grpo.core ... grpo.config).
"""
