"""Grid expansion and naming, bad grids, the runner's skip / retry / dependency logic (driven
here by an in-process pool that only pretends to train), and where the local pool's fork server
puts its socket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from marlow.config import ConfigError
from marlow.grids.grid import cell_name, expand, load_grid, parse_grid
from marlow.grids.pools import plan_workers
from marlow.grids.results_folder import GridIndex, last_step
from marlow.grids.runner import _drive
from marlow.types import BASE


def names(grid: dict) -> list[str]:
    return [c.name for c in expand(parse_grid(grid))]


def test_one_seed_grid_names_cells_as_the_spec_says():
    cells = expand(parse_grid({"workflows": ["voting"], "controls": ["base", "sa-rl"]}))
    assert [c.name for c in cells] == [
        "Voting-IP-tiny-s-Math",
        "Voting-SP-tiny-s-Math",
        "Single-SA-tiny-s-Math",
        "Single-Base-tiny-s-Math",
        "Voting-Base-tiny-s-Math",
    ]
    kinds = {c.name: (c.kind, c.config.policy.routing, c.config.steps) for c in cells}
    assert kinds["Voting-SP-tiny-s-Math"] == ("trained", "sp", 24)  # the tiny preset's steps
    assert kinds["Single-SA-tiny-s-Math"] == ("sa-rl", "ip", 24)
    assert kinds["Voting-Base-tiny-s-Math"] == ("base", "base", 0)


def test_axes_multiply_and_several_seeds_get_a_suffix():
    grid = {
        "workflows": ["voting", "eval_opt", "orch_workers"],
        "scales": ["tiny-s", "tiny-m"],
        "tasks": ["math", "code"],
        "seeds": [0, 1],
        "controls": [],
    }
    got = names(grid)
    assert len(got) == 3 * 2 * 2 * 2 * 2  # workflows x policies x scales x tasks x seeds
    assert "Orch-Workers-SP-tiny-m-Code-s1" in got and "Eval-Opt-IP-tiny-s-Math-s0" in got
    assert len(set(got)) == len(got)


def test_single_in_workflows_is_the_sa_rl_control_not_two_identical_runs():
    got = names({"workflows": ["single", "voting"], "controls": []})
    assert got == ["Voting-IP-tiny-s-Math", "Voting-SP-tiny-s-Math", "Single-SA-tiny-s-Math"]


def test_transfer_cells_put_the_sa_rl_adapter_on_the_generator_only():
    cells = expand(
        parse_grid({"workflows": ["eval_opt"], "seeds": [3, 4], "controls": ["transfer"]})
    )
    transfer = [c for c in cells if c.kind == "transfer"]
    assert [c.name for c in transfer] == [
        "Eval-Opt-Transfer-tiny-s-Math-s3",
        "Eval-Opt-Transfer-tiny-s-Math-s4",
    ]
    t = transfer[1]
    assert t.needs == ("Single-SA-tiny-s-Math-s4",) and t.config.steps == 0
    assert t.config.policy.routing == "map"
    assert t.config.policy.role_map == {"generator": "generator", "evaluator": BASE}
    assert "Single-SA-tiny-s-Math-s4" in [c.name for c in cells]  # transfer brings its SA-RL


def test_an_orch_workers_transfer_runs_every_role_on_the_base_and_needs_no_sa_rl():
    grid = parse_grid({"workflows": ["orch_workers"], "policies": [], "controls": ["transfer"]})
    (t,) = [c for c in expand(grid) if c.kind == "transfer"]
    assert t.name == "Orch-Workers-Transfer-tiny-s-Math" and t.needs == ()
    assert set(t.config.policy.role_map.values()) == {BASE}


def test_settings_layer_under_the_axes():
    cells = expand(
        parse_grid({"workflows": ["voting"], "seeds": [7], "settings": {"steps": 5, "seed": 1}})
    )
    assert all(c.config.steps in (5, 0) and c.config.seed == 7 for c in cells)


def test_hugging_face_scales_are_named_by_size():
    assert cell_name("voting", "ip", "Qwen/Qwen3-1.7B", "math", None) == "Voting-IP-1.7B-Math"
    assert cell_name("orch_workers", "sp", "tiny-l", "code", 2) == "Orch-Workers-SP-tiny-l-Code-s2"


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        ({"workflow": ["voting"]}, "grid key 'workflow' is unknown; valid: workflows, policies"),
        (
            {"workflows": ["debate"]},
            "unknown workflow 'debate'; valid: eval_opt, orch_workers, single, test_fix, voting, or "
            "the path",
        ),
        ({"policies": ["shared"]}, "grid key 'policies.0'"),
        ({"controls": ["oracle"]}, "grid key 'controls.0'"),
        (
            {"settings": {"optim": {"lr": -1}}},
            "cell Voting-IP-tiny-s-Math: config field 'optim.lr'",
        ),
        ({"scales": ["tiny-x"], "controls": []}, None),  # unknown model: caught when loading it
    ],
)
def test_bad_grids_fail_in_one_line_naming_the_key(grid, needle):
    if needle is None:
        assert names(grid) == ["Voting-IP-tiny-x-Math", "Voting-SP-tiny-x-Math"]
        return
    with pytest.raises(ConfigError) as err:
        expand(parse_grid(grid))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_load_grid_reads_yaml_and_rejects_a_missing_file(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("workflows: [voting]\npolicies: [sp]\ncontrols: []\n")
    assert [c.name for c in expand(load_grid(path))] == ["Voting-SP-tiny-s-Math"]
    with pytest.raises(FileNotFoundError):
        load_grid(tmp_path / "nope.yaml")


def test_workers_follow_cores_and_memory():
    cells = expand(parse_grid({"workflows": ["voting"], "seeds": [0, 1, 2]}))
    assert plan_workers(cells, cores=2, mem_gib=24) == 2
    assert plan_workers(cells, cores=16, mem_gib=24) == 12  # 24 * 0.8 / 1.5 GiB per tiny cell
    assert plan_workers(cells[:1], cores=16, mem_gib=24) == 1
    assert plan_workers(cells, cores=2, mem_gib=1) == 1


POOL_PROBE = """
import json, os, tempfile
from multiprocessing import util
from marlow.grids import pools
pools.PRELOAD.clear()  # a fork server that imports nothing: fast to start
pool = pools.LocalPool(1)
print(json.dumps({
    "method": pool._pool._mp_context.get_start_method(),
    "folder": util.get_temp_dir(),
    "tempdir": tempfile.gettempdir(),
    "other_process": pool._pool.submit(os.getpid).result() != os.getpid(),
}))
pool.close()
"""


@pytest.mark.parametrize("deep", [False, True], ids=["short-tmpdir", "deep-tmpdir"])
def test_the_local_pool_forks_its_cells_under_a_temp_folder_too_deep_for_a_socket(deep, tmp_path):
    """The fork server's socket goes in multiprocessing's pymp-* folder, made in the temporary
    folder: where that path is too long for a socket (a deep TMPDIR), the folder is made under
    /tmp instead, and only that folder: the process keeps its TMPDIR. Removed at exit."""
    tmpdir = tmp_path / ("d" * 80) if deep else Path(tempfile.mkdtemp(prefix="mp"))
    tmpdir.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            [sys.executable, "-c", POOL_PROBE],
            env={**os.environ, "TMPDIR": str(tmpdir)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["method"] == "forkserver" and seen["other_process"]
        assert seen["tempdir"] == str(tmpdir)
        folder = Path(seen["folder"])
        assert folder.parent == (Path("/tmp") if deep else tmpdir)
        assert folder.name.startswith("pymp-") and not folder.exists()
        assert not list(tmpdir.iterdir())
    finally:
        if not deep:
            shutil.rmtree(tmpdir)


def test_the_local_pool_spawns_its_cells_where_no_folder_holds_a_socket(monkeypatch):
    from marlow.grids import pools

    monkeypatch.setattr(pools, "socket_path_fits", lambda path: False)
    pool = pools.LocalPool(1)  # no process starts before a cell is submitted
    try:
        assert pool._pool._mp_context.get_start_method() == "spawn"
    finally:
        pool.close()


def test_a_local_ray_under_a_temp_folder_too_deep_for_its_sockets_keeps_its_files_in_tmp(
    monkeypatch,
):
    from marlow.grids.pools import _ray_folder

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/scratch/" + "j" * 40)  # Ray's folder would be TMPDIR/ray
    assert _ray_folder() == "/tmp/ray"
    monkeypatch.setenv("TMPDIR", "/scratch/job")
    assert _ray_folder() is None  # Ray's own choice fits
    monkeypatch.setenv("TMPDIR", "/scratch/" + "j" * 40)
    monkeypatch.setenv("RAY_TMPDIR", "/scratch/" + "j" * 40)
    assert _ray_folder() is None  # the user's own choice for Ray stands


class FakePool:
    """Runs 'cells' in-process: writes DONE, or raises for the names in ``fail``."""

    def __init__(self, results: GridIndex, fail: set[str], workers: int = 2) -> None:
        self.workers, self.results, self.fail = workers, results, fail
        self.submitted: list[str] = []
        self.peak = 0

    def submit(self, cell, args):
        self.submitted.append(cell.name)
        return cell.name

    def wait(self, handles, timeout):
        self.peak = max(self.peak, len(handles))
        return handles[:1]

    def result(self, name):
        if name in self.fail:
            raise RuntimeError(f"{name} broke\nsecond line")
        folder = self.results.dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "DONE").write_text('{"seconds": 2.4}')
        return name

    def close(self):
        pass


def drive(tmp_path, grid: dict, fail=(), done=()):
    spec = parse_grid(grid)
    cells = expand(spec)
    for name in done:
        (tmp_path / "cells" / name).mkdir(parents=True)
        (tmp_path / "cells" / name / "DONE").write_text("done\n")
    results = GridIndex(tmp_path, cells, spec)
    pool = FakePool(results, set(fail))
    pool.log = []
    todo = [c for c in cells if results.state[c.name] != "done"]
    _drive(pool, todo, results, 1, pool.log.append, None)
    index = json.loads((tmp_path / "index.json").read_text())["cells"]
    return pool, index


def test_finished_cells_are_skipped_and_the_rest_run_two_at_a_time(tmp_path):
    grid = {"workflows": ["voting"], "controls": ["base", "sa-rl"]}
    pool, index = drive(tmp_path, grid, done=["Voting-IP-tiny-s-Math", "Voting-Base-tiny-s-Math"])
    assert pool.submitted == [
        "Voting-SP-tiny-s-Math",
        "Single-SA-tiny-s-Math",
        "Single-Base-tiny-s-Math",
    ]
    assert pool.peak == 2
    assert {v["state"] for v in index.values()} == {"done"}
    assert index["Voting-SP-tiny-s-Math"]["seconds"] == 2.4
    assert index["Voting-IP-tiny-s-Math"]["seconds"] is None  # finished by an older marlow
    assert pool.log[0] == "[3/5] Voting-SP-tiny-s-Math: done in 2 s"


def test_a_failed_cell_does_not_stop_the_grid_and_blocks_its_transfers(tmp_path):
    grid = {"workflows": ["voting", "eval_opt"], "policies": ["ip"], "controls": ["transfer"]}
    pool, index = drive(tmp_path, grid, fail={"Single-SA-tiny-s-Math"})
    assert index["Single-SA-tiny-s-Math"]["state"] == "failed"
    assert index["Single-SA-tiny-s-Math"]["error"] == "RuntimeError: Single-SA-tiny-s-Math broke"
    for name in ("Voting-Transfer-tiny-s-Math", "Eval-Opt-Transfer-tiny-s-Math"):
        assert index[name]["state"] == "failed"
        assert index[name]["error"] == "needs Single-SA-tiny-s-Math, which failed"
        assert name not in pool.submitted
    assert index["Voting-IP-tiny-s-Math"]["state"] == "done"
    assert (tmp_path / "cells" / "Single-SA-tiny-s-Math" / "error.txt").exists()


def test_transfer_waits_for_its_sa_rl_cell(tmp_path):
    grid = {"workflows": ["voting"], "policies": [], "controls": ["transfer"]}
    pool, _ = drive(tmp_path, grid)
    assert pool.submitted == ["Single-SA-tiny-s-Math", "Voting-Transfer-tiny-s-Math"]


def test_shipped_grids_expand():
    from pathlib import Path

    grids = sorted((Path(__file__).parents[2] / "configs" / "grids").glob("*.yaml"))
    assert grids
    for path in grids:
        assert expand(load_grid(path))
    matrix = expand(load_grid(grids[[p.name for p in grids].index("tiny-matrix.yaml")]))
    assert len(matrix) == 168 and len({c.name for c in matrix}) == 168


def test_a_grid_refuses_a_folder_whose_cells_ran_under_other_settings(tmp_path):
    from marlow.config import dump_config
    from marlow.grids.runner import run_grid

    grid = {"workflows": ["voting"], "policies": ["ip"], "controls": [], "settings": {"steps": 8}}
    (cell,) = expand(parse_grid(grid))
    folder = tmp_path / "cells" / cell.name
    folder.mkdir(parents=True)
    older = cell.config.model_copy(update={"steps": 12})
    (folder / "config.yaml").write_text(dump_config(older))
    with pytest.raises(ConfigError, match=r"Voting-IP-tiny-s-Math \(steps: 12 -> 8\).*another"):
        run_grid(parse_grid(grid), tmp_path)
    assert not (tmp_path / "index.json").exists()  # nothing written
    (folder / "config.yaml").write_text(dump_config(cell.config))
    with pytest.raises(ConfigError, match="lr: 0.001 -> 0.0005"):
        run_grid(parse_grid({**grid, "settings": {"steps": 8, "optim": {"lr": 5e-4}}}), tmp_path)


def test_each_variant_is_the_whole_grid_under_its_settings():
    grid = parse_grid(
        {
            "workflows": ["voting"],
            "seeds": [0, 1],
            "controls": ["base", "sa-rl"],
            "settings": {"steps": 4, "optim": {"lr": 1e-3}},
            "variants": {
                "lr3e-3": {"optim": {"lr": 3e-3}},
                "kl": {"mitigate": {"kl_coef": {"generator": 0.1}}},
            },
        }
    )
    cells = {c.name: c for c in expand(grid)}
    assert len(cells) == 2 * 2 * (2 + 1 + 2)  # variants x seeds x (IP, SP, SA-RL, 2 bases)
    fast = cells["Voting-IP-tiny-s-Math-lr3e-3-s1"]
    assert fast.variant == "lr3e-3" and fast.config.optim.lr == 3e-3 and fast.config.steps == 4
    kl = cells["Single-SA-tiny-s-Math-kl-s0"]
    assert kl.config.optim.lr == 1e-3 and kl.config.mitigate.kl_coef == {"generator": 0.1}
    assert cells["Voting-Base-tiny-s-Math-kl-s0"].describe()["variant"] == "kl"
    plain = expand(parse_grid({"workflows": ["voting"]}))
    assert "variant" not in plain[0].describe() and plain[0].name == "Voting-IP-tiny-s-Math"


def test_a_variant_name_must_fit_in_a_cell_name():
    with pytest.raises(ConfigError, match="variant name 'lr 3e-3'"):
        parse_grid({"variants": {"lr 3e-3": {}}})
    with pytest.raises(ConfigError, match="optim.lrr"):
        expand(parse_grid({"variants": {"bad": {"optim": {"lrr": 1}}}}))


def test_exclude_drops_every_cell_matching_all_of_an_entrys_values():
    grid = {
        "workflows": ["voting", "eval_opt"],
        "scales": ["tiny-s", "tiny-m"],
        "tasks": ["math", "code"],
        "seeds": [0, 1],
        "controls": ["base"],
        "variants": {"a": {}, "b": {}},
    }
    full = set(names(grid))
    kept = set(
        names(
            {
                **grid,
                "exclude": [
                    {"scale": "tiny-m", "task": "code"},
                    {"workflow": "eval_opt", "task": "code", "variant": "b"},
                ],
            }
        )
    )
    dropped = full - kept
    assert kept < full
    # tiny-m code goes whole (trained and base cells, both variants); Eval-Opt code only in b
    assert {n for n in dropped if "tiny-m-Code" in n} == {n for n in full if "tiny-m-Code" in n}
    assert {n for n in dropped if "tiny-m-Code" not in n} == {
        f"Eval-Opt-{p}-tiny-s-Code-b-s{s}" for p in ("IP", "SP", "Base") for s in (0, 1)
    }
    assert "Eval-Opt-IP-tiny-s-Code-a-s1" in kept and "Voting-Base-tiny-s-Code-b-s0" in kept
    one = names({**grid, "exclude": [{"policy": "base"}, {"seed": 1}, {"variant": "b"}]})
    assert len(one) == 2 * 2 * 2 * 2 and not any("Base" in n or n.endswith("-s1") for n in one)


@pytest.mark.parametrize(
    ("exclude", "needle"),
    [
        ([{"scale": "tiny-x"}], "exclude[0].scale = 'tiny-x' is not on the grid; valid: tiny-s"),
        ([{"seed": "0"}], "exclude[0].seed = '0' is not on the grid; valid: 0"),
        ([{"variant": "lr"}], "valid: none (the grid has no such axis)"),
        ([{"scal": "tiny-s"}], "grid key 'exclude.0': Input should be 'workflow'"),
        ([{}], "exclude[0] is empty"),
        ([{"policy": "sa-rl"}], "exclude drops Single-SA-tiny-s-Math, which Voting-Transfer"),
    ],
)
def test_an_exclusion_off_the_grid_fails_in_one_line(exclude, needle):
    grid = {"workflows": ["voting"], "controls": ["transfer"], "exclude": exclude}
    with pytest.raises(ConfigError) as err:
        expand(parse_grid(grid))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cells_get_the_threads_asked_for_and_the_quickstart_asks_for_one(tmp_path, monkeypatch):
    """Per-cell torch threads: the caller's count, else the cores shared among the workers; the
    quickstart asks for one on every machine (thread counts change float sums, so its accuracies
    would differ between a 2-core and a 16-core machine)."""
    import os

    import marlow.grids.runner as runner
    import marlow.tiny.pretrain as pretrain
    import marlow.worlds.quickstart as quickstart

    seen: list[int] = []
    monkeypatch.setattr(runner, "pretrain_worlds", lambda _cells, _log: None)
    monkeypatch.setattr(
        runner, "_drive", lambda _pool, _todo, _index, threads, *_: seen.append(threads)
    )
    grid = {"workflows": ["voting"], "policies": ["ip"], "controls": [], "settings": {"steps": 8}}
    runner.run_grid(parse_grid(grid), tmp_path / "a", workers=1, threads=3)
    runner.run_grid(parse_grid(grid), tmp_path / "b", workers=1)
    assert seen == [3, max(1, os.cpu_count() or 1)]
    with pytest.raises(ValueError, match="threads per cell must be >= 1"):
        runner.run_grid(parse_grid(grid), tmp_path / "c", workers=1, threads=0)
    with pytest.raises(ValueError, match=r"workers \(cells at once\) must be >= 1, got 0"):
        runner.run_grid(parse_grid(grid), tmp_path / "c", workers=0)

    class Stop(Exception):
        pass

    def stub(_grid, _out, **kwargs):
        seen.append(kwargs["threads"])
        raise Stop

    monkeypatch.setattr(pretrain, "pretrain_tiny", lambda *a, **k: tmp_path)
    monkeypatch.setattr(quickstart, "run_grid", stub)
    with pytest.raises(Stop):
        quickstart.quickstart(tmp_path / "qs")
    assert seen[-1] == 1


@pytest.mark.parametrize(
    ("tail", "step"),
    [
        (b'{"step": 3, "loss": 1.0}\n', 3),
        (b'{"step": 4, "lo', 0),  # half-written: 0 while it is written
        (b"[1, 2]\n", 0),  # damaged: the cell's resume names it
        (b'{"loss": 1.0}\n', 0),
        (b"\xff\xfe\n", 0),
    ],
)
def test_a_cells_last_step_reads_its_last_record_whatever_it_holds(tmp_path, tail, step):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 2}\n' + tail)
    assert last_step(tmp_path) == step
