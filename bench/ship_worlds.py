"""Build the tiny worlds marlow ships (``src/marlow/tiny/worlds/``) with marlow's own pre-training.

    .venv/bin/python bench/ship_worlds.py                      # build all four, then ship them
    .venv/bin/python bench/ship_worlds.py --cache /tmp/built   # take those already built there
    .venv/bin/python bench/ship_worlds.py --only quick         # (re)ship one, keep the others

For each recipe of :data:`RECIPES` (the quickstart's tiny-s math world, the tiny preset's
tiny-s math and code worlds, and the tiny-m math world of the dose-response grid) it pre-trains the world in ``--cache`` (or finds it there: the
same code, the same key), measures its greedy generator on
:data:`marlow.worlds.verify.VERIFY_PROBLEMS` validation problems, copies the folder
into the package under its cache name and writes ``worlds.json`` (recipe, folder, the sha256 of
its weights, that accuracy, the kernel set and packages it was built with). Run it on a machine
whose torch kernels are the CPU's own (no ``ATEN_CPU_CAPABILITY``), then check each world with
``marlow pretrain-tiny --verify`` on the other kernel set (docs/benchmarks/worlds.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from marlow.fileio import sha256_file
from marlow.tiny import shipped
from marlow.tiny.pretrain import AVX2_ONLY, default_cache_dir, pretrain_tiny
from marlow.worlds.tinyeval import greedy_report
from marlow.worlds.verify import VERIFY_PROBLEMS

RECIPES = {  # name: (scale, task, steps, examples per step); None: the scale's full recipe
    "quick": ("tiny-s", "math", 4800, 8),  # the quickstart preset's
    "math": ("tiny-s", "math", None, None),  # the tiny preset's
    "code": ("tiny-s", "code", None, None),  # the tiny preset's code world
    "medium": ("tiny-m", "math", None, None),  # the dose-response grid's (tiny-dose.yaml)
}
WEIGHTS = "model.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="where to build")
    ap.add_argument("--only", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    args = ap.parse_args()
    if any(os.environ.get(name) for name in AVX2_ONLY):
        sys.exit(f"ship worlds built on the CPU's own kernels: unset {', '.join(AVX2_ONLY)}")
    rows = {w.folder: asdict(w) for w in shipped.shipped_worlds()}
    for name in args.only:
        scale, task, steps, batch = RECIPES[name]
        folder = pretrain_tiny(
            scale, steps=steps, batch=batch, task=task, cache_dir=args.cache, log=print
        )
        meta = json.loads((folder / "meta.json").read_text())
        accuracy = greedy_report(folder, task, VERIFY_PROBLEMS)["accuracy"]
        print(f"{folder.name}: greedy accuracy {accuracy:.3f} on {VERIFY_PROBLEMS}", flush=True)
        target = shipped.ROOT / folder.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(folder, target)
        target.chmod(0o755)  # the cache's temporary folder was private (mkdtemp): 0700 and 0600
        for file in target.iterdir():
            file.chmod(0o644)
        meta["path"] = folder.name  # not the builder's cache path
        (target / "meta.json").write_text(json.dumps(meta, indent=2))
        rows[folder.name] = {
            "folder": folder.name,
            "scale": scale,
            "task": task,
            "steps": meta["steps"],
            "batch": meta["batch_examples"],
            "seed": meta["seed"],
            "threads": meta["threads"],
            "weights": {WEIGHTS: sha256_file(target / WEIGHTS)},
            "greedy_accuracy": accuracy,
            "n_val": VERIFY_PROBLEMS,
            "built_on": f"{meta['cpu_capability']} kernels, {meta['threads']} threads, torch "
            f"{torch.__version__}, transformers {transformers.__version__}",
        }
    keep = [row for row in rows.values() if (shipped.ROOT / row["folder"]).is_dir()]
    manifest = json.dumps({"worlds": keep}, indent=2) + "\n"
    (shipped.ROOT / shipped.MANIFEST).write_text(manifest)
    for old in shipped.ROOT.iterdir():  # worlds of no recipe now (an earlier key)
        if old.is_dir() and old.name not in {row["folder"] for row in keep}:
            shutil.rmtree(old)
    print(f"{len(keep)} worlds shipped in {shipped.ROOT}")


if __name__ == "__main__":
    main()
