"""Training configuration: YAML + overrides, every bad field explained at once."""
import pytest

from qurl_mcore.config import Config, ConfigError, load_config, to_dict


def test_defaults_yaml_and_overrides_layer_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 5\nprecision: fp8\nrollout:\n  samples_per_prompt: 8\ntrain:\n  lr: 2.0e-6\n")
    cfg = load_config(path, ["train.lr=3e-6", "rollout.temperature=0.6", "uaq.scale=2"])
    assert cfg.steps == 5 and cfg.precision == "fp8" and cfg.rollout.samples_per_prompt == 8
    assert cfg.train.lr == 3e-6 and cfg.rollout.temperature == 0.6
    assert cfg.uaq.scale == 2.0 and isinstance(cfg.uaq.scale, float)
    assert cfg.train.loss == "acr"  # untouched default
    assert to_dict(cfg)["precision"] == "fp8"
    assert load_config() == Config()


def test_every_problem_is_reported_with_its_name(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stepz: 3\nprecision: int4\nrollout:\n  samples_per_prompt: 0\ntrain:\n  lr: fast\n"
                    "  dynamic_sampling: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["uaq.enabled=maybe", "nonsense"])
    text = str(err.value)
    assert "7 problem(s) in" in text
    assert "uaq.enabled: expected true or false, got 'maybe'" in text
    assert "stepz: unknown field (did you mean steps?)" in text
    assert ("precision: 'int4' is not one of ['bf16', 'int8', 'fp8', 'fp8_e2e', 'fp4', 'fp4_rc', 'fp4_rc_rollout', "
            "'fp4_rc_train']") in text
    assert "rollout.samples_per_prompt: must be positive, got 0" in text
    assert "train.lr: expected float, got str 'fast'" in text
    assert "train.dynamic_sampling: expected true or false, got 1" in text
    assert "override 'nonsense': expected key=value" in text


def test_field_ranges():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.eps_low=1", "train.eps_high=-0.1", "train.kl_coef=-1", "train.grad_clip=-1",
                           "rollout.top_p=0", "rollout.top_k=0", "train.tis_cap=0.5", "rollout.temperature=-1",
                           "train.lr=.nan"])
    text = str(err.value)
    assert "9 problem(s)" in text
    for line in ("train.eps_low: must be in [0, 1), got 1.0", "train.eps_high: must be in [0, 10], got -0.1",
                 "train.kl_coef: must be in [0, 100]", "train.grad_clip: must be in [0, 10000]", "rollout.top_p: must be in (0, 1]",
                 "rollout.top_k: must be -1 (off) or a positive count, got 0", "train.tis_cap: must be in [1, 10000]",
                 "rollout.temperature: must be in [0, 10]", "train.lr: must be in (0, 1], got nan"):
        assert line in text, line


def test_moved_fields_say_where_they_went():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.precision=int8", "train.recipe=fp4_rc", "rollout.scope=all"])
    text = str(err.value)
    assert "rollout.precision: moved to the top-level field precision" in text
    assert "train.recipe: moved to the top-level field precision" in text
    assert "rollout.scope: moved to the top-level field scope" in text


def test_cross_field_rules_are_preflights():
    """Rules between fields are checked by `qurl train --check`'s preflight, each with its fix."""
    from qurl_mcore.preflight import preflight

    assert "data.path: task 'file' needs" in preflight(load_config(None, ["data.task=file"])).report()
    assert "grpo compares samples" in preflight(load_config(None, ["rollout.samples_per_prompt=1"])).report()
    text = preflight(load_config(None, ["precision=fp4_rc_train"])).report()
    assert "uaq.enabled: UAQ rescales the weights that a quantized rollout re-quantizes, for precision int8 (scope " \
           "all), fp8 (scope all), fp4 (scope experts), fp4_rc (scope experts); not precision 'fp4_rc_train': set " \
           "uaq.enabled=false" in text
    assert preflight(load_config(None, ["precision=fp4_rc_train", "uaq.enabled=false"])).ok
    text = preflight(load_config(None, ["precision=fp4_rc", "scope=all"])).report()
    assert "uaq.enabled: UAQ on precision 'fp4_rc' rescales scope experts only, and scope all also quantizes " \
           "['attention', 'shared_experts']: set scope=experts, or uaq.enabled=false" in text
    checked = preflight(load_config(None, ["precision=fp4_rc"]))
    assert checked.ok and "uaq         on, s = 1.5, scope experts" in checked.report()
    int8_experts = preflight(load_config(None, ["precision=int8", "scope=experts"]))
    assert "uaq         on, s = 1.5, scope all" in int8_experts.report()  # QuRL's UAQ rescales every linear


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "sec.yaml").write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train: expected a mapping of TrainConfig fields"):
        load_config(tmp_path / "sec.yaml")


def test_the_precision_choices_are_the_tables():
    """A precision the config accepts is one both sides know (a recipe name Megatron lacked used to pass the
    config and crash after Ray and the engines were up)."""
    import typing

    from qurl_mcore.precision import PRECISIONS, SCOPES

    hints = typing.get_type_hints(Config)
    assert typing.get_args(hints["precision"]) == tuple(PRECISIONS)
    assert typing.get_args(hints["scope"]) == ("auto", *SCOPES)


def test_every_float_field_refuses_infinity_and_nan_naming_its_range():
    """A float field without a bound let `uaq.scale=.inf` through to NaN weights in the engines minutes later."""
    from qurl_mcore.config import RANGES, flatten

    floats = [name for name, value in flatten(to_dict(Config())).items() if isinstance(value, float)]
    assert len(floats) >= 14 and set(floats) <= set(RANGES)
    for bad, shown in ((".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{name}={bad}" for name in floats])
        assert sorted(err.value.problems) == sorted(f"{name}: {RANGES[name][1]}, got {shown}" for name in floats)
        assert all(" must be in " in problem for problem in err.value.problems)


@pytest.mark.parametrize("override, message", [
    ("train.lr=1e9", "train.lr: must be in (0, 1], got 1000000000.0"),
    ("train.eps_high=.inf", "train.eps_high: must be in [0, 10], got inf"),
    ("train.kl_coef=1e6", "train.kl_coef: must be in [0, 100], got 1000000.0"),
    ("train.tis_cap=.inf", "train.tis_cap: must be in [1, 10000], got inf"),
    ("train.entropy_coef=5", "train.entropy_coef: must be in [0, 1], got 5.0"),
    ("train.weight_decay=.inf", "train.weight_decay: must be in [0, 1], got inf"),
    ("train.grad_clip=.inf", "train.grad_clip: must be in [0, 10000], got inf"),
    ("rollout.temperature=.inf", "rollout.temperature: must be in [0, 10], got inf"),
    ("uaq.scale=.inf", "uaq.scale: must be in (0, 16], got inf"),
    ("train.micro_batch_size=100000000", "train.micro_batch_size: must be in [1, 65536], got 100000000"),
])
def test_absurd_values_are_refused_with_field_value_and_range(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.problems == [message]


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\ntrain:\n  lr: [1e-6\n  loss: acr\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: not valid YAML: line 4 column 7: ")
    path.write_text("train:\n\tlr: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not valid YAML: line 2 column 1: .*'\\t'"):
        load_config(path)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.lr=[1", "data.system_prompt=\"unclosed"])
    assert [p.split(" (")[0] for p in err.value.problems] == [
        "override 'train.lr=[1': the value is not YAML", "override 'data.system_prompt=\"unclosed': the value is not YAML"]


@pytest.mark.parametrize("command", [["train", "--check"], ["plan"], ["eval", "--model", "none"], ["compare"]])
def test_every_command_that_loads_a_config_says_where_yaml_is_malformed_with_rc_2(tmp_path, command):
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: [1e-6\nsteps: 3\n")
    args = [*command, str(path), "--out", str(tmp_path / "cmp"), "--report-only"] if command == ["compare"] \
        else [*command, "--config", str(path)]
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", *args], capture_output=True, text=True, timeout=120)
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 2 and said.count("\n") == 0 and "Traceback" not in said, said
    assert f"{path}: not valid YAML: line 3 column 6:" in said
