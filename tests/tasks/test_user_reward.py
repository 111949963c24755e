"""`data.reward: package.module:function`: per sample or batched, sync or async; checked by `qurl train --check`
(import and signature); its exceptions scored 0 and counted, as the built-in rewards' are."""
import pytest

from qurl_mcore.config import ConfigError, load_config
from qurl_mcore.preflight import preflight
from qurl_mcore.tasks import load_reward, score_all
from qurl_mcore.tasks.rewards import is_batched

from . import user_rewards

HERE = "tests.tasks.user_rewards"


@pytest.mark.parametrize("name,batched", [("exact", False), ("exact_async", False), ("lengths", True),
                                          ("lengths_async", True)])
def test_every_form_loads_and_scores(name, batched):
    fn = load_reward(f"{HERE}:{name}")
    assert fn is getattr(user_rewards, name) and is_batched(fn) is batched
    scores, stats = score_all(fn, ["4", "x", "12345"], ["4", "5", "6"])
    assert scores == ([0.1, 0.1, 0.5] if batched else [1.0, 0.0, 0.0]) and stats.errors == 0


@pytest.mark.parametrize("name", ["exact", "exact_async"])
def test_a_per_sample_exception_scores_that_sample_0_and_is_counted(name):
    scores, stats = score_all(load_reward(f"{HERE}:{name}"), ["4", "4"], ["4", "boom"])
    assert scores == [1.0, 0.0] and stats.errors == 1
    assert stats.messages == ["RuntimeError: cannot score this one"]


@pytest.mark.parametrize("name", ["lengths", "lengths_async"])
def test_a_batched_exception_scores_the_batch_0_and_counts_each(name):
    scores, stats = score_all(load_reward(f"{HERE}:{name}"), ["4", "4"], ["4", "boom"])
    assert scores == [0.0, 0.0] and stats.errors == 2


def test_a_batched_reward_of_the_wrong_length_is_counted():
    # without a list annotation a function is per sample: a list it returns is one error per sample
    scores, stats = score_all(lambda responses, answers: [1.0], ["a", "b"], ["a", "b"])
    assert scores == [0.0, 0.0] and stats.errors == 2 and stats.messages[0].startswith("TypeError: float()")

    def short(responses: list[str], answers: list[str]) -> list[float]:
        return [1.0]
    scores, stats = score_all(short, ["a", "b"], ["a", "b"])
    assert scores == [0.0, 0.0] and stats.errors == 2 and "returned 1 scores for 2 responses" in stats.messages[0]


@pytest.mark.parametrize("name,message", [
    ("tests.tasks.no_such_module:f", "cannot import tests.tasks.no_such_module"),
    (f"{HERE}:missing", "tests.tasks.user_rewards has no 'missing'"),
    (f"{HERE}:NOT_A_FUNCTION", "is a int, not a function"),
    (f"{HERE}:one_argument", "must take (response: str, answer: str)"),
    ("tests.tasks.raising_reward:score", "importing tests.tasks.raising_reward raised RuntimeError: this module "
                                         "needs a GPU to import; fix the module"),
])
def test_check_imports_the_reward_and_checks_its_signature(name, message):
    cfg = load_config(None, [f"data.reward={name}"])
    problems = [p for p in preflight(cfg, use_gpu=False).problems if p.startswith("data.reward:")]
    assert len(problems) == 1 and message in problems[0], problems


def test_check_passes_a_good_reward_and_the_config_refuses_a_name_of_neither_form():
    cfg = load_config(None, [f"data.reward={HERE}:lengths_async"])
    assert not [p for p in preflight(cfg, use_gpu=False).problems if p.startswith("data.reward:")]
    with pytest.raises(ConfigError, match=r"data.reward: must be one of \['math', 'first_number'\] or "
                                          r"package.module:function, got 'maths'"):
        load_config(None, ["data.reward=maths"])


def test_a_reward_module_that_raises_on_import_ends_the_check_with_rc_2_and_one_line(tmp_path, capsys):
    from qurl_mcore.cli import main

    assert main(["train", "--check", "model.path=tiny-llama", "data.reward=tests.tasks.raising_reward:score",
                 f"checkpoint.dir={tmp_path}/c", f"logging.dir={tmp_path}/l"]) == 2
    err = capsys.readouterr().err
    assert "data.reward: tests.tasks.raising_reward:score: importing" in err and "Traceback" not in err
