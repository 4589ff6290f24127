"""The GRPO trainer: loop (trainer.py), update math (grpo.py), optimizers, checkpoints, and what
a run folder holds (runfolder.py)."""
