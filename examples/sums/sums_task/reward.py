"""The example task's reward, in TRL's form: the same function works as a ``reward_funcs`` entry
of TRL's GRPOTrainer.

``completions[i]`` is the text being graded (the workflow's final answer; under
``grpo.credit=role`` also each answer turn's own text), ``prompts[i]`` the question it answers,
and ``answer`` the dataset's ``answer`` column, aligned with them.
"""

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def exact_answer(prompts, completions, answer, **kwargs):
    """1.0 when the last \\boxed{...} holds the gold number, 0.0 when it holds another, -0.1
    when there is no box at all (so a well-formed wrong answer beats no answer)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        boxes = BOXED.findall(completion)
        if not boxes:
            rewards.append(-0.1)
        else:
            right = boxes[-1].strip() == str(gold).strip()
            rewards.append(1.0 if right else 0.0)
    return rewards
