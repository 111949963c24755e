"""`qurl plan` (qurl_mcore/sizing/) against the world: parameter counts of real HF models, the bytes of a real
trainer's tensors after a step, the bytes and buckets a real weight push streams, real quantized tensors, the
shipped GPU configs, and the command line. Activations are not measured here: the CPU trainer runs Megatron's
local attention in fp32, not the GPU path (bf16, SDPA) the activation formula describes."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from qurl_mcore.config import load_config
from qurl_mcore.models.cards import CARDS, card
from qurl_mcore.models.registry import hf_linears, shape
from qurl_mcore.models.slots import LINEAR_GROUPS
from qurl_mcore.quant.formats import FORMATS
from qurl_mcore.rollout.codes import CodePush, engine_units
from qurl_mcore.sizing import (
    activation_bytes,
    batch_bytes,
    check_fits,
    hf_tensors,
    layer_activation_bytes,
    model_config,
    parameter_count,
    push_bytes,
    size_run,
    trainer_bytes,
)

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


def _hf_numel(path) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    saved = model.state_dict().keys()  # and the buffers a checkpoint holds: DeepSeek-V3's router expert bias
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in saved)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3_moe", "tiny-mixtral",
                                   "tiny-qwen2_moe", "tiny-deepseek_v3", "tiny-glm4_moe", "smollm2"])
def test_parameter_count_equals_the_hf_model(model):
    hf, source = model_config(model)
    s = shape(hf)
    assert parameter_count(s) == _hf_numel(Path(source).parent)
    # the linears a scope can quantize are the planner's linear weights (precision.py's list, not a copy)
    linears = {t.name for t in hf_tensors(s) if t.kind in LINEAR_GROUPS and t.name.endswith(".weight")}
    assert linears == {n + ".weight" for n in hf_linears(hf)}
    assert all(t.kind == hf_linears(hf)[t.name.removesuffix(".weight")] for t in hf_tensors(s) if t.name in linears)


#: the parameter totals on the models' Hugging Face pages (rounded as the pages print them)
PUBLISHED_B = {"Qwen2.5-0.5B": 0.494, "DeepSeek-R1-Distill-Qwen-1.5B": 1.78, "Qwen2.5-7B": 7.62,
               "Qwen2.5-Math-7B": 7.62, "Qwen2.5-32B": 32.8, "Qwen3-8B": 8.19, "Qwen3-30B-A3B": 30.5,
               "Qwen3-235B-A22B": 235.0, "Llama-3.1-8B": 8.03, "Llama-3.1-70B": 70.6,
               "Mixtral-8x7B": 46.7, "Qwen1.5-MoE-A2.7B": 14.3}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_cards_count_the_published_parameters(name):
    count = parameter_count(shape(card(name)))
    assert count / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.002)


#: published totals rounded to 1B (GLM's announcements), DeepSeek-V3's main model without its MTP module
PUBLISHED_ROUNDED_B = {"DeepSeek-V3": 671.0, "GLM-4.5": 355.0, "GLM-4.5-Air": 106.0}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED_B))
def test_large_moe_cards_count_the_published_parameters_within_one_percent(name):
    count = parameter_count(shape(card(name)))
    assert count / 1e9 == pytest.approx(PUBLISHED_ROUNDED_B[name], rel=0.01)


def test_mla_kv_cache_is_the_latent_and_the_rope_key():
    """DeepSeek-V3 caches 512 latent + 64 RoPE-key values per token and layer, over 61 layers, in BF16, on every
    TP rank (the latent is shared by all heads): 61·576·2 bytes; grouped-query GLM-4.5 2·L·g·d·2, split over
    TP."""
    assert shape(card("DeepSeek-V3")).kv_bytes_per_token(2, tp=8) == 61 * 576 * 2
    assert shape(card("GLM-4.5")).kv_bytes_per_token(2, tp=8) == 2 * 92 * 1 * 128 * 2


def test_cards_by_path_and_instruct_suffix():
    assert card("/models/Qwen2.5-32B-Instruct") == CARDS["Qwen2.5-32B"]
    with pytest.raises(KeyError, match="no architecture card for 'Mystery-9B'"):
        card("Mystery-9B")


# ---- the trainer and the push, measured on a real SmolLM2 trainer (fp32 on CPU) ----------------------------

BUCKET_MB = 16
#: the precisions whose code push the plan is checked against (8-bit and FP4)
CODE_PUSHES = ("int8", "fp4")


@pytest.fixture(scope="module")
def smollm2_trainer():
    """One PolicyTrainer step on SmolLM2-135M, then its tensors and its weight export."""
    from qurl_mcore.loop.batch import Sample, collate
    from qurl_mcore.loop.trainer import PolicyTrainer
    from qurl_mcore.megatron import export_hf_weights

    cfg = load_config(None, ["model.path=smollm2", "precision=bf16", "uaq.enabled=false", "train.micro_batch_size=4",
                             f"rollout.push_bucket_mb={BUCKET_MB}"])
    trainer = PolicyTrainer(cfg, cfg.recipe())
    try:
        g = torch.Generator().manual_seed(0)
        samples = [Sample(ids[:4], ids[4:], [0.0] * 4, group=i // 2)
                   for i, ids in enumerate(torch.randint(3, 1000, (4, 8), generator=g).tolist())]
        batch = collate(samples, torch.tensor([1.0, -1.0, 1.0, -1.0]), pad_id=0)
        with torch.no_grad():
            own = trainer._forward_only(trainer.model, batch)
        batch.behav_logprobs = torch.where(batch.response_mask, own, 0.0)
        trainer.step(batch)
        storages: dict[int, int] = {}  # distinct storages: param.grad is a view of DDP's main_grad buffer

        def add(t):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        params = list(trainer.model.parameters())
        for p in params:
            add(p)
            add(p.grad)
            add(getattr(p, "main_grad", None))
        for _, state in trainer.stack.optimizer.state.items():  # Megatron's ProxyDict has no values()
            for value in state.values():
                if torch.is_tensor(value):
                    add(value)
        def export():
            return export_hf_weights(trainer.model, trainer.hf, bucket_bytes=BUCKET_MB << 20, dtype=torch.bfloat16)

        exported = [[(n, t.numel() * t.element_size()) for n, t in bucket] for bucket in export()]
        codes = {}  # precision -> what its code push sends the engine, tensor by tensor (the client re-buckets)
        for precision in CODE_PUSHES:
            engine = load_config(None, [f"precision={precision}"]).recipe().engine
            push = CodePush(engine.spec, engine_units(trainer.hf, engine.groups))
            codes[precision] = [(n, t.nbytes) for bucket in push.buckets(export()) for n, t in bucket]
        yield cfg, sum(p.numel() for p in params), sum(storages.values()), exported, codes
    finally:
        trainer.close()


def test_trainer_bytes_match_a_real_step(smollm2_trainer):
    cfg, numel, measured, _, _ = smollm2_trainer
    s = shape(model_config("smollm2")[0])
    planned = trainer_bytes(s, cfg, cuda=False)
    assert planned["parameters"] == numel
    # fp32: params 4 + gradients 4 (the DDP buffer) + Adam 8 bytes per parameter, no main params
    assert planned["static"] == 16 * numel
    assert planned["static"] == pytest.approx(measured, rel=0.10)


def test_push_bytes_and_buckets_match_the_export(smollm2_trainer):
    cfg, _, _, exported, _ = smollm2_trainer
    s = shape(model_config("smollm2")[0])
    push = push_bytes(s, cfg)
    assert push["bytes"] == sum(n for bucket in exported for _, n in bucket)
    assert push["buckets"] == len(exported) > 1
    assert [(t.name, 2 * t.numel) for t in hf_tensors(s)] == [x for bucket in exported for x in bucket]


@pytest.mark.parametrize("precision", CODE_PUSHES)
def test_a_code_push_plans_its_wire_bytes_and_no_masters(smollm2_trainer, precision):
    """rollout.push=codes: the plan's push is the bytes and buckets (the engine client's, `transfer.buckets`) of
    the code push of the real export, and its engines keep no masters (none on the host); rollout.push=bf16 keeps
    them, and the push is the BF16 export's."""
    from qurl_mcore.sizing import GPUS, engine_bytes
    from qurl_mcore.transfer import buckets

    _, _, _, exported, codes = smollm2_trainer
    s = shape(model_config("smollm2")[0])
    over = ["model.path=smollm2", f"precision={precision}", f"rollout.push_bucket_mb={BUCKET_MB}"]
    cfg = load_config(None, [*over, "rollout.push=codes"])
    sent = codes[precision]
    push = push_bytes(s, cfg)
    assert push["bytes"] == sum(n for _, n in sent) < sum(n for bucket in exported for _, n in bucket)
    stream = ((name, torch.empty(n, dtype=torch.uint8)) for name, n in sent)
    assert push["buckets"] == len(list(buckets(stream, BUCKET_MB << 20))) > 1
    assert push["codes"] == cfg.resolved_precision()[2]
    engine = engine_bytes(s, cfg, GPUS["h100-80g"])
    assert engine["master"] == "none" and engine["host_masters"] == 0
    bf16 = load_config(None, [*over, "rollout.push=bf16"])
    assert engine_bytes(s, bf16, GPUS["h100-80g"])["host_masters"] > 0
    assert push_bytes(s, bf16)["bytes"] == sum(n for bucket in exported for _, n in bucket)


@pytest.mark.parametrize("model,over", [("tiny-llama", ["precision=int8"]),
                                        ("tiny-qwen3_moe", ["precision=fp4", "fp4_format=nvfp4", "scope=all"])])
def test_a_code_push_to_tp_engines_plans_the_bytes_of_every_ranks_shard(model, over):
    """At rollout.tp_size t each engine rank quantizes its own shard of a unit: the plan's code push is the bytes of
    the code push's stream for engines of that TP (`CodePush` over the export's tensors), and for INT8 (per-channel
    scales) t = 2 adds 4·rows·(t − 1) bytes per row-parallel weight (its scales travel as [rows, t]) to t = 1."""
    hf, _ = model_config(model)
    s = shape(hf)
    plans = {}
    for tp in (1, 2):
        cfg = load_config(None, [f"model.path={model}", *over, f"rollout.tp_size={tp}", "rollout.push=codes"])
        engine = cfg.recipe().engine
        push = CodePush(engine.spec, engine_units(hf, engine.groups, tp))
        gen = torch.Generator().manual_seed(0)
        stream = [[(x.name, torch.randn(x.shape, generator=gen).to(torch.bfloat16)) for x in hf_tensors(s)]]
        sent = sum(t.numel() * t.element_size() for bucket in push.buckets(stream) for _, t in bucket)
        plans[tp] = push_bytes(s, cfg)["bytes"]
        assert plans[tp] == sent, tp
    if over == ["precision=int8"]:
        rows = sum(x.shape[0] for x in hf_tensors(s) if x.columns and x.kind in ("attention", "mlp"))
        assert rows and plans[2] - plans[1] == 4 * rows


@pytest.mark.parametrize("model", ["tiny-glm4_moe", "tiny-deepseek_v3"])
def test_push_bytes_keep_the_routers_expert_bias_in_fp32(model):
    """A BF16 push of an MoE whose router has an expert bias sends that bias in fp32, as the export casts it
    (`megatron.convert.export_cast`): the plan's bytes are the cast checkpoint's."""
    from qurl_mcore.megatron.convert import export_cast, read_hf_state
    from qurl_mcore.models import resolve_model_path

    hf, _ = model_config(model)
    cast = export_cast(hf, torch.bfloat16)
    state = read_hf_state(resolve_model_path(model))
    assert any(cast(n, t).dtype == torch.float32 for n, t in state.items())
    planned = push_bytes(shape(hf), load_config(None, [f"model.path={model}", "precision=bf16"]))
    assert planned["bytes"] == sum(cast(n, t).nbytes for n, t in state.items())


# ---- hand-derived values -------------------------------------------------------------------------------

def test_trainer_states_by_hand():
    """Tiny Llama (h 128, i 256, 2 layers, 4 heads of 32, 2 KV heads, V 49152, untied) at TP 2 x DP 2, bf16."""
    hf, _ = model_config("tiny-llama")
    cfg = load_config(None, ["model.path=tiny-llama", "train.tp_size=2", "train.dp_size=2", "precision=bf16",
                             "uaq.enabled=false"])
    per_layer = (128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 128 * 256) // 2 + 2 * 128  # linears /TP, norms whole
    n = 2 * per_layer + 2 * 49152 * 128 // 2 + 128
    t = trainer_bytes(shape(hf), cfg, cuda=True)
    assert t["parameters"] == n
    assert (t["params"], t["gradients"]) == (2 * n, 4 * n)
    assert (t["main_params"]["distributed"], t["optimizer"]["distributed"]) == (4 * n // 2, 8 * n // 2)
    assert t["static"] == 2 * n + 4 * n + 12 * n // 2


def test_a_steps_batch_by_hand():
    """Every rank holds the whole batch at 14 bytes a token (ids 8, two masks, behaviour log-probs 4), with
    routing replay the engine's expert ids (2 bytes each, L·k a token), and its own rows' π_prox and π_ref."""
    big = ["data.prompts_per_step=2048", "rollout.samples_per_prompt=64", "rollout.context_length=1024"]
    dense = shape(card("Qwen3-8B"))
    assert batch_bytes(dense, load_config(None, big)) == 131072 * 1024 * 14
    both = load_config(None, [*big, "train.dp_size=2", "train.mini_batches=2", "train.kl_coef=0.1"])
    assert batch_bytes(dense, both) == 131072 * 1024 * 14 + 65536 * 1024 * (4 + 4)
    moe = shape(card("Qwen3-30B-A3B"))
    assert batch_bytes(moe, load_config(None, [*big, "train.routing_replay=r3"])) == 131072 * 1024 * (14 + 2 * 48 * 8)


def test_activations_by_hand():
    """Tiny Llama (GQA 4/2 heads of 32, no q/k norms) at b 2 x s 64, bf16: each layer's terms written out,
    RoPE's cos and sin per layer, full recompute's layer inputs plus one layer, the logits s·b·V·(e + 8)."""
    hf, _ = model_config("tiny-llama")
    cfg = load_config(None, ["model.path=tiny-llama", "precision=bf16", "uaq.enabled=false",
                             "rollout.context_length=64", "train.micro_batch_size=2"])
    s, e, tokens = shape(hf), 2, 64 * 2
    norm = e * 128 + e * 128 + 4  # input, normalised copy, 1/rms
    attention = norm + e * 128 + e * 4 * 32 + e * 4 * 32  # + QKV input, q after RoPE, o_proj input
    core = e * 64 + 4 * 4 + 2 * e * 4 * 32  # mask row, log-sum-exp, k and v repeated to 4 heads
    selective = e * 2 * 32 + e * (4 + 2 * 2) * 32  # k, and the QKV output v is a view of
    mlp = norm + e * 128 + 4 * e * 256 + e * 256  # + fc1 input, [gate; up], silu, up + 0, fc2 input
    assert layer_activation_bytes(s, cfg, e) == {"attention": attention, "core": core, "selective": selective,
                                                 "mlp": mlp, "dense_mlp": mlp}  # a dense model: one MLP
    rope = 4 * e * 32 * 64
    logits = tokens * 49152 * (e + 8)
    layer = tokens * (attention + core + mlp) + rope
    assert activation_bytes(s, cfg, "none") == [2 * layer + logits]
    assert activation_bytes(s, cfg, "selective") == [2 * (tokens * (attention + selective + mlp) + rope) + logits]
    assert activation_bytes(s, cfg, "full") == [2 * tokens * e * 128 + layer + logits]


@pytest.mark.parametrize("method,fmt", [("qurl_int8", "int8"), ("qurl_fp8", "fp8_e4m3"), ("qurl_fp4", "nvfp4"),
                                        ("qurl_fp4", "mxfp4"), ("qurl_fp4", "hif4")])
@pytest.mark.parametrize("shape", [(96, 64), (48, 72)])
def test_weight_format_bytes_equal_real_quantized_weights(method, fmt, shape):
    from qurl_mcore.quant import quantize_weight
    from qurl_mcore.recipe import engine_recipe

    q = quantize_weight(torch.randn(shape), engine_recipe(method, fmt).spec)
    real = sum(t.numel() * t.element_size() for t in (q.data, q.scale, q.global_scale) if t is not None)
    assert FORMATS[fmt].weight_bytes(*shape) == real


def test_check_fits_names_the_lever():
    hf, _ = model_config("/models/Qwen2.5-Math-7B")
    cfg = load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", ["train.recompute=none", "train.micro_batch_size=4"])
    problems = check_fits(cfg, hf, "h100-80g")
    assert len(problems) == 1 and "GiB short" in problems[0]
    assert "fixes (each alone): train.recompute=full" in problems[0]


def test_kv_cache_from_mem_fraction_by_hand():
    """SGLang keeps (1 − mem_fraction) of the GPU free and sizes the KV cache after its weights and CUDA graphs:
    tokens = (f·HBM − graphs − weights) // KV bytes per token (tiny Llama, bf16 engine: 2 layers x 2 KV heads
    x 32 x (K, V) x 2 bytes = 512 B a token)."""
    from qurl_mcore.sizing import GPUS, engine_bytes, sglang_reserve

    hf, _ = model_config("tiny-llama")
    s, gpu = shape(hf), GPUS["h100-80g"]
    cfg = load_config(None, ["model.path=tiny-llama", "precision=bf16", "rollout.mem_fraction=0.25"])
    e = engine_bytes(s, cfg, gpu)
    reserve, graphs = sglang_reserve(gpu, 1)
    weights = e["weights"]["gpu_weights"]
    assert weights == 2 * parameter_count(s) and e["kv_bytes_per_token"] == 512
    assert e["kv_tokens"] == int(0.25 * gpu.hbm - graphs - weights) // 512
    assert e["peak"] == weights + e["kv"] + reserve and e["released"] == reserve - graphs
    assert e["mem_fraction"] == math.ceil(100 * (weights + e["kv"] + graphs + 2**30) / gpu.hbm) / 100


def test_offload_follows_the_layout_and_the_device():
    cases = {("auto", "colocated", True): True, ("auto", "colocated", False): False,
             ("auto", "disaggregated", True): False, (True, "colocated", False): True,
             (False, "colocated", True): False}
    for (choice, layout, cuda), expected in cases.items():
        cfg = load_config(None, [f"rollout.offload={str(choice).lower()}", f"layout={layout}"])
        assert cfg.offload_rollout(cuda=cuda) is expected, (choice, layout, cuda)


def test_offload_lowers_a_colocated_gpus_peak():
    """With offload a colocated GPU peaks at max(trainer peak + what a released engine keeps, the trainer's
    states + the engine's peak), not at the sum of both peaks."""
    hf, _ = model_config("/models/Qwen2.5-Math-7B")
    base = ["rollout.max_total_tokens=65536", "rollout.mem_fraction=0.5"]
    kept = size_run(load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", base + ["rollout.offload=false"]),
                    hf, "h100-80g")
    freed = size_run(load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", base + ["rollout.offload=true"]),
                     hf, "h100-80g")
    assert (kept.hardware["offload"], freed.hardware["offload"]) == (False, True)
    t, e = freed.trainer, freed.engines
    export = t["static"] + freed.push["bucket_bytes"] + 2 * freed.push["largest_tensor"]
    shared = [row["peak_gib"] * 2**30 for row in kept.verdict + freed.verdict if row["gpu"] == "trainer+engine"]
    assert shared[0] == pytest.approx(t["peak_with_push"] + e["peak"])
    assert shared[1] == pytest.approx(max(t["peak_with_push"] + e["released"], export + e["peak"]))
    assert shared[1] < shared[0]


def test_colocated_engines_are_given_a_mem_fraction_that_fits():
    """SGLang's default mem_fraction_static on a GPU shared with a trainer rank is refused with the fraction that
    fits; that fraction then plans clean and holds the KV cache it promised."""
    hf, _ = model_config("/models/Qwen2.5-Math-7B")
    cfg = load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", ["rollout.mem_fraction=0"])
    problems = size_run(cfg, hf, "h100-80g").problems
    assert len(problems) == 1 and problems[0].startswith("rollout.mem_fraction: 0 lets each engine"), problems
    fraction = float(re.search(r"set rollout.mem_fraction=([0-9.]+)", problems[0]).group(1))
    fixed = size_run(load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", [f"rollout.mem_fraction={fraction}"]),
                     hf, "h100-80g")
    assert fixed.problems == [] and fixed.engines["mem_fraction"] <= fraction
    small = load_config(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml", ["rollout.mem_fraction=0.1"])
    assert any(p.startswith("rollout.mem_fraction: 0.1 of a h100-80g holds less")
               for p in size_run(small, hf, "h100-80g").problems)


def test_no_mem_fraction_above_1_is_suggested():
    """A KV cache no fraction of the GPU holds gets a token count that fits the configured fraction, not a
    fraction above 1; that count then plans without a mem_fraction problem."""
    from qurl_mcore.sizing import format_plan

    cfg = load_config(CONFIGS / "grpo_32b_int8.yaml", ["rollout.max_total_tokens=2000000", "rollout.mem_fraction=0.9"])
    hf = model_config(cfg.model.path)[0]
    plan = size_run(cfg, hf, "h100-80g")
    assert plan.engines["mem_fraction"] is None
    text = format_plan(plan)
    assert all(float(x) <= 1 for x in re.findall(r"mem_fraction[ =]([0-9.]+)", text)), text
    tokens = int(re.search(r"no fraction of the GPU holds them: use at most rollout.max_total_tokens=(\d+)",
                           text).group(1))
    fixed = size_run(load_config(CONFIGS / "grpo_32b_int8.yaml", [f"rollout.max_total_tokens={tokens}",
                                                                  "rollout.mem_fraction=0.9"]), hf, "h100-80g")
    assert not any(p.startswith("rollout.mem_fraction") for p in fixed.problems)
    assert fixed.engines["mem_fraction"] <= 0.9


def test_each_decode_step_waits_for_its_tp_all_reduces():
    """At TP > 1 a decode step waits for 2 all-reduces per layer (10 us each over NVLink) on top of its GEMMs:
    Qwen3-30B-A3B's 48 layers at TP 4 add 96 · 10 us to a quarter of the single GPU's weight-bound step, and
    cap batch 1 below 1/(96 · 10 us) ≈ 1042 tokens/s; at TP 1 there is no floor and the bandwidth bound stands."""
    from qurl_mcore.sizing import format_plan

    hf, source = model_config("/models/Qwen3-30B-A3B")
    cfg = load_config(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml")
    plan = size_run(cfg, hf, "b200-180g", source=source)
    tp4, floor = plan.rollout, 2 * 48 * 10e-6
    assert cfg.rollout.tp_size == 4 and tp4["latency_floor_s"] == pytest.approx(floor)
    tp1 = size_run(load_config(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml", ["rollout.tp_size=1"]), hf,
                   "b200-180g").rollout
    assert tp1["latency_floor_s"] == 0
    for label in ("bf16", "quantized"):
        step = 1 / tp1[label]["tokens_per_s_batch1"]
        assert 1 / tp4[label]["tokens_per_s_batch1"] == pytest.approx(step / 4 + floor)
        assert tp4[label]["tokens_per_s_batch1"] < 1 / floor
    assert "latency bound 1042 at batch 1 (96 TP all-reduces of 10 us a step)" in format_plan(plan)


# ---- the shipped GPU configs fit their stated hardware ------------------------------------------------------

_HARDWARE = re.compile(r"(\d+) nodes? x (\d+) (H100|H200|B200)")
_GPU = {"H100": "h100-80g", "H200": "h200-141g", "B200": "b200-180g"}


@pytest.mark.parametrize("path", sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "cpu_demo.yaml"))
def test_shipped_gpu_configs_fit(path):
    text = (CONFIGS / path).read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    nodes, per_node, gpu = _HARDWARE.search(header).groups()
    cfg = load_config(CONFIGS / path)
    hf, source = model_config(cfg.model.path)
    result = size_run(cfg, hf, _GPU[gpu], gpus_per_node=int(per_node), nodes=int(nodes), source=source)
    assert result.problems == []
    assert result.hardware["nodes_needed"] == int(nodes)
    assert all(v["fits"] for v in result.verdict)


def test_fp4_decodes_on_its_kernels_from_packed_weights_on_every_gpu():
    """FP4 rolls out on the FP4 Triton kernels (bf16 MMAs on exactly representable values, so at bf16's peak
    on every GPU): its step reads packed weights, 4.5 bits a weight for NVFP4, and the routed experts only, so
    batch 1 gains from the bytes on Hopper too, TP all-reduces included; RC's second product costs FLOPs
    only. The plan says it is a model until a GPU measures the kernels. A format with neither tensor cores nor
    the kernels (FP8 E5M2 on Hopper) stays emulated: no gain from its weights."""
    from qurl_mcore.sizing import format_plan
    from qurl_mcore.sizing.gpus import get_gpu
    from qurl_mcore.sizing.speed import EMULATED, FP4_KERNELS, TENSOR_CORES, gemm_path

    hf, source = model_config("/models/Qwen3-30B-A3B")
    cfg = load_config(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml")
    for gpu in ("h100-80g", "h200-141g", "b200-180g"):
        plan = size_run(cfg, hf, gpu, source=source)
        assert plan.rollout["gemm"] == FP4_KERNELS and "not yet measured on a GPU" in plan.rollout["basis"]
        assert plan.rollout["ratio_batch1"] > 1.05
        assert "nvfp4 on the FP4 Triton kernels" in format_plan(plan) and "emulated" not in format_plan(plan)
    one_gpu = load_config(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml", ["rollout.tp_size=1"])  # no latency floor
    ratio = size_run(one_gpu, hf, "h200-141g").rollout["ratio_batch1"]
    assert 1.5 < ratio < 4 and size_run(one_gpu, hf, "b200-180g").rollout["ratio_batch1"] == pytest.approx(ratio)
    h100 = get_gpu("h100-80g")
    assert gemm_path(h100, "nvfp4") == (FP4_KERNELS, 989.0)
    assert gemm_path(h100, "int8") == (TENSOR_CORES, 1979.0)
    assert gemm_path(h100, "fp8_e5m2") == (EMULATED, 989.0)
    int8 = load_config(CONFIGS / "grpo_32b_int8.yaml")
    assert "emulated" not in format_plan(size_run(int8, model_config(int8.model.path)[0], "h100-80g"))


# ---- the command line -----------------------------------------------------------------------------------

def test_cli_json(capsys):
    from qurl_mcore.cli import main

    assert main(["plan", "--config", str(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml"), "--gpu", "h200-141g",
                 "--json", "rollout.push=bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "hardware", "trainer", "engines", "push", "rollout", "verdict", "problems"}
    assert out["model"]["parameters"] == 30_532_122_624
    assert out["push"]["bytes"] == 2 * 30_532_122_624


def test_shipped_configs_plan_no_host_masters(capsys):
    """The shipped configs (every one quantized, rollout.push auto) push codes, by tensor (colocated) and by
    broadcast (disaggregated, TP > 1 engines, DeepSeek-V3's MLA under scope all): their plans hold no masters."""
    from qurl_mcore.cli import main

    for path in sorted(CONFIGS.glob("*.yaml")):
        assert main(["plan", "--config", str(path), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["engines"]["precision"] != "bf16", path.stem
        assert out["engines"]["master"] == "none", path.stem
        assert out["engines"]["host_masters_per_node"] == 0, path.stem
        assert out["push"]["codes"] == out["engines"]["format"], path.stem


def test_the_gpu_defaults_to_the_one_the_config_names(capsys, tmp_path):
    """A config naming its GPU is planned on it (the shipped DeepSeek-V3 config: H200s); --gpu overrides it;
    a config naming none is planned on H100s; `--check` refuses a name the planner does not know."""
    from qurl_mcore.cli import main

    config = str(CONFIGS / "grpo_deepseek_v3_int8.yaml")
    gpus = []
    for extra in ([], ["--gpu", "b200-180g"]):
        assert main(["plan", "--config", config, "--json", *extra]) == 0
        gpus.append(json.loads(capsys.readouterr().out)["hardware"]["gpu"])
    assert gpus == ["h200-141g", "b200-180g"]
    main(["plan", "--config", str(CONFIGS / "grpo_32b_int8.yaml"), "--json", "gpu="])
    assert json.loads(capsys.readouterr().out)["hardware"]["gpu"] == "h100-80g"
    from qurl_mcore.preflight import preflight

    cfg = load_config(None, ["model.path=tiny-llama", "gpu=h300", f"logging.dir={tmp_path}/l",
                             f"checkpoint.dir={tmp_path}/c"])
    assert "gpu: unknown GPU 'h300'; use one of ['h100-80g'" in preflight(cfg, use_gpu=False).report()


def test_push_is_wire_time_beside_a_measured_push():
    """The push line says its time is the wire's and shows miles' measured Qwen3-30B-A3B sync (2.67 s over NCCL
    on H100): as this model's figure for Qwen3-30B-A3B (card or config.json alike), as a note for the others."""
    from qurl_mcore.sizing import format_plan

    def push_line(config, gpu):
        cfg = load_config(CONFIGS / config)
        hf, source = model_config(cfg.model.path)
        return next(x for x in format_plan(size_run(cfg, hf, gpu, source=source)).splitlines()
                    if x.startswith("push"))

    moe = push_line("grpo_qwen3_30b_a3b_fp4_rc.yaml", "h200-141g")
    assert "wire time (bytes / link bandwidth) 0.39 s on infiniband" in moe  # 19.39 GB of NVFP4 codes at 50 GB/s
    assert moe.endswith("; measured for this model: 2.67 s over NCCL on H100 (miles)")
    dense = push_line("grpo_32b_int8.yaml", "h100-80g")
    assert "wire time (bytes / link bandwidth)" in dense
    assert dense.endswith("; measured pushes take longer than wire time: miles reports 2.67 s for Qwen3-30B-A3B "
                          "over NCCL on H100")


@pytest.mark.parametrize("args,message", [
    (["--gpu", "a100"], "unknown GPU 'a100'; use one of"),
    (["--link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
    (["train.nope=1"], "train.nope: unknown field"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, args, message):
    from qurl_mcore.cli import main

    assert main(["plan", "--config", str(CONFIGS / "grpo_qwen3_30b_a3b_fp4_rc.yaml"), *args]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and message in out


def test_cli_exits_3_when_a_gpu_does_not_fit_unless_warn_only(capsys):
    from qurl_mcore.cli import main

    args = ["plan", "--config", str(CONFIGS / "dapo_qwen2.5_7b_math_int8.yaml"), "--gpu", "h100-80g",
            "train.recompute=none", "train.micro_batch_size=4"]
    assert main(args) == 3
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*args, "--warn-only", "--json"]) == 0
    assert not all(v["fits"] for v in json.loads(capsys.readouterr().out)["verdict"])


def test_preflight_plans_memory_only_where_it_knows_the_gpu(tmp_path):
    """`qurl train --check` on a GPU machine runs the planner for that GPU; without one it says so."""
    from qurl_mcore.config import load_config
    from qurl_mcore.preflight import preflight
    from qurl_mcore.sizing import local_gpu

    cfg = load_config(None, ["model.path=tiny-llama", f"checkpoint.dir={tmp_path}/c", f"logging.dir={tmp_path}/l",
                             "rollout.max_total_tokens=65536", "rollout.mem_fraction=0.3"])
    text = preflight(cfg, use_gpu=True).report()
    assert ("not planned: no GPU of the planner's table here" in text) == (local_gpu() is None)
    assert "fits on h100-80g" in preflight(cfg, gpu="h100-80g").report()


def test_check_refuses_a_run_that_does_not_fit_its_gpu(capsys):
    """`qurl train --check --gpu` plans on a login node: Qwen2.5-32B trained by one GPU is refused with a lever."""
    from qurl_mcore.cli import main

    code = main(["train", "--check", "--gpu", "h100-80g", "model.path=/models/Qwen2.5-32B-Instruct",
                 "uaq.enabled=false", "precision=bf16"])
    err = capsys.readouterr().err
    assert code == 2 and "memory (h100-80g):" in err, err


def test_an_moe_engine_loads_its_experts_as_codes_and_the_verdict_counts_the_load():
    """The plugin quantizes routed experts as they load (sglang/moe.py): DeepSeek-V3's int8 engine (TP 8 on H200)
    holds at its load the other weights in bf16, the experts' int8 codes and one expert's gate and up waiting,
    all /TP but the replicated norms and routers; by hand from the tensors. A BF16 push keeps masters: on the
    host by default, outside the load; with master=device the experts' bf16 masters load on the GPU too. The
    verdict takes the larger of an engine's load and serving peaks: a 32B int8 engine with a small KV cache
    peaks at its load, all of it in bf16."""
    from qurl_mcore.sizing.gpus import GiB, get_gpu
    from qurl_mcore.sizing.memory import engine_bytes

    cfg = load_config(CONFIGS / "grpo_deepseek_v3_int8.yaml")
    hf, _ = model_config(cfg.model.path)
    s, tp, int8 = shape(hf), cfg.rollout.tp_size, FORMATS["int8"]
    experts = [x for x in hf_tensors(s) if x.kind == "experts"]
    replicated = sum(x.bytes(2) for x in hf_tensors(s) if x.kind in ("norm", "router"))
    others = sum(x.bytes(2) for x in hf_tensors(s) if x.kind != "experts") - replicated
    codes = sum(int8.weight_bytes(*x.shape) for x in experts)
    one_w13 = 2 * 2 * experts[0].numel  # an expert's gate and up in bf16
    e = engine_bytes(s, cfg, get_gpu("h200-141g"))
    assert e["load"] == (others + codes + one_w13) // tp + replicated
    assert 80e9 < e["load"] < 90e9 < e["peak"]
    bf16_push = load_config(CONFIGS / "grpo_deepseek_v3_int8.yaml", ["rollout.push=bf16"])  # masters kept
    assert engine_bytes(s, bf16_push, get_gpu("h200-141g"))["load"] == e["load"]  # on the host: not at the load
    device = engine_bytes(s, bf16_push, get_gpu("h200-141g"), master="device")
    assert device["load"] == e["load"] + sum(x.bytes(2) for x in experts) // tp > get_gpu("h200-141g").hbm
    cfg = load_config(CONFIGS / "grpo_32b_int8.yaml", ["rollout.max_total_tokens=1024"])
    hf, _ = model_config(cfg.model.path)
    plan = size_run(cfg, hf, "h100-80g")
    engine = next(v for v in plan.verdict if v["gpu"] == "engine")
    assert plan.engines["peak"] < plan.engines["load"] == pytest.approx(engine["peak_gib"] * GiB)
