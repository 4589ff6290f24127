"""The GRPO trainer: loop (trainer.py), update math (grpo.py), optimizers, checkpoints."""
