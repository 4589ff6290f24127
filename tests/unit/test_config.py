import pytest

from marlow.config import ConfigError, load_config, parse_overrides, resolve


def test_presets_resolve_and_paper_matches_table_7():
    paper = resolve({"preset": "paper"})
    assert (paper.optim.lr, paper.optim.warmup_steps, paper.optim.grad_clip) == (2e-5, 15, 1.0)
    assert (paper.grpo.group_size, paper.grpo.batch_problems, paper.grpo.minibatch_turns) == (
        8,
        64,
        64,
    )
    assert (paper.grpo.clip_low, paper.grpo.clip_high) == (0.2, 0.28)
    assert (paper.policy.lora_rank, paper.policy.lora_alpha, paper.policy.lora_dropout) == (
        64,
        32,
        0.0,
    )
    assert paper.grpo.aggregation == "seq-mean-token-mean"
    assert (paper.steps, paper.val_every, paper.ckpt_every) == (500, 10, 5)
    assert (paper.rollout.temperature, paper.rollout.max_new_tokens) == (0.7, 5120)
    assert (paper.model.name, paper.dtype) == ("Qwen/Qwen3-1.7B", "bfloat16")
    assert resolve({}).preset == "tiny"
    assert (resolve({}).device, resolve({}).dtype) == ("auto", "float32")


def test_overrides_nest_and_parse_values():
    assert parse_overrides(
        ["optim.lr=1e-3", "workflow.name=voting", "grpo.same_role_weighting=true"]
    ) == {
        "optim": {"lr": 1e-3},
        "workflow": {"name": "voting"},
        "grpo": {"same_role_weighting": True},
    }
    cfg = load_config(None, ["optim.lr=0.5", "workflow.params={n: 5}"])
    assert cfg.optim.lr == 0.5 and cfg.workflow.params == {"n": 5}


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("grpo.clip_hgh=0.3", "'grpo.clip_hgh' is unknown; valid here: batch_problems"),
        ("lr=0.1", "'lr' is unknown; valid here: preset, seed"),
        ("grpo.aggregation=mean", "valid: token-mean, seq-mean-token-mean, seq-mean-token-sum"),
        ("policy.routing=shared", "'policy.routing'"),
        ("detect.on_alarm=panic", "'detect.on_alarm'"),
        ("preset=huge", "valid: paper, official, tiny"),
        ("optim.lr", "must look like key=value"),
        ("device=tpu", "'device': unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N, mps"),
        ("device=meta", "'device': unknown device 'meta'; valid: auto, cpu, cuda, cuda:N, mps"),
        ("device=cuda:-1", "'device': unknown device 'cuda:-1'; valid: auto"),
        ("dtype=float64", "'dtype': Input should be 'float32', 'bfloat16' or 'float16'"),
        ("model.dtype=bfloat16", "'model.dtype' is unknown; valid here: name, pretrain_steps"),
    ],
)
def test_bad_fields_fail_in_one_line_naming_them(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "workflow.name=debate",
            "'workflow.name': unknown workflow 'debate'; valid: eval_opt, orch_workers, single",
        ),
        (
            "workflow.params={m: 2}",
            "'workflow.params': workflow voting has no parameter m; valid: n",
        ),
        ("workflow.params={n: 0}", "'workflow.params': voting n must be >= 1, got 0"),
        ("grpo.role_weights={critic: 2}", "'grpo.role_weights' names critic"),
    ],
)
def test_workflow_fields_fail_in_one_line_where_workflows_are_built(override, needle):
    # config stays below the workflows layer: the registry is consulted by check_run_config
    from marlow.workflows.validate import check_run_config

    cfg = load_config(None, [override])
    with pytest.raises(ConfigError) as err:
        check_run_config(cfg)
    message = str(err.value)
    assert needle in message
    assert "\n" not in message


def test_dtype_and_device_are_top_level_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dtype: bfloat16\ndevice: cpu\nmodel: {name: tiny-s}\n")
    assert (load_config(path).dtype, load_config(path).device) == ("bfloat16", "cpu")


def test_yaml_file_layers_over_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: paper\nsteps: 7\ngrpo:\n  group_size: 4\n")
    cfg = load_config(path, ["grpo.batch_problems=2"])
    assert (cfg.steps, cfg.grpo.group_size, cfg.grpo.batch_problems, cfg.optim.lr) == (
        7,
        4,
        2,
        2e-5,
    )
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(path)


def test_shipped_configs_load():
    from pathlib import Path

    paths = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert len(paths) >= 2
    for path in paths:
        load_config(path)


def test_quickstart_cells_follow_the_chosen_tiny_scale():
    from marlow.worlds.quickstart import cell_configs

    cells = cell_configs(settings={"model": {"name": "tiny-m"}, "grpo": {"credit": "broadcast"}})
    assert sorted(cells) == sorted(
        f"{w}-tiny-m-Math"
        for w in ("Voting-Base", "Single-Base", "Single-SA", "Voting-IP", "Voting-SP")
    )
    assert all(c.model.name == "tiny-m" and c.grpo.credit == "broadcast" for c in cells.values())
    assert (
        cells["Voting-Base-tiny-m-Math"].steps == 0
        and cells["Voting-SP-tiny-m-Math"].policy.routing == "sp"
    )
    with pytest.raises(ConfigError, match="valid: tiny-s, tiny-m, tiny-l"):
        cell_configs(settings={"model": {"name": "Qwen/Qwen3-0.6B"}})


def test_the_quickstart_preset_is_the_tiny_one_on_a_quick_world_for_math_only():
    """Math: the tiny preset for 12 steps on tiny-s pre-trained with the quick recipe; code,
    another scale, or the run's own recipe: the full one."""
    from marlow.worlds.quickstart import cell_configs

    tiny, quick = resolve({}), resolve({"preset": "quickstart"})
    assert (quick.model.pretrain_batch, quick.model.pretrain_steps) == (8, 4800)
    assert (tiny.model.pretrain_batch, tiny.model.pretrain_steps) == (None, None)
    assert (quick.steps, quick.val_every, tiny.steps) == (12, 12, 24)
    assert (quick.optim.warmup_steps, tiny.optim.warmup_steps, quick.optim.lr) == (1, 3, 1e-3)
    same = ("rollout", "grpo", "policy", "task")
    assert all(getattr(quick, k) == getattr(tiny, k) for k in same)
    code = resolve({"preset": "quickstart", "task": {"name": "code"}})
    assert code == resolve({"task": {"name": "code"}}).model_copy(update={"preset": "quickstart"})
    cells = cell_configs()
    assert {(c.preset, c.model.pretrain_batch) for c in cells.values()} == {("quickstart", 8)}
    medium = cell_configs(settings={"model": {"name": "tiny-m"}})
    assert {c.model.pretrain_batch for c in medium.values()} == {None}
    own = cell_configs(settings={"model": {"name": "tiny-m", "pretrain_batch": 16}})
    assert {c.model.pretrain_batch for c in own.values()} == {16}


def test_a_preset_overlays_its_settings_for_the_task_under_the_run_own():
    # the tiny preset's code overlay: 200 validation problems and 128 new tokens (math: 500, 96)
    math, code = resolve({}), resolve({"task": {"name": "code"}})
    assert (math.task.val_size, math.rollout.max_new_tokens) == (500, 96)
    assert (code.task.val_size, code.rollout.max_new_tokens) == (200, 128)
    assert code.steps == math.steps == 24 and code.optim.lr == math.optim.lr == 1e-3
    mine = load_config(None, ["task.name=code", "task.val_size=9", "rollout.max_new_tokens=40"])
    assert (mine.task.val_size, mine.rollout.max_new_tokens) == (9, 40)  # the run's own win
    paper = resolve({"preset": "paper", "task": {"name": "code"}})  # the paper preset has none
    assert (paper.task.val_size, paper.rollout.max_new_tokens) == (500, 5120)
    for bad, needle in (({"task": "code"}, "'task'"), ({"preset": ["tiny"]}, "valid: paper")):
        with pytest.raises(ConfigError, match=needle):
            resolve(bad)


@pytest.mark.parametrize(
    "key",
    ["grpo.fold_lora", "grpo.activation_checkpointing", "rollout.merge_lora", "rollout.compile"],
)
def test_a_switch_set_on_the_command_line_reads_on_and_off_as_words(key):
    section, field = key.split(".")
    for word in ("on", "off", "auto"):  # YAML reads on and off as booleans
        cfg = resolve(parse_overrides([f"{key}={word}"]))
        assert getattr(getattr(cfg, section), field) == word
    with pytest.raises(ConfigError, match=f"config field '{key}': .*'auto', 'on' or 'off'"):
        resolve(parse_overrides([f"{key}=maybe"]))
