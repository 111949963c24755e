"""Held-out evaluation: the scoring (pass@1, mean@n, pass@n), the held-out split of the synthetic task, the
`eval.*` checks, and (slow) the loop's evaluations on real engines and `qurl eval` on an exported model."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from qurl_mcore.config import ConfigError, load_config
from qurl_mcore.heldout import eval_examples
from qurl_mcore.loop.evaluation import accuracy, pass_at_n, sampling, score
from qurl_mcore.preflight import preflight
from qurl_mcore.rollout import Generation
from qurl_mcore.tasks import REWARDS, addition_examples
from qurl_mcore.tasks.synthetic import held_out_additions


def _gen(text: str, tokens: int) -> Generation:
    return Generation([1], list(range(tokens)), [0.0] * tokens, None, text, None, None)


def test_accuracy_is_pass_at_1_greedy_and_mean_at_n_sampled():
    assert accuracy([1, 0, 1, 1], 1) == 3 / 4  # four prompts, one greedy answer each
    rewards = [1, 0, 0, 1, 1, 1, 0, 0, 0]  # three prompts, three samples each: 1/3, 3/3, 0/3 right
    assert accuracy(rewards, 3) == pytest.approx((1 / 3 + 1 + 0) / 3)
    assert pass_at_n(rewards, 3) == pytest.approx(2 / 3)  # prompts 1 and 2 have a right sample
    assert pass_at_n([0.5, 0.25], 2) == 0.5  # a graded reward: the best sample's
    with pytest.raises(ValueError, match="5 rewards are not whole groups of n=2"):
        accuracy([1, 0, 1, 1, 0], 2)
    with pytest.raises(ValueError, match="not whole groups"):
        pass_at_n([], 1)


def test_score_names_the_metrics_and_counts_truncated_responses():
    gens = [_gen("7", 2), _gen("It is 9", 4), _gen("9", 4), _gen("no idea", 4)]  # 2 prompts x 2 samples
    metrics, rewards = score(REWARDS["first_number"], gens, ["7", "7", "9", "9"], 2, max_new_tokens=4,
                             suffix="_bf16")
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"eval/accuracy_bf16": 0.5, "eval/pass_at_n_bf16": 1.0, "eval/response_len_mean_bf16": 3.5,
                       "eval/truncated_frac_bf16": 0.75}
    greedy, _ = score(REWARDS["first_number"], gens[:1], ["7"], 1, max_new_tokens=4)
    assert greedy == {"eval/accuracy": 1.0, "eval/response_len_mean": 2.0, "eval/truncated_frac": 0.0}


def test_sampling_is_greedy_at_temperature_0_else_the_rollouts_top_p_and_top_k():
    cfg = load_config(None, ["rollout.max_new_tokens=12", "rollout.top_p=0.9", "rollout.top_k=20"])
    assert sampling(cfg) == {"max_new_tokens": 12, "temperature": 0.0}
    cfg = load_config(None, ["rollout.max_new_tokens=12", "rollout.top_p=0.9", "rollout.top_k=20",
                             "eval.temperature=0.6", "eval.n=4"])
    assert sampling(cfg) == {"max_new_tokens": 12, "temperature": 0.6, "top_p": 0.9, "top_k": 20}


def _question(ex) -> str:
    return ex.messages[-1]["content"]


@pytest.mark.parametrize("num_train,min_operand,max_operand,seed",
                         [(64, 0, 9, 0), (96, 0, 9, 3), (30, 0, 5, 1), (500, 0, 30, 2), (48, 1, 9, 0), (20, 3, 7, 4)])
def test_the_held_out_split_is_disjoint_from_the_training_prompts(num_train, min_operand, max_operand, seed):
    operands = {"min_operand": min_operand, "max_operand": max_operand}
    train = addition_examples(num_train, seed=seed, **operands)
    seen = {_question(ex) for ex in train}
    total = (max_operand - min_operand + 1) ** 2
    unseen = total - len(seen)
    held = held_out_additions(unseen, train, seed=seed, **operands)  # every unseen one exists
    assert len({_question(ex) for ex in held}) == len(held) == unseen
    assert not {_question(ex) for ex in held} & seen
    for ex in [*train, *held]:  # the form, operand range and answer
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with just the number\.", _question(ex)).groups())
        assert min_operand <= min(a, b) and max(a, b) <= max_operand and ex.answer == str(a + b)
    assert held_out_additions(5, train, seed=seed, **operands) == held_out_additions(5, train, seed=seed, **operands)
    with pytest.raises(ValueError, match=f"only {unseen} of the {total} additions with operands {min_operand}\\.\\."):
        held_out_additions(unseen + 1, train, seed=seed, **operands)


def test_the_default_operands_are_unchanged_by_the_range_option():
    """min_operand 0 (the default) draws the prompts it drew before the option existed: the studies' records
    stay reproducible."""
    assert addition_examples(64, seed=0) == addition_examples(64, seed=0, min_operand=0, max_operand=9)
    assert [_question(ex) for ex in addition_examples(3, seed=0)] == [
        "What is 6 + 6? Reply with just the number.", "What is 0 + 4? Reply with just the number.",
        "What is 8 + 7? Reply with just the number."]


@pytest.mark.parametrize("lo,hi", [(-1, 9), (5, 5), (9, 3)])
def test_an_empty_or_negative_operand_range_is_refused(lo, hi):
    with pytest.raises(ValueError, match="0 <= data.min_operand < data.max_operand"):
        addition_examples(8, min_operand=lo, max_operand=hi)


def test_eval_examples_from_a_file_or_the_generated_split(tmp_path):
    rows = [{"q": f"What is {i} squared?", "a": str(i * i)} for i in range(5)]
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"eval.data={path}", "eval.num_prompts=3", "data.prompt_key=q", "data.answer_key=a"])
    assert [(_question(ex), ex.answer) for ex in eval_examples(cfg, [])] == \
        [(r["q"], r["a"]) for r in rows[:3]]  # the file's first rows, with data.*'s keys
    cfg = load_config(None, ["data.num_prompts=40", "eval.num_prompts=20"])
    train = addition_examples(40, seed=0)
    assert eval_examples(cfg, train) == held_out_additions(20, train, seed=0)
    with pytest.raises(ValueError, match="eval.num_prompts: only"):
        eval_examples(load_config(None, ["eval.num_prompts=90"]), addition_examples(512, seed=0))
    with pytest.raises(ValueError, match="eval.data: task 'file' has no generated held-out split"):
        eval_examples(load_config(None, ["data.task=file"]), [])
    with pytest.raises(ValueError, match=f"eval.data: prompt file {tmp_path}/none.jsonl does not exist"):
        eval_examples(load_config(None, [f"eval.data={tmp_path}/none.jsonl"]), [])


def test_eval_fields_are_checked():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["eval.every=-1", "eval.n=0", "eval.temperature=-0.5", "eval.num_prompts=0",
                           "eval.bf16_refrence=true"])
    text = str(err.value)
    for line in ("eval.every: must be >= 0", "eval.n: must be positive", "eval.temperature: must be in [0, 10]",
                 "eval.num_prompts: must be positive", "did you mean eval.bf16_reference?"):
        assert line in text


def _check(tmp_path, *overrides) -> str:
    cfg = load_config(None, ["model.path=tiny-llama", "uaq.enabled=false", "precision=bf16",
                             f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs", *overrides])
    return preflight(cfg, use_gpu=False).report()


def test_preflight_refuses_what_cannot_evaluate_and_names_the_fix(tmp_path):
    text = _check(tmp_path, "eval.bf16_reference=true", "layout=disaggregated", "eval.n=4")
    assert "problem" not in text and "eval " not in text  # eval.every 0: evaluation off, the rest unused
    text = _check(tmp_path, "eval.every=2", "eval.n=4", "eval.bf16_reference=true", "layout=disaggregated")
    assert "eval.n: greedy decoding (eval.temperature 0) gives one answer 4 times" in text
    assert "eval.bf16_reference: the BF16 engine shares engine 0's bundle" in text and "layout=colocated" in text
    text = _check(tmp_path, "eval.every=2", "eval.num_prompts=64")  # 512 training additions leave 1 unseen
    assert "eval.num_prompts: only 1 of the 100 additions" in text and "lower eval.num_prompts" in text
    text = _check(tmp_path, "eval.every=2", "eval.num_prompts=30", "data.num_prompts=64", "eval.temperature=0.7",
                  "eval.n=4", "eval.bf16_reference=true")
    assert "problem" not in text
    assert "eval        every 2 steps and at step 0: 30 prompts (additions that are no training prompt), " \
           "4 samples at temperature 0.7, mean@4, rollout engines and a BF16 engine" in text


# -- real engines (slow) -------------------------------------------------------------------------------------
TINY_RUN = ["model.path=tiny-llama", "precision=bf16", "uaq.enabled=false", "data.prompts_per_step=2",
            "data.num_prompts=16", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6",
            "rollout.context_length=256", "rollout.max_total_tokens=2048", "train.micro_batch_size=4",
            "train.lr=1e-3", "train.entropy_coef=0.01", "train.threads=2", "logging.progress=false",
            "checkpoint.every=2"]  # no reward on a random model: the entropy bonus moves the weights
EVAL = ["eval.every=1", "eval.num_prompts=6", "eval.bf16_reference=true"]


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """Two steps of a BF16 run on the tiny Llama, evaluated before step 1 and after every step on the rollout
    engine and on the BF16 reference engine."""
    run_dir = tmp_path_factory.mktemp("eval")
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "train", f"checkpoint.dir={run_dir}/ckpt",
                          f"logging.dir={run_dir}/logs", "steps=2", *TINY_RUN, *EVAL],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return run_dir, out.stderr


def _samples(run_dir, step: int, suffix: str = "") -> list[dict]:
    path = run_dir / "logs" / "eval" / f"step_{step:08d}{suffix}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_the_loop_evaluates_before_training_and_after_every_step(eval_run):
    run_dir, console = eval_run
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "reward/mean" not in records[0]  # the baseline record holds the evaluation alone
    responses = []
    for r in records:
        for key in ("eval/accuracy", "eval/accuracy_bf16", "eval/response_len_mean", "eval/response_len_mean_bf16"):
            assert 0 <= r[key] <= (6 if "len" in key else 1), key
        # precision bf16: both engines serve the same weights in the same format, greedily
        rollout, reference = _samples(run_dir, r["step"]), _samples(run_dir, r["step"], "_bf16")
        assert len(rollout) == 6 and rollout == reference
        assert r["eval/accuracy"] == r["eval/accuracy_bf16"] == sum(s["reward"] for s in rollout) / 6
        responses.append([s["response"] for s in rollout])
    assert responses[0] != responses[2]  # the engines evaluated the trained weights, not the initial ones
    assert console.count("held-out accuracy") == 3 and "(BF16 engine" in console
    assert (run_dir / "logs" / "engine-1.log").is_file()  # the reference engine: engine number rollout.engines
    assert "Held-out accuracy" in (run_dir / "logs" / "report.html").read_text()


@pytest.mark.slow
def test_qurl_eval_of_the_exported_model_matches_the_loops_last_evaluation(eval_run, tmp_path):
    """`qurl eval` starts its own engine on the checkpoint the run exported at its end; greedy, it must score
    the held-out split as the loop's reference engine did after step 2 (same weights, prompts and sampling)."""
    run_dir, _ = eval_run
    last = json.loads((run_dir / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "eval", "--model", str(run_dir / "ckpt" / "hf"),
                          "--precision", "bf16", "--num-prompts", "6", "--out", str(tmp_path / "eval.json"),
                          *[o for o in TINY_RUN if o.startswith(("data.", "rollout.", "model."))]],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["precision"] == "bf16" and result["num_prompts"] == 6 and len(result["samples"]) == 6
    assert result["samples"] == _samples(run_dir, 2, "_bf16")  # prompt for prompt, response for response
    assert result["metrics"]["eval/accuracy"] == last["eval/accuracy_bf16"]
    assert result["metrics"]["eval/response_len_mean"] == last["eval/response_len_mean_bf16"]
    held = eval_examples(load_config(None, ["data.num_prompts=16", "eval.num_prompts=6"]), addition_examples(16))
    assert [s["prompt"] for s in result["samples"]] == [_question(ex) for ex in held]
    assert f"accuracy={result['metrics']['eval/accuracy']:.4f}" in out.stdout


def test_qurl_eval_without_a_config_has_prompts_and_names_a_missing_model(tmp_path, capsys):
    """The defaults alone: with the default config's training set (all 100 additions of operands 0..9) nothing
    is left to hold out, so without --config no training run is known and any 64 additions are asked."""
    from qurl_mcore.cli import main
    from qurl_mcore.loop.evaluation import eval_prompts

    cfg = load_config(None)
    with pytest.raises(ValueError, match="only 1 of the 100 additions"):
        eval_prompts(cfg)
    prompts = eval_prompts(cfg, held_out=False)
    assert len(prompts) == cfg.eval.num_prompts == 64 and len({p.messages[-1]["content"] for p in prompts}) == 64
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert f"qurl eval: --model {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path)]) == 2
    assert f"qurl eval: --model {tmp_path}: no config.json there" in capsys.readouterr().err
