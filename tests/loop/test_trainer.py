"""`PolicyTrainer` on a real Megatron model (tiny Llama, world size 1, in this process): the step's π_prox,
micro-batch invariance of the update, NaN skipping, checkpoint state, and the exported weights."""
from __future__ import annotations

import weakref

import pytest
import torch

from qurl_mcore.config import load_config, to_dict
from qurl_mcore.loop.batch import Sample, collate
from qurl_mcore.loop.trainer import PolicyTrainer
from qurl_mcore.megatron import token_logprobs
from qurl_mcore.rollout.engine import RolloutEngine


def _trainer(*overrides: str) -> PolicyTrainer:
    cfg = load_config(None, ["model.path=tiny-llama", "train.lr=1e-3", "uaq.enabled=false",
                             "precision=bf16", *overrides])
    return PolicyTrainer(cfg, cfg.recipe())


def _batch(trainer: PolicyTrainer, seed: int = 0, behav_from_model: bool = True):
    """Random prompts/responses of varied lengths; behaviour log-probs = the model's own (r = 1) or noisy."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        p, r = 3 + i % 3, 2 + (i * 5) % 4
        ids = torch.randint(3, 1000, (p + r,), generator=g).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * r, group=i // 2))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    batch = collate(samples, adv, pad_id=0)
    with torch.no_grad():
        own = trainer._forward_only(trainer.model, batch)
    noise = 0.0 if behav_from_model else 0.05 * torch.randn(own.shape, generator=g)
    batch.behav_logprobs = torch.where(batch.response_mask, own + noise, 0.0)
    return batch


def _params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _grads(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """The (clipped) gradient of the last step: Adam's first step, lr·g/|g|, would amplify rounding where g ≈ 0."""
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference_update():
    """One step with all six sequences in a single micro-batch: the update every split must reproduce."""
    trainer = _trainer("train.micro_batch_size=8")
    try:
        batch = _batch(trainer, behav_from_model=False)
        before = _params(trainer)
        metrics = trainer.step(batch)
        after = _params(trainer)
        grads = _grads(trainer)
    finally:
        trainer.close()  # one Megatron at a time in this process
    return batch, before, after, grads, metrics


def test_step_updates_and_reports(reference_update):
    _, before, after, _, metrics = reference_update
    assert metrics["train/skipped_nonfinite"] == 0.0 and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for key in ("loss/policy", "clip_frac/high", "is_ratio/mean", "mismatch/kl_k3", "mismatch/prob_pearson",
                "perf/train_tokens_per_s", "time/ref_logprobs", "time/train"):
        assert key in metrics
    assert 0 < metrics["mismatch/abs_logprob_diff"] < 0.1  # the injected behaviour noise, seen through π_prox


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_split_gives_the_same_update(reference_update, agg):
    batch, before, _, grads, _ = reference_update
    if agg != "token_mean":  # the reference used token_mean; recompute one for this aggregation
        trainer = _trainer("train.micro_batch_size=8", f"train.agg={agg}")
        trainer.step(batch)
        grads = _grads(trainer)
        trainer.close()
    trainer = _trainer("train.micro_batch_size=2", f"train.agg={agg}")
    try:
        assert all(torch.equal(before[n], p) for n, p in _params(trainer).items())
        trainer.step(batch)
        split = _grads(trainer)
    finally:
        trainer.close()
    for name in before:
        torch.testing.assert_close(split[name], grads[name], rtol=1e-4, atol=1e-8)


def test_non_finite_behaviour_logprob_skips_the_step():
    trainer = _trainer()
    try:
        batch = _batch(trainer)
        first = batch.response_mask[0].nonzero()[0, 0]
        batch.behav_logprobs[0, first] = float("-inf")  # what a broken engine would send
        before = _params(trainer)
        metrics = trainer.step(batch)
        assert metrics["train/skipped_nonfinite"] == 1.0
        assert all(torch.equal(before[n], p) for n, p in _params(trainer).items())
        assert not trainer.stack.optimizer.state  # no moment was touched either
    finally:
        trainer.close()


def test_state_round_trip_continues_identically(tmp_path):
    trainer = _trainer()
    try:
        batch = _batch(trainer, behav_from_model=False)
        trainer.step(batch)
        torch.save(trainer.state(), tmp_path / "s.pt")
        trainer.step(batch)
        expected = _params(trainer)
    finally:
        trainer.close()
    resumed = _trainer()
    try:
        resumed.load_state(torch.load(tmp_path / "s.pt", weights_only=False))
        resumed.step(batch)
        assert all(torch.equal(expected[n], p) for n, p in _params(resumed).items())
    finally:
        resumed.close()


def test_a_state_of_another_model_names_the_tensors_that_differ():
    """Instead of torch's bare "Error(s) in loading state_dict": which tensors differ and what to do."""
    trainer = _trainer()
    try:
        state = trainer.state()
        model = state["model"]
        names = [k for k, v in model.items() if isinstance(v, torch.Tensor)]
        dropped, grown = names[0], names[1]
        del model[dropped]
        model[grown] = torch.zeros(*model[grown].shape[:-1], model[grown].shape[-1] + 1)
        model["decoder.layers.9.mlp.linear_fc1.weight"] = torch.zeros(2, 2)
        with pytest.raises(ValueError) as err:
            trainer.load_state(state, source="ckpt/step_00000003")
        message = str(err.value)
        assert message.startswith("ckpt/step_00000003 holds another model or layout: resume with the model.path")
        assert (f"(1 only in this run's model: {dropped}; 1 only in the checkpoint: "
                f"decoder.layers.9.mlp.linear_fc1.weight; 1 of another shape: {grown} ") in message
        assert "\n" not in message
    finally:
        trainer.close()


@pytest.mark.parametrize(("precision", "model", "scope"), [("int8", "tiny-llama", "all"),
                                                        ("fp4_rc", "tiny-qwen3_moe", "experts")])
def test_export_gives_hf_named_bf16_tensors_with_uaq_folded_in(precision, model, scope):
    """What the engines get is the trainer's UAQ-scaled weights, over the precision's UAQ scope (an FP4 engine
    quantizes the W/s its trainer quantizes)."""
    from qurl_mcore.megatron.convert import read_hf_state
    from qurl_mcore.uaq import uaq_scale_hf

    from qurl_mcore.megatron import export_hf_weights

    trainer = _trainer("uaq.enabled=true", f"precision={precision}", f"model.path={model}")
    try:  # what push_weights streams to the engines (bf16 engines)
        exported = {n: t for bucket in export_hf_weights(trainer.model, trainer.hf, bucket_bytes=1 << 20,
                                                         dtype=torch.bfloat16) for n, t in bucket}
    finally:
        trainer.close()
    hf = read_hf_state(trainer.hf_dir)
    assert set(exported) == set(hf)
    for name, tensor in hf.items():
        assert exported[name].dtype == torch.bfloat16
        want = uaq_scale_hf(name, tensor.float(), 1.5, scope=scope).bfloat16().float()
        torch.testing.assert_close(exported[name].float(), want, rtol=1e-2, atol=1e-6)


def test_the_training_forward_is_pi_prox():
    """A batch takes one optimizer step, so `step` reads π_prox off its own training forward: that forward must
    equal a separate no-grad pass with the same weights, bit for bit."""
    trainer = _trainer("train.micro_batch_size=8")
    try:
        batch = _batch(trainer)
        trainer.model.train()
        trained = token_logprobs(trainer.model, batch.input_ids, attention_mask=batch.attention_mask,
                                 grad=True).logprobs.detach()
        assert torch.equal(trained, trainer._forward_only(trainer.model, batch))
    finally:
        trainer.close()


class _RecordingEngine(RolloutEngine):
    """The engine side of a tensor push, in process: it keeps only weak references to what it receives, and
    notes, whenever a bucket arrives, how many tensors of earlier buckets are still alive somewhere."""

    def __init__(self, config):
        super().__init__(config)
        self.received, self.alive_at_arrival, self.version = [], [], None

    def _generate(self, input_ids, sampling, extra):
        raise NotImplementedError

    def _control(self, call, **kwargs):
        if call == "update_weights_from_tensor":
            self.alive_at_arrival.append(sum(ref() is not None for ref in self.received))
            self.received += [weakref.ref(t) for _, t in kwargs["named_tensors"]]
        elif call == "update_weight_version":
            self.version = kwargs["new_version"]
        return True, ""

    def model_info(self):
        return {"weight_version": self.version}

    def shutdown(self):
        pass


def test_push_streams_one_bucket_at_a_time():
    """The push never holds the model: when bucket k reaches the engine, no tensor of buckets < k is alive
    (before, the trainer staged the whole export, list(export_hf_weights(...)))."""
    from qurl_mcore.loop.sampler import engine_config

    trainer = _trainer("rollout.push_bucket_mb=1")
    try:
        engine = _RecordingEngine(engine_config(trainer.cfg, trainer.recipe.engine, str(trainer.hf_dir), "cpu"))
        trainer.engines, trainer.engine_ids = [engine], [0]
        trainer.push_weights("v1")
    finally:
        trainer.close()
    assert engine.version == "v1" and len(engine.alive_at_arrival) >= 3
    assert engine.alive_at_arrival == [0] * len(engine.alive_at_arrival)


def test_export_of_a_trained_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    """Train a step in the UAQ parameterisation, checkpoint, `qurl export` it (UAQ undone): transformers
    computes the trained model's logits to fp32 rounding."""
    from transformers import AutoModelForCausalLM

    from qurl_mcore.cli import main
    from qurl_mcore.checkpoint import finalize

    trainer = _trainer("uaq.enabled=true", "precision=int8", "train.micro_batch_size=8")
    try:
        batch = _batch(trainer, behav_from_model=False)
        trainer.step(batch)
        ids = batch.input_ids[:2, :8]
        with torch.no_grad():
            trained = trainer.model(ids, torch.arange(8).expand_as(ids), None)
        files = trainer.save_checkpoint(str(tmp_path / "ckpt"), 1)
        finalize(tmp_path / "ckpt", 1, files, {"format": "torch_dist", "world_size": 1, "config": to_dict(trainer.cfg)})
    finally:
        trainer.close()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(ids).logits
    assert (logits - trained).abs().max() <= 1e-4 * trained.abs().max()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    # UAQ computes the same function either way: the weights tell whether it was undone (norm gains x1.5)
    from qurl_mcore.megatron.convert import read_hf_state

    name = "model.layers.0.input_layernorm.weight"
    source = read_hf_state(trainer.hf_dir)[name].float()
    assert (exported.state_dict()[name] - source).abs().max() < 0.01  # one Adam step of lr 1e-3 from the source


def _recording(trainer: PolicyTrainer, replace_prox=None) -> list:
    """Wrap the trainer's loss forward to record the π_prox each micro-batch trains against (optionally
    replacing it); returns the record list."""
    seen, original = [], trainer._loss_forward

    def loss_forward(model_chunk, micro):
        mb, prox, ref = micro
        if replace_prox is not None:
            prox = replace_prox(mb)
        seen.append(prox)
        return original(model_chunk, (mb, prox, ref))

    trainer._loss_forward = loss_forward
    return seen


def test_one_mini_batch_trains_against_its_own_forward_bitwise():
    """mini_batches=1 (the default) reads π_prox off the training forward; giving it the separate no-grad
    pass instead changes nothing, bit for bit: the one-step path is the decoupled one with one part."""
    results = []
    for precomputed in (False, True):
        trainer = _trainer("train.micro_batch_size=8")
        try:
            batch = _batch(trainer, behav_from_model=False)
            prox = trainer._forward_only(trainer.model, batch)
            seen = _recording(trainer, (lambda mb: prox) if precomputed else None)
            trainer.step(batch)
            results.append(_params(trainer))
            assert (seen[0] is None) != precomputed
        finally:
            trainer.close()
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_two_mini_batches_train_against_the_pre_update_policy():
    trainer = _trainer("train.mini_batches=2", "train.micro_batch_size=3")
    try:
        batch = _batch(trainer, behav_from_model=False)
        before = trainer._forward_only(trainer.model, batch)
        seen = _recording(trainer)
        metrics = trainer.step(batch)
        after = trainer._forward_only(trainer.model, batch)
    finally:
        trainer.close()
    assert len(seen) == 2 and torch.equal(torch.cat(seen), before)  # both parts: π before the first update
    assert not torch.equal(after[3:], before[3:])  # although the first update moved the second part's π
    assert metrics["train/skipped_nonfinite"] == 0.0
    steps = {int(s["step"]) for _, s in trainer.stack.optimizer.state.items()}
    assert steps == {2}  # two optimizer steps


def test_a_failing_export_is_the_trainers_error_not_an_engines(monkeypatch):
    """An error inside the export (a missing tensor, out of memory in the smoothing fold) is raised while the
    engine client consumes the stream; it ends the run as the trainer's, and no engine is blamed or restarted."""
    import qurl_mcore.megatron.convert as convert
    from qurl_mcore.loop.sampler import engine_config
    from qurl_mcore.loop.trainer import WeightExportError

    export = convert.export_hf_weights

    def export_failing_after_one_bucket(*args, **kwargs):
        stream = export(*args, **kwargs)
        yield next(stream)
        raise KeyError("model.layers.1.mlp.up_proj.weight")

    monkeypatch.setattr(convert, "export_hf_weights", export_failing_after_one_bucket)
    trainer = _trainer("rollout.push_bucket_mb=1")
    try:
        engine = _RecordingEngine(engine_config(trainer.cfg, trainer.recipe.engine, str(trainer.hf_dir), "cpu"))
        trainer.engines, trainer.engine_ids = [engine], [0]
        with pytest.raises(WeightExportError, match="exporting this rank's weights: KeyError: 'model.layers.1"):
            trainer.push_weights("v1")
    finally:
        trainer.close()


class _Answering:
    def __init__(self, answers: bool):
        self.answers = answers

    def model_info(self):
        if not self.answers:
            raise ConnectionError("refused")
        return {}


def test_a_push_failure_naming_no_engine_blames_the_one_that_stopped_answering():
    from qurl_mcore.loop.sampler import EngineFailure

    trainer = object.__new__(PolicyTrainer)  # only the engines matter here
    trainer.engines, trainer.engine_ids = [_Answering(True), _Answering(False), _Answering(True)], [0, 1, 2]
    failure = trainer._engine_failure(RuntimeError("gloo: connection closed by peer"), [0, 1, 2])
    assert isinstance(failure, EngineFailure) and failure.index == 1
    trainer.engines[1].answers = True  # every engine answers: the sender's side broke
    with pytest.raises(RuntimeError, match="weight push failed while every engine still answers"):
        trainer._engine_failure(RuntimeError("gloo: connection closed by peer"), [0, 1, 2])


def test_a_non_finite_weight_is_named_where_the_weights_are_read(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from qurl_mcore.models import resolve_model_path

    model = tmp_path / "nan-llama"
    shutil.copytree(resolve_model_path("tiny-llama"), model)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("mlp.up_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    from qurl_mcore.megatron.parallel import destroy_parallel

    try:
        with pytest.raises(ValueError, match=rf"{model}: weight decoder\.layers\.\d+\.mlp\.linear_fc1\.weight holds "
                                             r"1 non-finite value\(s\) \(NaN or Inf\)"):
            _trainer(f"model.path={model}")
    finally:
        destroy_parallel()  # the trainer that failed to start cannot close its own


def test_a_micro_batch_reads_nothing_back_to_the_host():
    """The loss and metrics of every micro-batch stay on the device (what would be a GPU synchronization is a
    value read by the host: tests/host_syncs.py); the step reads the metrics back once."""
    from tests.host_syncs import HostReads

    trainer = _trainer("train.micro_batch_size=2")
    try:
        batch = _batch(trainer, behav_from_model=False)
        reads, original = [], trainer._loss_forward

        def counted(model_chunk, micro):
            logits, loss_func = original(model_chunk, micro)

            def loss_with_reads(out):
                with HostReads() as r:
                    result = loss_func(out)
                reads.append(r.count)
                return result

            return logits, loss_with_reads

        trainer._loss_forward = counted
        reduce = trainer._reduce_metrics
        records = []
        trainer._reduce_metrics = lambda out: records.append(out) or reduce(out)
        metrics = trainer.step(batch)
        with HostReads() as r:
            again = reduce(records[0])
    finally:
        trainer.close()
    assert reads == [0, 0, 0]
    assert r.count == 1 and again["loss/total"] == metrics["loss/total"]


def test_a_micro_batch_without_response_tokens_adds_nothing_to_the_update():
    """A micro-batch whose rows score no token (a DP rank short of rows gets a fully masked one) gives the
    update of the batch without it, and the step is not skipped."""
    updates = []
    for drop in (False, True):
        trainer = _trainer("train.micro_batch_size=2")
        try:
            batch = _batch(trainer, behav_from_model=False)
            if drop:
                batch = batch.select(slice(0, 4))
            else:
                batch.response_mask[4:] = False
            before = _params(trainer)
            metrics = trainer.step(batch)
            updates.append({n: p - before[n] for n, p in _params(trainer).items()})
        finally:
            trainer.close()
        assert metrics["train/skipped_nonfinite"] == 0.0
    for name, update in updates[0].items():
        torch.testing.assert_close(update, updates[1][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow  # a fresh process, whose peak memory is the step's own (about a minute)
def test_a_cpu_steps_memory_is_the_plans_at_fp32():
    """What `qurl train --check` estimates on CPUs: the rise of the peak resident memory over a first step is the
    plan's activations of one micro-batch at fp32 (logits over 2048 tokens dominate) plus Adam's two moments,
    which the first step makes, within 15%."""
    from qurl_mcore.megatron.parallel import spawn

    from . import workers

    out = spawn(workers.step_memory, 1, 512, 4)[0]
    plan = out["plan"]
    assert out["rise"] == pytest.approx(plan["peak"] - plan["static"] + plan["optimizer"]["replicated"], rel=0.15)
