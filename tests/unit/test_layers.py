"""Lower layers never import upper ones: each module below is imported alone, in a fresh
interpreter, and must not load any of the packages named beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RULES = {
    # a config is read and checked without torch (what names a loss imports it then)
    "marlow.config": ("marlow.workflows", "marlow.rollout", "marlow.training", "torch"),
    "marlow.registry": ("torch", "marlow.config"),
    "marlow.tiny.pretrain": ("marlow.rollout", "marlow.rewards", "marlow.workflows"),
    "marlow.tiny.codecorpus": ("marlow.rollout", "marlow.rewards", "marlow.workflows"),
    "marlow.diagnostics.signatures": ("marlow.workflows", "marlow.training", "marlow.report"),
    "marlow.diagnostics.detectors": ("marlow.workflows", "marlow.training", "marlow.report"),
    "marlow.report.figures": ("marlow.grids", "marlow.worlds", "marlow.training"),
    "marlow.algo.turn_advantages": ("marlow.training", "marlow.workflows", "marlow.types"),
    # a dry run: it builds the model on the meta device and attaches adapters, nothing else
    "marlow.plan": (
        "marlow.training",
        "marlow.rollout",
        "marlow.grids",
        "marlow.worlds",
        "marlow.report",
    ),
    # the distributed helpers sit under the trainer, beside the config
    "marlow.training.distributed": (
        "marlow.training.trainer",
        "marlow.workflows",
        "marlow.rollout",
    ),
}


@pytest.mark.parametrize("module", sorted(RULES))
def test_module_loads_nothing_above_it(module):
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert module in loaded  # the check itself sees what it imported
    above = [m for m in loaded if m.startswith(RULES[module])]
    assert above == [], f"{module} loads {above}"


def test_the_sandbox_and_its_pipes_share_their_limits_from_below_in_no_circle():
    """``marlow.rewards`` loads every grader when imported, so this reads the modules' imports."""
    import ast
    from pathlib import Path

    import marlow.rewards

    root = Path(marlow.rewards.__file__).parent

    def imports(name: str) -> set[str]:
        tree = ast.parse((root / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "marlow.rewards.sandbox" not in imports("_channel")
    assert {"marlow.rewards.sandbox", "marlow.rewards._channel"}.isdisjoint(imports("limits"))
    assert "marlow.rewards.limits" in imports("_channel") & imports("sandbox")


def test_importing_marlow_shortens_openmp_spinning_unless_the_user_chose():
    code = "import os, marlow; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True
    ).stdout.strip()
    assert run({}) == "1000"
    assert run({"GOMP_SPINCOUNT": "300000"}) == "300000"
    assert run({"OMP_WAIT_POLICY": "ACTIVE"}) == "None"  # a wait policy of the user's stands


def test_the_packages_and_modules_of_marlow_import_one_another_in_no_circle():
    """Rooms are the packages and modules at the top of ``marlow``; an arrow is any import of
    one room's module by another's, lazy ones inside functions included."""
    import ast
    from pathlib import Path

    import marlow

    root = Path(marlow.__file__).parent
    rooms = {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    arrows: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        here = path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            for name in named:
                parts = name.split(".")
                if parts[0] == "marlow" and len(parts) > 1 and parts[1] in rooms - {here}:
                    arrows.setdefault(here, set()).add(parts[1])

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in arrows.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted((a, b) for a, targets in arrows.items() for b in targets if a in reach(b))
    assert len(rooms) > 25 and sum(map(len, arrows.values())) > 100  # it sees the house
    assert circles == []
