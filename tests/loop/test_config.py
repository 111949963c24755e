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
    for line in ("train.eps_low: must be in [0, 1), got 1.0", "train.eps_high: must be >= 0, got -0.1",
                 "train.kl_coef: must be >= 0", "train.grad_clip: must be >= 0", "rollout.top_p: must be in (0, 1]",
                 "rollout.top_k: must be -1 (off) or a positive count, got 0", "train.tis_cap: must be >= 1",
                 "rollout.temperature: must be >= 0", "train.lr: must be positive, got nan"):
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
    text = preflight(load_config(None, ["precision=fp4_rc"])).report()
    assert "UAQ rescales a full-precision trainer for an 8-bit rollout (precision int8 or fp8), not precision " \
           "'fp4_rc'; set uaq.enabled=false" in text
    assert preflight(load_config(None, ["precision=fp4_rc", "uaq.enabled=false"])).ok


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
