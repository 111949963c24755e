"""`qurl train --check`: what is refused before anything starts, each problem with the field and the fix."""
from __future__ import annotations

import json
import os

import pytest

from qurl_mcore.cli import main
from qurl_mcore.config import load_config
from qurl_mcore.placement import Placement, unplaceable
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.preflight import preflight
from qurl_mcore.sizing import local_gpu

TINY = ["model.path=tiny-llama", "uaq.enabled=false", "precision=bf16"]


def _problems(tmp_path, *overrides, **kw) -> str:
    cfg = load_config(None, [*TINY, f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/logs", *overrides])
    return preflight(cfg, **kw).report()


def test_a_good_config_passes_and_prints_the_resolved_run(tmp_path, capsys):
    assert main(["train", "--check", *TINY, f"logging.dir={tmp_path}/logs", f"checkpoint.dir={tmp_path}/c"]) == 0
    out = capsys.readouterr().out
    assert "is ready to run" in out and "precision   bf16 (reference)" in out and "quantizes none" in out
    assert not (tmp_path / "logs").exists()  # a check writes nothing


def test_unwritable_output_directories(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    text = _problems(tmp_path, f"checkpoint.dir={blocker}/ckpt")
    assert f"checkpoint.dir: {blocker} is a file, not a directory" in text
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "logging.dir" in _problems(tmp_path, f"logging.dir={locked}/logs")


def test_a_directory_is_proven_writable_by_writing_in_it(tmp_path):
    """/proc refuses every write, root's too, though os.access says yes to root: the check writes a file to know.
    A directory it had to make for that is removed again."""
    assert "checkpoint.dir: nothing can be written in /proc/x" in _problems(tmp_path, "checkpoint.dir=/proc/x")
    assert "logging.dir" not in _problems(tmp_path, f"logging.dir={tmp_path}/new/logs")
    assert not (tmp_path / "new").exists()


def test_a_truncated_safetensors_file_is_refused_with_its_path(tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), model)
    weights = model / "model.safetensors"
    assert "model.path" not in _problems(tmp_path, f"model.path={model}")
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)
    text = _problems(tmp_path, f"model.path={model}")
    assert f"model.path: {weights} is {size - 1000} bytes where its header says {size} (truncated)" in text
    with weights.open("r+b") as f:
        f.truncate(100)
    assert f"model.path: {weights} is truncated: its header says" in _problems(tmp_path, f"model.path={model}")


def test_every_prompt_row_is_read_and_measured(tmp_path):
    """Bad rows past the first hundred are found, each named by its line, all counted: broken JSON, a null
    answer (not the answer "None"), an empty prompt, and a prompt whose tokens (by the model's chat template)
    leave less than max_new_tokens of the context."""
    from transformers import AutoTokenizer

    from qurl_mcore.tasks import Example, chat_ids

    rows = [json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) for i in range(300)]
    rows[119] = json.dumps({"question": "2+2", "answer": None})
    rows[149] = json.dumps({"question": "  ", "answer": "4"})
    rows[199] = '{"question": "2+2", "answer": '
    rows[249] = json.dumps({"question": "1+1 " * 200, "answer": "2"})
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(rows) + "\n")
    overrides = ["data.task=file", f"data.path={data}", "rollout.context_length=256", "rollout.max_new_tokens=64"]
    text = _problems(tmp_path, *overrides)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    length = len(chat_ids(tokenizer, Example(({"role": "user", "content": "1+1 " * 200},), "2")))
    assert f"data.path: {data}:120: the answer ('answer') is null" in text
    assert f"data.path: {data}:150: the prompt is empty" in text
    assert f"data.path: {data}:200: not valid JSON" in text
    assert (f"data.path: {data}:250: the prompt is {length} tokens, over the 192 that rollout.context_length 256 "
            "leaves after rollout.max_new_tokens 64") in text
    assert "data.path: 4 bad rows of 300" in text
    rows = [r for i, r in enumerate(rows) if i not in (119, 149, 199)]
    data.write_text("\n".join(rows) + "\n")
    summary = _problems(tmp_path, *overrides[:2], "rollout.context_length=2048", overrides[3])
    assert "data.path" not in summary
    assert f"data        297 prompts, the longest {length} tokens (room: {2048 - 64})" in summary


def test_a_model_directory_without_weights(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_checkpoint("llama") / "config.json").read_text())
    assert "has a config.json but no *.safetensors weights" in _problems(tmp_path, f"model.path={model}")
    assert "no config.json there" in _problems(tmp_path, f"model.path={tmp_path}")


def test_prompt_rows_are_checked(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"q": "2+2"}) + "\n")
    text = _problems(tmp_path, "data.task=file", f"data.path={data}")
    assert f"data.path: {data}:2 has no 'question' (the row has ['q']), no 'answer' (the row has ['q'])" in text
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    assert _problems(tmp_path, "data.task=file", f"data.path={data}").startswith("  model")


def _verl_jsonl(path):
    """The demo's additions in verl's layout (examples/data_preprocess): chat prompts, the answer in
    reward_model.ground_truth, beside columns the run does not read."""
    rows = [{"data_source": "additions", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": 9 * a + b}} for a in range(1, 10) for b in range(1, 10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("keys,refusal", [
    (["data.answer_key=reward_model.ground_truth"], None),
    (["data.answer_key=reward_model"], None),  # its ground_truth, not the object's text
    (["data.answer_key=data_source"], "data.reward: first_number pays nothing for a reply that states the answer, on "
                                      "each of the first 8 rows (the first answer: 'additions')"),
    (["data.answer_key=reward_model.ground_truth", "data.reward=math"], None),
    (["data.answer_key=ability", "data.reward=math"], "data.reward: math pays nothing"),
    (["data.answer_key=extra_info"], "the answer ('extra_info') is {\"index\": 10}, not a string or a number"),
])
def test_the_demo_on_verl_data_is_ready_with_its_keys_and_refused_with_the_wrong_ones(tmp_path, capsys, keys,
                                                                                      refusal):
    """`qurl train --config launch/configs/cpu_demo.yaml data.task=file data.path=VERL_JSONL`: with the answer's
    key the check passes; with a key whose values no reply could match, every reward would be 0 all run, and
    the check refuses, saying so."""
    data = _verl_jsonl(tmp_path / "verl.jsonl")
    code = main(["train", "--check", "--config", "launch/configs/cpu_demo.yaml", "data.task=file",
                 f"data.path={data}", "data.prompt_key=prompt", *keys, "eval.every=0",
                 f"checkpoint.dir={tmp_path}/c", f"logging.dir={tmp_path}/l"])
    out = capsys.readouterr()
    if refusal is None:
        assert code == 0 and "data        81 prompts" in out.out, out.err
    else:
        assert code == 2 and refusal in out.err


def test_a_users_reward_that_pays_no_stated_answer_gets_a_note(tmp_path):
    """A user's reward may read replies of a form the check does not know: noted, not refused."""
    data = _verl_jsonl(tmp_path / "verl.jsonl")
    text = _problems(tmp_path, "data.task=file", f"data.path={data}", "data.prompt_key=prompt",
                     "data.answer_key=data_source", "data.reward=tests.tasks.user_rewards:numeric")
    assert text.startswith("  model") and ("note        data.reward: tests.tasks.user_rewards:numeric pays nothing "
                                           "for a reply that states the answer") in text
    assert "raising ValueError: could not convert string to float: 'additions'" in text


def test_a_directory_given_as_data_path_is_named_a_directory(tmp_path):
    _verl_jsonl(tmp_path / "train.jsonl")
    assert (f"data.path: {tmp_path} is a directory; give one .jsonl or .parquet file (it holds train.jsonl)"
            in _problems(tmp_path, "data.task=file", f"data.path={tmp_path}"))


def test_a_wandb_project_needs_wandb_importable(tmp_path, monkeypatch):
    """wandb is an extra (requirements/wandb.txt), not in the CPU set: a project without it would fail at the
    run's first log, so the check refuses it; with wandb on the path it passes."""
    import importlib.util

    project = ["logging.wandb_project=demo"]
    if importlib.util.find_spec("wandb") is None:
        assert ("logging.wandb_project: 'demo' logs to Weights & Biases, but wandb is not installed here; pip "
                "install -r requirements/wandb.txt") in _problems(tmp_path, *project)
    package = tmp_path / "site" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert "logging.wandb_project" not in _problems(tmp_path, *project)
    assert "logging.wandb_project" not in _problems(tmp_path)  # no project, nothing asked of wandb


def test_the_wandb_extra_installs_the_requirements_file_and_the_cpu_set_does_not(monkeypatch):
    import runpy
    from pathlib import Path

    import setuptools

    root = Path(__file__).parent.parent
    given = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: given.update(kw))
    runpy.run_path(str(root / "setup.py"))
    pins = [line for line in (root / "requirements" / "wandb.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert given["extras_require"]["wandb"] == pins and pins[0].startswith("wandb")
    assert "wandb" not in (root / "requirements" / "cpu.txt").read_text()


def test_directories_another_run_holds_are_refused_naming_the_run(tmp_path):
    """A run's lock (qurl_mcore/runlock.py) on its checkpoint.dir: the check names the holder, as the run would
    at its start, and takes nothing itself; once the run ends the directory is ready again."""
    from qurl_mcore.runlock import lock_dirs

    with lock_dirs(tmp_path / "ckpt", command="qurl train --config first.yaml"):
        text = _problems(tmp_path)
        assert (f"checkpoint.dir: {(tmp_path / 'ckpt').resolve()} is in use by another run: pid {os.getpid()} on "
                in text and "(qurl train --config first.yaml)" in text)
        assert "logging.dir:" not in text
    assert "checkpoint.dir:" not in _problems(tmp_path)


def test_a_cpu_step_is_estimated_and_a_huge_one_warned_of(tmp_path):
    """On CPUs the check scales the demo's step time by parameters x samples x new tokens: the demo's own
    config gets the demo's 18 s, a 131k-sample step hours, with a warning and the levers."""
    demo = ["data.prompts_per_step=8", "rollout.samples_per_prompt=6", "rollout.max_new_tokens=6"]
    assert "cpu step    ~18 s a step: 48 samples" in _problems(tmp_path, "model.path=smollm2", *demo, use_gpu=False)
    huge = _problems(tmp_path, "model.path=smollm2", "data.prompts_per_step=2048", "rollout.samples_per_prompt=64",
                     "rollout.max_new_tokens=6", use_gpu=False)
    assert "cpu step    ~13.7 h a step: 131072 samples of up to 6 new tokens" in huge
    assert "warning     a step of 131072 samples takes hours on CPUs: lower data.prompts_per_step" in huge
    assert "cpu step" not in _problems(tmp_path, *demo, use_gpu=True)  # GPUs: the memory plan instead


def test_a_cpu_steps_memory_is_estimated_at_its_padded_length_and_more_than_the_machine_warned_of(tmp_path):
    """On CPUs the check gives a trainer rank's bytes (the plan's at fp32, with the step's batch) for sequences of
    the longest prompt and rollout.max_new_tokens, as a step pads them; a run on this machine that needs more
    than it has is warned of, with the levers."""
    from transformers import AutoTokenizer

    from qurl_mcore.models import resolve_model_path
    from qurl_mcore.tasks import addition_examples, chat_ids

    demo = ["data.prompts_per_step=8", "rollout.samples_per_prompt=6", "rollout.max_new_tokens=6"]
    cfg = load_config(None, [*TINY, *demo])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))
    longest = max(len(chat_ids(tokenizer, ex)) for ex in addition_examples(cfg.data.num_prompts, seed=cfg.seed,
                                                                            min_operand=cfg.data.min_operand,
                                                                            max_operand=cfg.data.max_operand))
    text = _problems(tmp_path, *demo, use_gpu=False, local=True)
    assert "cpu memory  ~" in text and f"a trainer rank at {longest + 6} tokens a sequence" in text
    assert "trainer rank(s) need" not in text
    huge = [*demo, "rollout.max_new_tokens=30000", "rollout.context_length=32768", "train.micro_batch_size=64"]
    text = _problems(tmp_path, *huge, use_gpu=False, local=True)
    assert f"a trainer rank at {longest + 30000} tokens a sequence" in text
    assert "warning     1 trainer rank(s) need ~" in text and "lower train.micro_batch_size" in text
    assert "trainer rank(s) need" not in _problems(tmp_path, *huge, use_gpu=False)  # another machine's memory
    assert "cpu memory" not in _problems(tmp_path, *demo, use_gpu=True)  # GPUs: the memory plan instead


def test_placements_that_cannot_fit(tmp_path):
    cpus = os.cpu_count()
    text = _problems(tmp_path, f"train.dp_size={cpus + 1}", local=True)
    assert f"placement: {cpus + 1} bundle(s) need {cpus + 1} CPU (has {cpus})" in text
    assert "exceeds the 1 trainer" in _problems(tmp_path, "rollout.engines=2")
    bundles = Placement([{"GPU": 1.0, "CPU": 1.0}] * 4, [0, 1, 2, 3], [0, 1, 2, 3], 0.5, "GPU")
    assert unplaceable(bundles, {"GPU": 8.0, "CPU": 64.0}, "x") is None
    assert "need 4 GPU (has 2)" in unplaceable(bundles, {"GPU": 2.0, "CPU": 64.0}, "the Ray cluster")


def test_cross_field_numbers(tmp_path):
    text = _problems(tmp_path, "rollout.max_new_tokens=600", "rollout.context_length=512", "train.tp_size=3")
    assert "rollout.max_new_tokens: 600 leaves no room for the prompt" in text
    assert "train.tp_size: 3 must divide the model's 4 attention heads" in text


def test_a_block_format_refuses_an_engine_tp_whose_shards_cut_its_blocks(tmp_path):
    """An engine's TP shard of a row-parallel linear quantizes on its own, so its input columns must be whole
    blocks: the experts' 64 down columns in 4 shards of 16 are half an MXFP4 block (32) and whole NVFP4 ones
    (16); TP 2 (shards of 32) fits both."""
    model = tmp_path / "model"
    model.mkdir()
    source = tiny_checkpoint("qwen3_moe")
    for f in source.iterdir():
        (model / f.name).symlink_to(f)
    hf = json.loads((source / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 4, "moe_intermediate_size": 64}))
    run = (f"model.path={model}", "precision=fp4", "rollout.tp_size=4")
    assert ("rollout.tp_size: 4 splits down_proj's 64 input columns into shards of 16, not whole mxfp4 blocks of "
            "32: each engine shard would quantize other blocks than the trainer; use rollout.tp_size=2") in \
        _problems(tmp_path, *run, "fp4_format=mxfp4")
    assert "input columns" not in _problems(tmp_path, *run, "fp4_format=nvfp4")
    assert "input columns" not in _problems(tmp_path, *run[:2], "rollout.tp_size=2", "fp4_format=mxfp4")


def test_routing_replay_needs_an_moe_and_a_schedule_that_keeps_its_targets(tmp_path):
    assert "train.routing_replay: r3 replays MoE routing; this model is dense" in _problems(
        tmp_path, "train.routing_replay=r3")
    moe = ["model.path=tiny-qwen3_moe", "train.routing_replay=r3"]
    mixtral = ["model.path=tiny-mixtral", "train.routing_replay=r3"]
    for precision in ("bf16", "int8", "fp4_rc"):  # SGLang's FusedMoE Mixtral, quantized or not (qurl_mcore.sglang)
        assert "train.routing_replay:" not in _problems(tmp_path, *mixtral, f"precision={precision}")
    assert "train.routing_replay:" not in _problems(tmp_path, *moe, "precision=int8")
    assert "train.routing_replay:" not in _problems(tmp_path, *moe, "train.recompute=full")
    assert "r3 with train.recompute full and train.pp_size > 1 is not supported" in _problems(
        tmp_path, *moe, "train.recompute=full", "train.pp_size=2")


def test_bad_cli_arguments_end_with_one_line(capsys):
    assert main(["quant-report", "--tensor", "nope"]) == 2
    assert capsys.readouterr().out.startswith("qurl quant-report: no tensor 'nope'")
    with pytest.raises(SystemExit) as exit_:
        main(["quant-report", "--rows", "0"])
    assert exit_.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err
    assert main(["align", "--model", "/nonexistent"]) == 2
    assert "qurl align: --model /nonexistent: no config.json there" in capsys.readouterr().out


def test_a_float32_engine_cannot_run_the_w8a8_kernels(tmp_path):
    text = _problems(tmp_path, "precision=int8", "rollout.dtype=float32", use_gpu=True)
    assert "rollout.dtype: float32 engines cannot run SGLang's W8A8 int8 kernels" in text
    assert "rollout.dtype" not in _problems(tmp_path, "precision=int8", "rollout.dtype=float32", use_gpu=False)


def test_compiled_requant_needs_a_compiler_on_cpus(tmp_path, monkeypatch):
    """torch.compile's CPU code is C++: without a compiler the engines would fail as they load."""
    compiled = ("precision=int8", "rollout.requant=compiled")
    monkeypatch.setenv("CXX", "no-such-c++")
    assert ("rollout.requant: compiled re-quantization runs torch.compile, which needs a C++ compiler on CPUs "
            "(no-such-c++ is not on PATH)") in _problems(tmp_path, *compiled, use_gpu=False)
    assert "rollout.requant" not in _problems(tmp_path, "precision=bf16", "rollout.requant=compiled", use_gpu=False)
    monkeypatch.setenv("CXX", "sh")  # a program that is on PATH
    assert "rollout.requant" not in _problems(tmp_path, *compiled, use_gpu=False)


def test_a_background_save_needs_the_torch_dist_format(tmp_path):
    assert ("checkpoint.async_save: Megatron's asynchronous save writes the torch_dist format, not 'torch'; use "
            "checkpoint.format=torch_dist or async_save=false") in _problems(
        tmp_path, "checkpoint.async_save=true", "checkpoint.format=torch")
    assert "checkpoint.async_save" not in _problems(tmp_path, "checkpoint.async_save=true")


def test_engine_memory_settings_on_gpus(tmp_path):
    """Offloading an engine needs a trainer rank on its GPU; an engine that shares one needs a mem_fraction
    (SGLang's default share would leave the trainer too little), even where the planner does not know the GPU."""
    assert "rollout.offload: engines give their GPU memory to the trainer rank" in _problems(
        tmp_path, "layout=disaggregated", "rollout.offload=true")
    assert "rollout.offload" not in _problems(tmp_path, "layout=disaggregated")
    if local_gpu() is None:  # the planner does not know this machine's GPU (or it has none)
        unknown = _problems(tmp_path, use_gpu=True)
        assert "rollout.mem_fraction: 0 lets each engine take SGLang's default share" in unknown
    assert "rollout.mem_fraction" not in _problems(tmp_path, "rollout.mem_fraction=0.3", use_gpu=True)
    assert "rollout.mem_fraction" not in _problems(tmp_path, "layout=disaggregated", use_gpu=True)


def test_smoothing_strength_and_the_precisions_it_serves(tmp_path, capsys):
    # α outside [0, 1] is refused where it is given, by `qurl train --check` too
    assert main(["train", "--check", *TINY, "rollout.smoothing=1.5", f"logging.dir={tmp_path}/logs"]) != 0
    assert "rollout.smoothing: must be in [0, 1], got 1.5" in capsys.readouterr().err
    assert "rollout.smoothing" not in _problems(tmp_path, "precision=int8", "rollout.smoothing=0.5")
    assert "smoothing   α = 0.5" in _problems(tmp_path, "precision=fp8", "rollout.smoothing=0.5")
    assert "rollout.smoothing: 0.5 with precision 'bf16': the engines run full precision" in _problems(
        tmp_path, "rollout.smoothing=0.5")
    assert "rollout.smoothing: 0.5 with precision 'fp4': nvfp4 quantizes activations in small blocks" in _problems(
        tmp_path, "precision=fp4", "rollout.smoothing=0.5")
    # an MoE model's experts scope holds no smoothed linear (the routed experts' input is the router's)
    assert "rollout.smoothing: 0.5, but scope 'experts' quantizes none of the linears" in _problems(
        tmp_path, "model.path=tiny-qwen3_moe", "precision=int8", "scope=experts", "rollout.smoothing=0.5")
    assert "rollout.smoothing" not in _problems(tmp_path, "precision=fp4")  # 0: off, nothing to check
