"""The verl adapter against the real verl 0.9.1: its registry, its rollout-correction weights, its own losses'
normalisation, and its SGLang server's arguments (docs/integrations.md, "verl")."""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import FSDPActorConfig, HFModelConfig, PolicyLossConfig, RolloutConfig

from qurl_mcore.integrations.verl import AGG_MODES, REGISTERED_LOSSES, uaq_start_checkpoint
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.rl.losses import policy_loss

from ..patching.copies import installed_copy
from .verl_server import PATCHED, ROLLOUT, patched_rollout, sglang_server

HOOK_MODULE = "qurl_mcore.integrations.verl_rollout"  # verl's VERL_USE_EXTERNAL_MODULES loads it at `import verl`

# verl's loss_agg_mode -> our aggregation of the same micro-batch reduction (verl's agg_loss in core_algos.py)
SAME_REDUCTION = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
                  "seq-mean-token-sum": "seq_mean_token_sum"}
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 3.0  # CAP: not policy_loss's default tis_cap, so the mapping shows


def actor_config(mode: str, method: str = "acr", **kw) -> FSDPActorConfig:
    """The actor config a verl run with docs/integrations.md's settings builds; rollout_correction is the dict
    Hydra makes of `++actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=...`."""
    return FSDPActorConfig(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, loss_agg_mode=mode, rollout_n=1,
                           ppo_micro_batch_size_per_gpu=2, **kw,
                           policy_loss=PolicyLossConfig(loss_mode=method,
                                                        rollout_correction={"rollout_is_threshold": CAP}))


def batch(rows: int = 6, cols: int = 9, mismatch: float = 0.8, empty_row: bool = True, seed: int = 0) -> dict:
    """Log-probs of π_prox (old), π_behav (rollout, off by ~`mismatch` nats: r spans both sides of every bound)
    and π_θ (a leaf), per-token advantages, and a response mask with ragged ends (and one empty row)."""
    g = torch.Generator().manual_seed(seed)
    f64 = {"generator": g, "dtype": torch.float64}
    old = -3 * torch.rand(rows, cols, **f64)
    mask = torch.arange(cols) < torch.randint(1, cols + 1, (rows, 1), generator=g)
    if empty_row:
        mask[1] = False
    return {"old": old, "rollout": old + mismatch * torch.randn(rows, cols, **f64),
            "log_prob": (old + 0.3 * torch.randn(rows, cols, **f64)).requires_grad_(),
            "advantages": torch.randn(rows, cols, **f64), "mask": mask}


def verl_weights(b: dict) -> torch.Tensor:
    """rollout_is_weights as verl's trainer computes them with rollout_is=token, rollout_is_threshold=inf."""
    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        b["old"], b["rollout"], b["mask"], rollout_is="token", rollout_is_threshold=math.inf)
    return weights.batch["rollout_is_weights"]


def verl_loss(method: str, b: dict, config, weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss verl's actor (verl/workers/utils/losses.py) gets from `method`, and its gradient."""
    lp = b["log_prob"].detach().clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn(method)(
        old_log_prob=b["old"], log_prob=lp, advantages=b["advantages"], response_mask=b["mask"],
        loss_agg_mode=config.loss_agg_mode, config=config,
        rollout_is_weights=verl_weights(b) if weights is None else weights)
    loss.backward()
    return loss.detach(), lp.grad


def ours(method: str, b: dict, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    lp = b["log_prob"].detach().clone().requires_grad_()
    loss, _ = policy_loss(lp, b["old"], b["rollout"], b["advantages"], b["mask"], method=method,
                          eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP, agg=agg)
    loss.backward()
    return loss.detach(), lp.grad


def take(b: dict, part: slice) -> dict:
    return {k: v[part] for k, v in b.items()}


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
@pytest.mark.parametrize("method", REGISTERED_LOSSES)
def test_registered_loss_is_policy_loss(method, mode):
    b = batch()
    loss, grad = verl_loss(method, b, actor_config(mode, method))
    expected, expected_grad = ours(method, b, SAME_REDUCTION[mode])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    # the inputs reach every branch: r beyond the cap, and ratios clipped at both ends
    _, metrics = policy_loss(b["log_prob"], b["old"], b["rollout"], b["advantages"], b["mask"], method=method,
                             eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP)
    assert metrics["is_ratio/truncated_frac"] > 0 and metrics["clip_frac/low"] > 0 and metrics["clip_frac/high"] > 0


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
def test_ranks_and_micro_batches_add_up_to_the_batch(mode):
    """verl normalises each micro-batch by its whole mini-batch (global_batch_info) and averages gradients over
    DP ranks: 2 ranks × 2 micro-batches of the adapter's loss make the mini-batch's `policy_loss`."""
    b = batch(rows=8, empty_row=False)  # verl counts every row of the mini-batch; ours only non-empty ones
    config = actor_config(mode)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=int(b["mask"].sum()), global_batch_size=8)
    parts = [verl_loss("acr", take(b, slice(i, i + 2)), config) for i in range(0, 8, 2)]
    expected, expected_grad = ours("acr", b, SAME_REDUCTION[mode])
    torch.testing.assert_close(sum(loss for loss, _ in parts) / 2, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.cat([grad for _, grad in parts]) / 2, expected_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", list(SAME_REDUCTION))
def test_normalisation_is_verls(mode):
    """Without mismatch ACR is PPO, so the adapter must return exactly what verl's own `vanilla` loss returns
    (dual clip off) for the same micro-batch and global_batch_info, an empty row included."""
    b = batch(mismatch=0.0)
    config = actor_config(mode, clip_ratio_c=1e9)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=3 * int(b["mask"].sum()), global_batch_size=20)
    loss, grad = verl_loss("acr", b, config)
    expected, expected_grad = verl_loss("vanilla", b, config, weights=torch.ones_like(b["old"]))
    torch.testing.assert_close(loss, expected, rtol=1e-7, atol=0)  # verl's seq-mean-token-mean adds 1e-8
    torch.testing.assert_close(grad, expected_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum-norm"])
def test_unsupported_aggregation_raises(mode):
    assert set(AGG_MODES) == set(SAME_REDUCTION)  # supported: the modes with a counterpart, no other
    with pytest.raises(ValueError, match=f"loss_agg_mode '{mode}' is not supported.*token-mean"):
        verl_loss("acr", batch(), actor_config(mode))


def test_missing_or_truncating_rollout_weights_raise():
    b, config = batch(), actor_config("token-mean")
    fn = core_algos.get_policy_loss_fn("acr")
    args = {"old_log_prob": b["old"], "log_prob": b["log_prob"], "advantages": b["advantages"],
            "response_mask": b["mask"], "loss_agg_mode": "token-mean", "config": config}
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is=token"):
        fn(**args, rollout_is_weights=None)
    icepop, _, _ = compute_rollout_correction_and_rejection_mask(  # zero weights outside [0.5, 2]
        b["old"], b["rollout"], b["mask"], rollout_is="token", rollout_is_threshold="0.5_2.0")
    with pytest.raises(ValueError, match="rollout_is_threshold=inf"):
        fn(**args, rollout_is_weights=icepop.batch["rollout_is_weights"])


def test_empty_micro_batch_contributes_nothing():
    b = batch()
    b["mask"][:] = False
    loss, grad = verl_loss("acr", b, actor_config("token-mean"), weights=torch.zeros_like(b["old"]))
    assert loss.item() == 0 and not grad.any()


@pytest.fixture(scope="module")
def tiny_llama() -> str:
    return str(tiny_checkpoint("llama"))


def test_external_lib_registers_the_losses(monkeypatch, tiny_llama):
    """`actor_rollout_ref.model.external_lib` is imported by verl's HFModelConfig, which the actor worker builds
    before its loss (verl/workers/engine_workers.py:540, verl/workers/config/model.py:149)."""
    for method in REGISTERED_LOSSES:
        monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, method)
    monkeypatch.delitem(sys.modules, "qurl_mcore.integrations.verl")
    HFModelConfig(path=tiny_llama, external_lib="qurl_mcore.integrations.verl")
    assert set(REGISTERED_LOSSES) <= set(core_algos.POLICY_LOSS_REGISTRY)


def test_uaq_start_checkpoint_is_the_same_model_in_uaqs_parameterisation(tmp_path, tiny_llama):
    """UAQ for verl is its run started from this copy: norm gains times s, the linears that read them divided by
    s, v and up (scaled and unscaled once each) and the embeddings as they were; transformers computes the same
    logits from it, up to the bf16 rounding of the scaled tensors (2^-8 relative)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    s = 1.5
    out = uaq_start_checkpoint(tiny_llama, tmp_path / "uaq", s)
    before, after = load_file(f"{tiny_llama}/model.safetensors"), load_file(f"{out}/model.safetensors")
    exponent = {"input_layernorm": 1, "post_attention_layernorm": 1, "q_proj": -1, "k_proj": -1, "o_proj": -1,
                "gate_proj": -1, "down_proj": -1, "v_proj": 0, "up_proj": 0, "embed_tokens": 0, "lm_head": 0}
    for name, tensor in before.items():
        k = next((k for part, k in exponent.items() if f".{part}." in f".{name}"), 0)
        assert torch.equal(after[name], (tensor.float() * s**k).to(tensor.dtype)), name
    assert sum(not torch.equal(before[n], after[n]) for n in before) == 7 * 2  # 7 tensors in each of 2 layers
    ids = torch.arange(1, 17)[None] * 37
    logits = [AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)(ids).logits for p in (tiny_llama, out)]
    assert (logits[0] - logits[1]).abs().max() < 1e-2 * logits[0].abs().max()


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory) -> Path:
    """A copy of the installed verl files that patches/verl/0.9.1 touches, with the set applied."""
    ps = installed_copy("verl", tmp_path_factory.mktemp("site"))
    assert ps.apply() == sorted(ps.patches)
    assert {fp.path for file_patches in ps.patches.values() for fp in file_patches} == \
        {f"{(ROLLOUT + name).replace('.', '/')}.py" for name in PATCHED}
    return ps.root


@pytest.fixture(scope="module")
def patched_verl(patched_site) -> SimpleNamespace:
    """verl's SGLang rollout modules, patched, in sys.modules for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        yield patched_rollout(patched_site, partial(mp.setitem, sys.modules))


def test_the_import_hook_patches_verl_as_qurl_patch_does(monkeypatch, patched_site, request):
    """Importing qurl_mcore.integrations.verl_rollout puts a hook first on sys.meta_path that loads the modules
    the pinned set changes from the installed files with the set applied in memory: the text `qurl patch apply`
    writes, shown by `inspect` too; the venv's files stay as published. The hook refuses to come after one of
    those modules was imported, and has nothing to do where the set is applied on disk."""
    import importlib
    import inspect

    from qurl_mcore.patching import PatchSet

    for name in [*(ROLLOUT + n for n in PATCHED), HOOK_MODULE]:  # absent during the test, as before it after
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    hooked = importlib.import_module(HOOK_MODULE)
    # the hook goes with this test; a finder that a module imported meanwhile added stays (sgl_kernel's stand-in
    # adds one for its submodules, and stays imported)
    request.addfinalizer(lambda: sys.meta_path.remove(hooked.HOOK))
    assert sys.meta_path[0] is hooked.HOOK
    paths = {ROLLOUT + n: f"{(ROLLOUT + n).replace('.', '/')}.py" for n in PATCHED}
    installed = PatchSet.installed("verl")
    assert hooked.HOOK.sources == {name: (installed.root / path, (patched_site / path).read_text())
                                   for name, path in paths.items()}
    engine = importlib.import_module(ROLLOUT + "http_server_engine")
    assert isinstance(engine.__spec__.loader, hooked.PatchedSourceLoader)
    assert not engine.AsyncHttpServerAdapter.__abstractmethods__  # patch 03: verl's rollout can connect
    assert '"begin_weight_update", {"selector"' in inspect.getsource(engine.AsyncHttpServerAdapter.begin_weight_update)
    assert set(installed.status().values()) == {"clean"}  # nothing written to site-packages
    with pytest.raises(ImportError, match="http_server_engine imported already, unpatched; load the hook"):
        hooked.install()
    assert hooked.patched_sources(PatchSet.load("verl", patched_site, installed.version)) == {}


def test_rollout_engine_kwargs_reach_sglang_server_args(monkeypatch, tiny_llama, patched_verl):
    """Patched, verl's SGLangHttpServer.launch_server gets past line 375 (dataclasses.fields of SGLang 0.5.23's
    msgspec ServerArgs), loads SGLang's plugins as SGLang's Engine does, and makes the ServerArgs its engine
    starts with: verl's keys, then `engine_kwargs.sglang`. The test stops it where the engine processes would
    start (Engine._launch_subprocesses) and resolves those arguments as that call does first."""
    from sglang.srt import plugins
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.http_server import Engine
    from sglang.srt.layers import quantization
    from verl.utils.device import get_visible_devices_keyword

    from qurl_mcore.sglang.quant_config import CONFIGS
    from qurl_mcore.sglang.options import QurlOptions

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    devices = get_visible_devices_keyword()  # the server sets it for its process: restored after the test
    monkeypatch.setenv(devices, os.environ.get(devices, ""))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)  # a fresh server process: nothing loaded yet
    for method in CONFIGS:
        monkeypatch.delitem(quantization.QUANTIZATION_METHODS, method, raising=False)

    class Launch(Exception):
        """Raised with the ServerArgs where verl would start the engine's processes."""

    def launch(server_args, **_):
        raise Launch(server_args)

    monkeypatch.setattr(Engine, "_launch_subprocesses", staticmethod(launch))
    override = QurlOptions.parse("qurl_int8", {"scope": "all"}).override_args()
    sglang_kwargs = {"quantization": "qurl_int8", "json_model_override_args": json.dumps(override),
                     "device": "cpu", "attention_backend": "torch_native"}  # the last two: this CPU machine
    server = sglang_server(patched_verl, sglang_kwargs, tiny_llama)
    with pytest.raises(Launch) as launched:
        asyncio.run(server.launch_server())
    server_args = launched.value.args[0]
    assert {k: getattr(server_args, k) for k in sglang_kwargs} == sglang_kwargs
    assert server_args.enable_weights_cpu_backup  # line 375's branch ran: HYBRID mode sets it, SGLang's default is off
    assert quantization.QUANTIZATION_METHODS["qurl_int8"] is CONFIGS["qurl_int8"]  # verl loaded our plugin

    server_args.resolve_once()  # what Engine._launch_subprocesses does first
    model = ModelConfig.from_server_args(server_args)
    assert (server_args.quantization, model.quantization) == ("qurl_int8", "qurl_int8")
    assert model.hf_config.quantization_config == override["quantization_config"]
    assert quantization.get_quantization_config(model.quantization) is CONFIGS["qurl_int8"]


@pytest.mark.slow  # a real engine: `make test`, not test-fast
def test_patched_verl_launches_sglang_and_updates_its_weights(tiny_llama, patched_verl, monkeypatch, tmp_path):
    """Patched, verl 0.9.1 runs SGLang 0.5.23 with our plugin: its SGLangHttpServer.launch_server, in a process of
    its own as in a verl run (verl_server.py) and patched there at import (`VERL_USE_EXTERNAL_MODULES=
    qurl_mcore.integrations.verl_rollout`, the installed files as published), starts a CPU engine with
    `quantization: qurl_int8` and verl's default `load_format: dummy`; its ServerAdapter.update_weights, here,
    pushes weights in SGLang's update session. After each push the engine serves the quantized reference of a
    checkpoint holding the pushed weights (re-quantized at the session's end) and is tagged with verl's
    global_steps; a push that fails midway still closes the session and tags the engine `incomplete:<steps>`;
    pushing the checkpoint again restores the first push's engine bitwise. Last, verl's delta checkpoint engine
    (`checkpoint_engine.backend=delta_sharded`): two sparse flushes, as its `receive_weights` yields them, changing
    half the entries of layer 0's projections, go through `update_weights(wire_format="delta_flush")` and verl's own
    loader (`delta_loader.apply_delta`, registered as SGLang's custom weight loader): the engine then serves the
    quantized reference of the original weights with those entries changed, and is tagged with the step.

    Stand-ins for what a CPU host without Ray or CUDA lacks: the ServerAdapter gets the server's address as its
    Ray lookup would (`_init_server_adapter`) and records the global_steps it would send the server's actor,
    verl's device (it has no CPU platform) is the CPU, and each bucket and delta flush travels as CPU shared memory
    (`cpu_ipc`, `cpu_delta_flush`)."""
    import selectors
    import signal
    import subprocess
    import time

    import torch.distributed as dist
    import torch.multiprocessing as mp
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from torch.distributed.device_mesh import init_device_mesh
    from verl.checkpoint_engine.delta_sync.encode import DeltaParam, checksum
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.rollout.sglang_rollout.delta_loader import LOADER_FQN

    from qurl_mcore.rollout import EngineConfig, HttpEngine
    from qurl_mcore.transfer import free_port

    from ..sglang.conftest import checkpoint_tensors, prompt_ids, score, write_checkpoint
    from ..sglang.reference import reference_model, token_logprobs

    monkeypatch.setenv("RANK", "0")  # what Ray sets for verl's rollout worker
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    sr = patched_verl.sglang_rollout
    monkeypatch.setattr(sr, "get_device_id", lambda: "cpu")

    async def cpu_ipc(engine, params_batch, device_mesh_key, device_mesh, load_format=None):
        """SGLang's `weight_sync.utils.update_weights`, which verl calls per bucket, for one TP rank and CPU
        tensors: SGLang's helper rewrites torch's tensor pickling for CUDA IPC (device -> GPU uuid, patch_torch.py)
        and fails on a CPU tensor, so here the bucket is pickled plainly, storages as shared-memory files."""
        assert device_mesh[device_mesh_key].size() == 1
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[MultiprocessingSerializer.serialize(
            params_batch)], load_format=load_format)
        return await engine.update_weights_from_tensor(req)

    monkeypatch.setattr(sr, "sgl_update_weights", cpu_ipc)

    async def cpu_delta_flush(self, params_batch, flush_cache: bool):
        """`ServerAdapter._update_weights_delta_flush`, which inlines the same CUDA IPC pickling, for one TP rank."""
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[MultiprocessingSerializer.serialize(
            params_batch)], load_format=LOADER_FQN, flush_cache=flush_cache)
        return await self._engine.update_weights_from_tensor(req)

    monkeypatch.setattr(sr.ServerAdapter, "_update_weights_delta_flush", cpu_delta_flush)

    # the engine of tests/sglang: fp32 activations, every request computes all its tokens
    engine = EngineConfig(tiny_llama, "qurl_int8", {"scope": "all"}, device="cpu", dtype="float32",
                          mem_fraction_static=0.2, max_total_tokens=4096, context_length=1024,
                          extra={"disable_radix_cache": True})
    sglang_kwargs = {k: v for k, v in engine.engine_kwargs().items() if k != "model_path"}
    sglang_kwargs["enable_memory_saver"] = False  # verl turns it on; it releases GPU memory, needs torch_memory_saver
    sglang_kwargs["custom_weight_loader"] = [LOADER_FQN]  # what verl adds for delta_sharded (async_sglang_server:284)
    rollout = RolloutConfig(name="sglang", tensor_model_parallel_size=1, engine_kwargs={"sglang": sglang_kwargs},
                            checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=1))
    model = HFModelConfig(path=tiny_llama)

    original = checkpoint_tensors(tiny_llama)
    gen = torch.Generator().manual_seed(1)
    noisy = {k: (v.float() + 0.2 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
             for k, v in original.items() if k.startswith("model.layers.0.") and k.endswith("proj.weight")}
    noisy["model.embed_tokens.weight"] = original["model.embed_tokens.weight"].flip(0)  # 12 MiB: its own bucket

    mask = {k: torch.rand(v.shape, generator=gen) < 0.5 for k, v in noisy.items() if k.startswith("model.layers.0.")}
    partial = {k: torch.where(m, noisy[k], original[k]) for k, m in mask.items()}

    def delta_flush(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """One flush as verl's delta engine yields it (delta_checkpoint_engine.py:358-391, `indices` encoding):
        per tensor, the positions where `partial` differs from `original` and its values there."""
        idx = [(partial[n] != original[n]).flatten().nonzero().flatten().to(torch.int32) for n in names]
        values = torch.cat([partial[n].flatten()[i.long()] for n, i in zip(names, idx)])
        params, pos, val = [], 0, 0
        for n, i in zip(names, idx):
            params.append(vars(DeltaParam(n, str(partial[n].dtype).removeprefix("torch."), list(partial[n].shape),
                                          pos, pos + 4 * i.numel(), 4, val, val + i.numel())))
            pos, val = pos + 4 * i.numel(), val + i.numel()
        positions = torch.cat(idx).view(torch.uint8)
        spec = {"encoding": "indices", "params": params, "checksum": checksum(positions, values)}
        return [("__delta_spec__", torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)),
                ("__positions__", positions), ("__values__", values)]

    def failing():
        """The trainer's weights, failing once the first bucket (the embedding) is full and sent."""
        yield "model.embed_tokens.weight", noisy["model.embed_tokens.weight"]
        yield "model.layers.0.self_attn.q_proj.weight", noisy["model.layers.0.self_attn.q_proj.weight"]
        raise RuntimeError("trainer failed midway")

    async def run(port: int) -> dict:
        client = HttpEngine(engine, f"http://127.0.0.1:{port}", timeout=120)
        steps = []

        async def set_global_steps(value):
            steps.append(value)

        adapter = sr.ServerAdapter(rollout, model, mesh, replica_rank=0)
        adapter._engine = patched_verl.http_server_engine.AsyncHttpServerAdapter(
            model_path=model.local_path, host="127.0.0.1", port=port, launch_server=False)
        adapter.server_actor = SimpleNamespace(set_global_steps=SimpleNamespace(remote=set_global_steps))
        got = {}

        async def pushed(global_steps: int, weights) -> str:
            """Push `weights` as verl does at `global_steps`; the engine's weight version after it."""
            await adapter.update_weights(weights, global_steps=global_steps)
            return (await asyncio.to_thread(client.model_info))["weight_version"]

        got["loaded"] = await pushed(1, iter(original.items()))  # the first sync replaces the dummy weights
        ids = prompt_ids(tiny_llama)
        greedy = (await asyncio.to_thread(client.generate, [ids], {"max_new_tokens": 8, "temperature": 0.0}))[0]
        got["seq"] = ids + greedy.output_ids
        got["base"] = await asyncio.to_thread(score, client, got["seq"])
        got["noisy"] = await pushed(2, iter(noisy.items()))
        got["pushed"] = await asyncio.to_thread(score, client, got["seq"])
        with pytest.raises(RuntimeError, match="midway"):
            await pushed(3, failing())
        got["failed"] = (await asyncio.to_thread(client.model_info))["weight_version"]
        got["restored_version"] = await pushed(4, iter(original.items()))  # a new session opens
        got["restored"] = await asyncio.to_thread(score, client, got["seq"])
        names = sorted(partial)
        await adapter.update_weights(iter([(delta_flush(names[::2]), False), (delta_flush(names[1::2]), True)]),
                                     global_steps=5, wire_format="delta_flush")
        got["delta_version"] = (await asyncio.to_thread(client.model_info))["weight_version"]
        got["delta"] = await asyncio.to_thread(score, client, got["seq"])
        got["steps"] = steps
        return got

    server = subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.verl_server", tiny_llama, json.dumps(sglang_kwargs)],
        cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "VERL_USE_EXTERNAL_MODULES": HOOK_MODULE})
    sharing = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # a server we did not fork cannot take file descriptors: named files
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(server.stdout, selectors.EVENT_READ)
            deadline, line = time.monotonic() + 300, ""
            while not line.startswith("PORT ") and server.poll() is None and sel.select(deadline - time.monotonic()):
                line = server.stdout.readline()
        assert line.startswith("PORT "), f"verl's server did not start (exit code {server.poll()})"
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))
        got = asyncio.run(run(int(line.split()[1])))
    finally:
        dist.destroy_process_group()
        mp.set_sharing_strategy(sharing)
        os.killpg(server.pid, signal.SIGKILL)  # the server and its SGLang processes, as Ray ends an actor
        server.wait()

    def reference(tensors: dict, name: str) -> torch.Tensor:
        """The quantized reference's log-probs of the sequence, from a checkpoint holding `tensors`."""
        path = write_checkpoint(tiny_llama, {**original, **tensors}, tmp_path / name)
        return token_logprobs(reference_model(path, engine.options().recipe.spec, "all", torch.float32), got["seq"])

    assert [got[k] for k in ("loaded", "noisy", "failed", "restored_version", "delta_version", "steps")] == \
        ["1", "2", "incomplete:3", "4", "5", [1, 2, 4, 5]]
    assert (got["base"] - reference({}, "checkpoint")).abs().max() < 2e-3  # tolerance: tests/sglang
    assert not torch.equal(got["pushed"], got["base"])
    assert (got["pushed"] - reference(noisy, "noisy")).abs().max() < 2e-3
    assert torch.equal(got["restored"], got["base"])
    assert (got["delta"] - reference(partial, "delta")).abs().max() < 2e-3
    assert (got["delta"] - got["pushed"]).abs().max() > 1e-2 and (got["delta"] - got["base"]).abs().max() > 1e-2
