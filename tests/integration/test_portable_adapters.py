"""Portable adapters: a run's adapters load with plain transformers + PEFT in a
fresh process with marlow's cache gone, and give the trainer's logits bit for bit.

The run trains Voting-IP two steps on the shrunk tiny world; its logits on a few prompts, per
adapter, are saved by the test; a subprocess that never imports marlow, with ``MARLOW_CACHE``
pointing at a folder that does not exist and the hub offline, loads
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`` from the
``marlow export`` folder and from the run folder itself, and its logits must be *equal*: the
same float32 weights through the same kernels on one thread (max |diff| measured: 0.0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from marlow.cli import app
from marlow.policy.adapters import use_adapter
from marlow.training import runbase
from marlow.training.export import ExportError, export_run
from marlow.training.trainer import Trainer
from tests.conftest import shrunk_config
from tests.integration.reference import VOTING_IP, vary_rewards

SHORT_NAMES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
PROMPTS = ["what is 12+7?", "Candidates:\n1) 4\n2) 5\nPick one.", "3*(4-1)="]

# Runs in a fresh interpreter on transformers + peft alone; it checks that marlow never loaded.
LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    jobs, prompts, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    result = {}
    for key, base, adapter in jobs:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        model.eval()
        with torch.no_grad():
            result[key] = [model(input_ids=torch.tensor([ids])).logits[0] for ids in prompts]
        result[key + "/lora"] = sorted(n for n, _ in model.named_modules() if n.endswith("lora_A"))
    assert not any(m == "marlow" or m.startswith("marlow.") for m in sys.modules)
    torch.save(result, out)
    """
)


@pytest.fixture(scope="module")
def trained(tiny_cache, tmp_path_factory):
    """A 2-step Voting-IP run, and its trainer's logits per adapter on PROMPTS."""
    out = tmp_path_factory.mktemp("portable") / "run"
    trainer = vary_rewards(Trainer(shrunk_config(**{**VOTING_IP, "steps": 2}), out))
    trainer.run()
    prompts = [trainer.tokenizer(p)["input_ids"] for p in PROMPTS]
    model = trainer.model.eval()
    logits = {}
    with torch.no_grad():
        for name in trainer.adapters:
            with use_adapter(model, name):
                logits[name] = [model(input_ids=torch.tensor([ids])).logits[0] for ids in prompts]
    lora = sorted(n for n, _ in model.named_modules() if n.endswith("lora_A"))
    return out, prompts, logits, lora


def load_elsewhere(jobs: list, prompts: list, cwd: Path, tmp_path: Path) -> dict:
    """Run LOADER in a subprocess from ``cwd``, marlow's cache pointing nowhere."""
    out = tmp_path / "theirs.pt"
    env = {
        **os.environ,
        "MARLOW_CACHE": str(tmp_path / "deleted-cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(jobs), json.dumps(prompts), str(out)],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
    )
    assert not (tmp_path / "deleted-cache").exists()
    return torch.load(out)


def test_the_run_records_its_base_and_writes_portable_configs(trained, tiny_cache):
    run, *_ = trained
    record = json.loads((run / "base.json").read_text())
    assert record["name"] == "tiny-s" and record["kind"] == "tiny"
    assert record["adapter_base"] == "base"
    assert Path(record["path"]).parent == Path(tiny_cache)  # the cache folder it loaded from
    assert record["weights"] == runbase.weight_hashes(run / "base")  # the copy is the same
    assert sorted(p.name for p in (run / "base").iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for ckpt in (run / "checkpoints").iterdir():
        for name in ("aggregator", "generator"):
            config = json.loads((ckpt / "adapters" / name / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == "base"
            assert config["target_modules"] == SHORT_NAMES


def test_exported_adapters_reproduce_the_run_logits_without_marlow(trained, tmp_path):
    run, prompts, ours, lora = trained
    dest = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", str(run), str(dest)])
    assert result.exit_code == 0, result.output
    meta = json.loads((dest / "export.json").read_text())
    assert meta["step"] == 2 and meta["adapters"] == ["aggregator", "generator"]
    assert meta["dtype"] == "float32"
    assert sorted(p.name for p in dest.iterdir()) == [
        "adapters",
        "base",
        "config.yaml",
        "export.json",
        "workflow.yaml",  # what answering from the bundle reads
    ]
    ckpt = run / "checkpoints" / "step_000002" / "adapters"
    jobs = [[f"export/{a}", "base", f"adapters/{a}"] for a in ours]
    jobs += [[f"run/{a}", str(run / "base"), str(ckpt / a)] for a in ours]
    theirs = load_elsewhere(jobs, prompts, dest, tmp_path)
    for key, *_ in jobs:
        adapter = key.split("/")[1]
        assert theirs[key + "/lora"] == lora  # the short names pick the same modules
        for mine, other in zip(ours[adapter], theirs[key], strict=True):
            assert torch.equal(mine, other), (key, float((mine - other).abs().max()))
    # the adapters differ from each other, so the equality above is not vacuous
    assert not torch.equal(ours["aggregator"][0], ours["generator"][0])


def test_resume_refuses_a_base_whose_weights_changed(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    record = json.loads((run / "base.json").read_text())
    record["weights"]["model.safetensors"] = "0" * 64
    (run / "base.json").write_text(json.dumps(record))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["train", "--out", str(run), "--resume", "steps=3"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "base.json" in lines[0] and "has changed" in lines[0] and "000000000000" in lines[0]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_folder_base_is_named_by_path_and_copied_on_export(trained, tmp_path):
    """A local-folder base: the run names its absolute path and keeps no copy; the export copies
    it, and refuses once its weights change."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    folder = tmp_path / "my-model"
    shutil.move(run / "base", folder)
    config = (run / "config.yaml").read_text().replace("name: tiny-s", f"name: {folder}")
    (run / "config.yaml").write_text(config)
    (run / "base.json").unlink()
    cfg = shrunk_config(**{**VOTING_IP, "model": {"name": str(folder)}})
    runbase.record(run, cfg.model, cfg.task.name)
    record = json.loads((run / "base.json").read_text())
    assert record["kind"] == "folder" and record["adapter_base"] == str(folder)
    assert not (run / "base").exists()  # not copied into the run
    assert runbase.changed(run, cfg.model, cfg.task.name) is None

    export_run(run, tmp_path / "export")
    assert runbase.weight_hashes(tmp_path / "export" / "base") == record["weights"]
    adapter = tmp_path / "export" / "adapters" / "generator" / "adapter_config.json"
    assert json.loads(adapter.read_text())["base_model_name_or_path"] == "base"

    (folder / "model.safetensors").write_bytes(b"other weights")
    assert "has changed" in runbase.changed(run, cfg.model, cfg.task.name)
    with pytest.raises(ExportError, match="differ from those"):
        export_run(run, tmp_path / "export2")
    assert not (tmp_path / "export2").exists()
