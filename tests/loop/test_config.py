"""Training configuration: YAML + overrides, every bad field explained at once."""
import pytest

from qurl_mcore.config import Config, ConfigError, load_config, to_dict


def test_defaults_yaml_and_overrides_layer_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 5\nrollout:\n  precision: fp8\n  samples_per_prompt: 8\ntrain:\n  lr: 2.0e-6\n")
    cfg = load_config(path, ["train.lr=3e-6", "rollout.temperature=0.6", "uaq.scale=2"])
    assert cfg.steps == 5 and cfg.rollout.precision == "fp8" and cfg.rollout.samples_per_prompt == 8
    assert cfg.train.lr == 3e-6 and cfg.rollout.temperature == 0.6
    assert cfg.uaq.scale == 2.0 and isinstance(cfg.uaq.scale, float)
    assert cfg.train.loss == "acr"  # untouched default
    assert to_dict(cfg)["rollout"]["precision"] == "fp8"
    assert load_config() == Config()


def test_every_problem_is_reported_with_its_name(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stepz: 3\nrollout:\n  precision: int4\n  samples_per_prompt: 0\ntrain:\n  lr: fast\n"
                    "  dynamic_sampling: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["uaq.enabled=maybe", "nonsense"])
    text = str(err.value)
    assert "7 problem(s) in" in text
    assert "uaq.enabled: expected true or false, got 'maybe'" in text
    assert "stepz: unknown field (did you mean steps?)" in text
    assert "rollout.precision: 'int4' is not one of ['bf16', 'int8', 'fp8', 'fp4', 'fp4_rc']" in text
    assert "rollout.samples_per_prompt: must be positive, got 0" in text
    assert "train.lr: expected float, got str 'fast'" in text
    assert "train.dynamic_sampling: expected true or false, got 1" in text
    assert "override 'nonsense': expected key=value" in text


def test_semantic_checks():
    with pytest.raises(ConfigError, match="data.path: task 'file' needs"):
        load_config(None, ["data.task=file"])
    with pytest.raises(ConfigError, match="GRPO|grpo compares samples"):
        load_config(None, ["rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="UAQ targets INT8/FP8 rollout, not 'fp4_rc'"):
        load_config(None, ["rollout.precision=fp4_rc"])
    assert load_config(None, ["rollout.precision=fp4_rc", "uaq.enabled=false"]).uaq.enabled is False


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "sec.yaml").write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train: expected a mapping of TrainConfig fields"):
        load_config(tmp_path / "sec.yaml")
