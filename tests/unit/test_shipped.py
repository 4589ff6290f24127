"""The shipped tiny worlds: their keys, their bytes, and how a run picks one (``model.world``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from marlow.config import ConfigError, resolve
from marlow.fileio import DamagedFileError
from marlow.models import ModelLoadError, load_base, tiny_world, tiny_world_folder
from marlow.tiny import pretrain, shipped
from marlow.worlds.quickstart import cell_configs
from marlow.worlds.verify import TOLERANCE, Verdict


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MARLOW_CACHE", str(root))
    return root


@pytest.fixture
def no_pretraining(monkeypatch):
    """Fails a test that would pre-train; records the recipes asked for instead."""
    asked = []

    def refuse(scale, **kwargs):
        asked.append((scale, kwargs))
        raise AssertionError(f"pre-trained {scale} {kwargs}")

    monkeypatch.setattr(pretrain, "pretrain_tiny", refuse)
    return asked


def test_every_shipped_world_sits_under_its_recipes_cache_name():
    """A recipe change that moves a key (corpus, templates, tokenizer, training constants) must
    ship the worlds again: bench/ship_worlds.py."""
    worlds = shipped.shipped_worlds()
    assert len(worlds) == 4
    for w in worlds:
        found = shipped.find_shipped(w.scale, steps=w.steps, batch=w.batch, task=w.task)
        assert found == w, f"{w.folder}: its recipe's key moved; run bench/ship_worlds.py"
        assert w.threads == pretrain.THREADS and w.seed == 0
        assert (shipped.ROOT / w.folder / "meta.json").is_file()


def test_shipped_weights_have_their_sha256():
    for w in shipped.shipped_worlds():
        assert shipped.checked(w) == shipped.ROOT / w.folder
        files = sorted(p.name for p in (shipped.ROOT / w.folder).glob("*.safetensors"))
        assert files == sorted(w.weights)


@pytest.mark.parametrize("task", ["math", "code"])
def test_the_quickstarts_and_the_tiny_presets_worlds_are_shipped(task):
    quick = next(iter(cell_configs(task=task).values())).model  # code: the tiny preset's world
    tiny = resolve({"preset": "tiny", "task": {"name": task}}).model
    for model in (quick, tiny):
        assert model.world == "auto"
        assert tiny_world_folder(model, task).parent == shipped.ROOT, (model, task)


def test_the_dose_grids_world_is_shipped(empty_cache, monkeypatch):
    """configs/grids/tiny-dose*.yaml run on tiny-m math: a fresh machine pre-trains nothing."""
    import multiprocessing

    from marlow.grids.grid import expand, load_grid
    from marlow.grids.pretraining import pretrain_worlds

    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("pre-trained"))
    grids = sorted((Path(__file__).parents[2] / "configs" / "grids").glob("tiny-dose*.yaml"))
    assert [g.name for g in grids] == ["tiny-dose-sweep.yaml", "tiny-dose.yaml"]
    for grid in grids:
        pretrain_worlds(expand(load_grid(grid)), log=pytest.fail)
    assert shipped.find_shipped("tiny-m") is not None


def test_a_run_loads_a_shipped_world_with_no_pretraining(empty_cache, no_pretraining):
    cfg = resolve({"preset": "quickstart"}).model
    model, tokenizer = load_base(cfg, task="math")
    assert model.config.hidden_size == 128 and tokenizer.eos_token == "<|im_end|>"
    assert no_pretraining == [] and not empty_cache.exists()


def test_rebuild_takes_the_cache_never_the_shipped_world(empty_cache, monkeypatch):
    """The same recipe, the same folder name (the key), two roots: neither shadows the other."""
    asked = []
    monkeypatch.setattr(pretrain, "pretrain_tiny", lambda *a, **k: asked.append((a, k)) or "built")
    cfg = resolve({"preset": "quickstart", "model": {"world": "rebuild"}}).model
    folder = tiny_world_folder(cfg, "math")
    shipped_folder = tiny_world_folder(cfg.model_copy(update={"world": "auto"}), "math")
    assert folder.parent == empty_cache and shipped_folder.parent == shipped.ROOT
    assert folder.name == shipped_folder.name
    assert tiny_world(cfg, "math") == "built"
    assert asked == [(("tiny-s",), {"log": None, "steps": 4800, "batch": 8, "task": "math"})]


def test_a_recipe_marlow_does_not_ship_is_pretrained_under_auto(empty_cache, no_pretraining):
    cfg = resolve({"preset": "tiny", "model": {"name": "tiny-l"}}).model
    assert tiny_world_folder(cfg).parent == empty_cache
    with pytest.raises(AssertionError, match="pre-trained tiny-l"):
        tiny_world(cfg)


def test_world_shipped_without_a_shipped_recipe_fails_in_one_line(empty_cache, no_pretraining):
    cfg = resolve({"preset": "tiny", "model": {"name": "tiny-l", "world": "shipped"}}).model
    with pytest.raises(ModelLoadError) as err:
        tiny_world(cfg)
    message = str(err.value)
    assert "\n" not in message and "model.world=auto" in message
    assert "tiny-s math (4800 steps x 8)" in message and "tiny-s code (1200 steps x 64)" in message


def test_a_damaged_shipped_file_is_a_one_line_error(tmp_path, monkeypatch, no_pretraining):
    copy = tmp_path / "worlds"
    shutil.copytree(shipped.ROOT, copy)
    monkeypatch.setattr(shipped, "ROOT", copy)
    cfg = resolve({"preset": "quickstart"}).model
    weights = tiny_world_folder(cfg, "math") / "model.safetensors"
    assert weights.parent.parent == copy
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError) as err:
        load_base(cfg, task="math")
    message = str(err.value)
    assert "\n" not in message and "damaged" in message and "model.world=rebuild" in message
    weights.unlink()
    with pytest.raises(DamagedFileError, match="is missing"):
        tiny_world(cfg)


def test_model_world_names_its_valid_values():
    with pytest.raises(ConfigError, match="model.world") as err:
        resolve({"preset": "tiny", "model": {"world": "fresh"}})
    assert all(name in str(err.value) for name in shipped.WORLDS)


def test_a_grid_pretrains_no_shipped_world(empty_cache, monkeypatch):
    import multiprocessing

    from marlow.grids.grid import expand
    from marlow.grids.pretraining import pretrain_worlds
    from marlow.worlds.quickstart import quickstart_grid

    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("pre-trained"))
    pretrain_worlds(expand(quickstart_grid(0, None, None, "math")), log=pytest.fail)
    pretrain_worlds(expand(quickstart_grid(0, None, None, "code")), log=pytest.fail)
    only_shipped = {"model": {"name": "tiny-l", "world": "shipped"}}  # its cells will fail alone
    pretrain_worlds(expand(quickstart_grid(0, None, only_shipped, "math")), log=pytest.fail)


def test_a_run_records_the_shipped_world_it_trains_on(empty_cache):
    from marlow.training.runbase import identify

    cfg = resolve({"preset": "quickstart"}).model
    found = identify(cfg, "math")
    world = shipped.find_shipped("tiny-s", steps=4800, batch=8)
    assert found.kind == "tiny" and found.path == str(shipped.ROOT / world.folder)
    assert found.weights == world.weights
    assert identify(cfg.model_copy(update={"world": "rebuild"}), "math") is None  # not built


def test_verdict_passes_within_the_tolerance_only():
    def verdict(shipped_acc: float, rebuilt_acc: float) -> Verdict:
        return Verdict("w", shipped_acc, rebuilt_acc, 500, False, "AVX2", "AVX512", 1.0)

    assert verdict(0.5, 0.5 + TOLERANCE).passed and verdict(0.5, 0.5 - TOLERANCE).passed
    assert not verdict(0.5, 0.5 + TOLERANCE + 0.002).passed
    assert verdict(0.5, 0.47).to_dict()["gap"] == pytest.approx(0.03)


def test_every_shipped_file_is_package_data():
    """pyproject's package-data globs take every file of every shipped world into a wheel (a
    wheel built on 2026-11-25 held them)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = globs["package-data"]["marlow"]
    package = shipped.ROOT.parents[1]  # src/marlow
    files = [p for p in shipped.ROOT.rglob("*") if p.is_file()]
    assert len(files) >= 1 + 7 * len(shipped.shipped_worlds())
    for file in files:
        name = file.relative_to(package).as_posix()
        assert any(fnmatch.fnmatchcase(name, g) for g in globs), name
