"""The sums task as an installable package: ``pip install examples/sums`` publishes it under
marlow's entry-point group ``marlow.tasks``, and ``marlow train task.name=sums`` trains it with no
path to type. The settings are the ones ``examples/sums/config.yaml`` gives by hand."""

from importlib.resources import files

TASK = {
    "description": "arithmetic questions, graded by the exact boxed answer",
    "task": {
        "source": str(files(__name__) / "sums.jsonl"),
        "prompt_field": "question",
        "answer_field": "answer",
        "reward": "sums_task.reward:exact_answer",
        "val_size": 200,
    },
}
