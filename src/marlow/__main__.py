"""``python -m marlow ...`` runs the CLI: the form ``torchrun --nproc_per_node N -m marlow train
...`` (data parallel) needs."""

from marlow.cli import app

# The guard: a child process started with ``spawn`` (the vLLM rollout backend's engine) imports
# this module again as ``__mp_main__``, and must not run the command a second time.
if __name__ == "__main__":
    app(prog_name="marlow")
