"""``python -m marlow ...`` runs the CLI: the form ``torchrun --nproc_per_node N -m marlow train
...`` (data parallel) needs."""

from marlow.cli import app

app(prog_name="marlow")
