"""The GPU check's sections (benchmarks/device_check.sh runs this on the lent GPU machine), one summary line
each, in this order. Each section has a time budget (`SECTIONS`); one whose budget no longer fits in the time
left is skipped and reported, one that ran past its budget says so. `--dry-run` (any machine, no GPU) prints
which sections the budget would run, without running them.

  trainer-padded a tiny Llama step (fp8_e2e: Transformer Engine where installed, else the emulation) on a
                 batch of varied lengths, its width padded as the recipe needs: finite gradients, no skipped
                 update; and SDPA's backward on padded rows under each backend torch offers (cuDNN included):
                 finite with the trainer's mask, and whether a fully masked row would give NaN there
  trainer-overlap steps of 2, 1 and 3 micro-batches on one trainer (Megatron's DDP with overlap_grad_reduce):
                 every step finite and none skipped
  rollout-fp4    the FP4 MoE kernels (NVFP4, MXFP4, RC on and off) against a BF16 fused MoE at Qwen3-30B-A3B's
                 and GLM-4.5's expert shapes, batches 1, 8, 64, 256, replayed from CUDA graphs: bf16 time /
                 FP4 time, and each kernel's error against the emulation (benchmarks/rollout_kernels.py)
  trainer-tiny   a tiny Llama step in bf16 with Megatron's DDP and distributed optimizer at world size 1,
                 against the same step on the CPU (fp32, in a process without CUDA): loss, peak memory
  rollout-graphs each rollout method's linear (and emulated MoE experts) captured in a CUDA graph, replayed
                 after new input, an in-place refit, new routing: equal to eager (benchmarks/rollout_kernels.py,
                 as are the next two)
  rollout-decode INT8/FP8 linear at decode batches 1, 16, 128 on 7B/32B projection shapes vs bf16
  rollout-requant re-quantizing Qwen2.5-7B's linears vs copying them on the device
  trainer-1b     a ~1.1B-parameter Llama step (bf16, distributed optimizer): time, tokens/s, peak memory
                 against `qurl plan`'s trainer peak for the same config (sizing.trainer_bytes)
  trainer-moe    a tiny Qwen3-MoE step on the GPU without Transformer Engine
  gpu-tests      the `gpu`-marked tests (trainer, GEMM kernels, spec, the engine's host masters)
  quant-throughput quantize+dequantize, eager and compiled, vs a copy (benchmarks/quant_throughput.py)
  trainer-experts grouped vs sequential experts, forward + backward of one layer at Qwen3-30B-A3B's expert shapes
                 in bf16 and fp4_rc (benchmarks/trainer_step.py --experts), and whether torch._grouped_mm
                 takes bf16 and fp32 operands on this GPU

Models are random checkpoints written here (no tokenizer, no network).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import quant_throughput
import rollout_kernels
import trainer_step
import torch

ROOT = Path(__file__).resolve().parents[1]
#: the `gpu`-marked tests that need no SGLang (the GPU machine has none)
GPU_TESTS = ("tests/loop/test_trainer_gpu.py", "tests/quant/test_gemm.py", "tests/megatron/test_spec.py",
             "tests/sglang/test_host_masters.py")


def random_llama(out: Path, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> Path:
    """An HF Llama checkpoint of random bf16 weights (written once)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (out / "config.json").is_file():
        config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def batch(rows: int, length: int, vocab: int):
    from qurl_mcore.loop.batch import Sample, collate

    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, vocab, (length // 2,), generator=g).tolist(),
                      torch.randint(3, vocab, (length // 2,), generator=g).tolist(), [-1.0] * (length // 2),
                      group=i // 2) for i in range(rows)]
    return collate(samples, torch.linspace(0.1, 1.0, rows), pad_id=0)


def step(model_path: str, rows: int, length: int, vocab: int, *overrides: str) -> dict:
    """One trainer step (PPO loss, lr 1e-5) on this process's device: metrics, seconds, peak memory (above
    what the process held before the trainer was built) and the planner's peak for the same config."""
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer
    from qurl_mcore.models.registry import shape
    from qurl_mcore.sizing import model_config, trainer_bytes

    cfg = load_config(None, [f"model.path={model_path}", "precision=bf16", "uaq.enabled=false", "train.loss=ppo",
                             "train.lr=1e-5", f"train.micro_batch_size={min(rows, 4)}",
                             f"rollout.context_length={length}", f"rollout.max_new_tokens={length // 2}", *overrides])
    planned = trainer_bytes(shape(model_config(model_path)[0]), cfg, cuda=torch.cuda.is_available())["peak"]
    gc.collect()  # what earlier sections left (CUDA graphs, weights in cycles) would count as this trainer's
    held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    trainer = PolicyTrainer(cfg, cfg.recipe())
    try:
        data = batch(rows, length, vocab)
        trainer.step(data)  # warm-up (allocations, kernels)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = trainer.step(data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - held if torch.cuda.is_available() else 0
        return {"loss": metrics["loss/total"], "grad_norm": metrics["train/grad_norm"], "seconds": seconds,
                "tokens_per_s": rows * length / seconds, "peak_gib": peak / 2**30, "plan_gib": planned / 2**30,
                "params": sum(p.numel() for p in trainer.model.parameters())}
    finally:
        trainer.close()


def on_cpu(model_path: str, rows: int, length: int, vocab: int) -> dict:
    """The same step in a process that sees no GPU (the CPU path: fp32, cpu_compat)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import device_check; "
            f"print(json.dumps(device_check.step({model_path!r}, {rows}, {length}, {vocab})))")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**env, "CUDA_VISIBLE_DEVICES": ""})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def varied_batch(vocab: int):
    """8 prompts and responses of varied lengths: padding in every row but the longest (61 tokens, a width no
    multiple of 16)."""
    from qurl_mcore.loop.batch import Sample, collate

    g = torch.Generator().manual_seed(0)
    lengths = [(5, 3), (12, 14), (19, 25), (6, 36), (13, 10), (20, 41), (7, 32), (14, 6)]
    samples = [Sample(torch.randint(3, vocab, (p,), generator=g).tolist(),
                      torch.randint(3, vocab, (r,), generator=g).tolist(), [-1.0] * r, group=i // 2)
               for i, (p, r) in enumerate(lengths)]
    return collate(samples, torch.linspace(-1.0, 1.0, len(samples)), pad_id=0)


def trainer_steps(model_path: str, batches: list, *overrides: str) -> dict:
    """Steps of one trainer (PPO loss) over `batches`: per step its grad norm and skipped fraction; the
    trainer's padded width of the first batch and whether Transformer Engine ran its GEMMs."""
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer

    cfg = load_config(None, [f"model.path={model_path}", "uaq.enabled=false", "train.loss=ppo", "train.lr=1e-5",
                             "train.micro_batch_size=4", *overrides])
    trainer = PolicyTrainer(cfg, cfg.recipe())
    try:
        width = trainer._pad_width(batches[0]).input_ids.shape[1]
        steps = [trainer.step(b) for b in batches]
        return {"norms": [m["train/grad_norm"] for m in steps], "skipped": [m["train/skipped_nonfinite"] for m in steps],
                "width": width, "te": trainer.recipe.te}
    finally:
        trainer.close()


def sdpa_padded_grads(device: str) -> dict[str, tuple[bool, bool]]:
    """Per SDPA backend this torch offers on `device`: whether the query gradient of a padded batch is finite
    with the trainer's mask (a padding query attends to itself), and with padding rows fully masked."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qurl_mcore.megatron.logprobs import attention_mask_for, segments

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, h, s, d = 2, 4, 64, 64
    lengths = torch.tensor([64, 23])
    seg = segments(torch.arange(s)[None] < lengths[:, None], None, (b, s)).to(device)
    ours = ~attention_mask_for(seg)
    padding = (seg < 0)[:, None, :, None]
    fully_masked = ours & ~padding  # the padding rows attend to nothing
    out = {}
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        finite = []
        for mask in (ours, fully_masked):
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            try:
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                (o * ~padding).sum().backward()  # padding outputs are never scored
            except RuntimeError:  # no kernel of this backend for these inputs here
                break
            finite.append(bool(torch.isfinite(q.grad).all()))
        if len(finite) == 2:
            out[backend.name] = tuple(finite)
    return out


def padded_section(device: str) -> str:
    """trainer-padded on this process's trainer device, SDPA on `device`."""
    from qurl_mcore.models.tiny import tiny_checkpoint

    data = varied_batch(1000)
    r = trainer_steps(str(tiny_checkpoint("llama", tokenizer=False)), [data], "precision=fp8_e2e")
    sdpa = sdpa_padded_grads(device)
    ok = all(math.isfinite(n) for n in r["norms"]) and r["skipped"] == [0.0] and all(a for a, _ in sdpa.values())
    return (f"{'ok' if ok else 'NON-FINITE'}: width {data.input_ids.shape[1]} -> {r['width']} "
            f"({'Transformer Engine' if r['te'] else 'emulated FP8, no TE'}), grad norm {r['norms'][0]:.4f}, "
            f"skipped {r['skipped'][0]:.0f}; SDPA dQ finite (trainer's mask / fully masked rows): "
            + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sdpa.items()))


def overlap_section(length: int = 64) -> str:
    """trainer-overlap: 8, 4 and 12 rows of `length` tokens, 4 per micro-batch."""
    from qurl_mcore.models.tiny import tiny_checkpoint

    batches = [batch(rows, length, 1000) for rows in (8, 4, 12)]
    r = trainer_steps(str(tiny_checkpoint("llama", tokenizer=False)), batches, "precision=bf16")
    ok = all(math.isfinite(n) for n in r["norms"]) and not any(r["skipped"])
    return (f"{'ok' if ok else 'NON-FINITE'}: 2, 1, 3 micro-batches, grad norms "
            + ", ".join(f"{n:.4f}" for n in r["norms"]) + f", skipped {r['skipped']}")


def cross_device() -> str:
    """Whether quantize+dequantize of one 1024x1024 tensor on the GPU equals the CPU's bitwise, per case
    (`quant_throughput.CASES`): the trainer on CPU and an engine on GPU must agree."""
    from qurl_mcore.quant import quantize

    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    out = []
    for fmt, gran in quant_throughput.CASES:
        gpu, cpu = (quantize(x.to(d), fmt, gran).dequantize().cpu() for d in ("cuda", "cpu"))
        out.append(f"{fmt}/{gran} " + ("equal" if torch.equal(gpu, cpu) else f"DIFFERS in {int((gpu != cpu).sum())}"))
    return ", ".join(out)


#: section -> its time budget in seconds (on the lent H200, measured with room), in the order they run
SECTIONS = {"trainer-padded": 40, "trainer-overlap": 35, "rollout-fp4": 120, "trainer-tiny": 45, "gpu-tests": 90,
            "rollout-graphs": 25, "rollout-decode": 40, "trainer-moe": 30, "rollout-requant": 80, "trainer-1b": 110,
            "quant-throughput": 110, "trainer-experts": 90}
#: the default budget: the sections that fit, with the script's setup, in under 5 minutes
BUDGET_S = 240.0


def section(name: str, left: float, body, dry_run: bool = False) -> float:
    """Run `body` as section `name` if its budget (`SECTIONS`) fits in the `left` seconds, printing one line:
    its result, or why it was skipped, or FAIL. Returns the seconds it took (a dry run: its budget; 0 when
    skipped)."""
    budget = SECTIONS[name]
    if left < budget:
        print(f"SECTION {name}: skipped ({left:.0f} s left, its budget {budget} s)", flush=True)
        return 0.0
    if dry_run:
        print(f"SECTION {name}: would run (budget {budget} s)", flush=True)
        return budget
    start = time.monotonic()
    try:
        result = body()
    except Exception as err:  # noqa: BLE001 - one line per section, whatever happened
        result = f"FAIL {type(err).__name__}: {str(err)[-600:]}"
    took = time.monotonic() - start
    over = f", over its {budget} s budget" if took > budget else ""
    print(f"SECTION {name}: {result} [{took:.0f} s{over}]", flush=True)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all sections")
    parser.add_argument("--dry-run", action="store_true", help="print which sections the budget runs; run none")
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all, in order)")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    if unknown := sorted(set(only) - set(SECTIONS)):
        parser.error(f"--only: unknown section(s) {unknown}; the sections are {list(SECTIONS)}")
    deadline = time.monotonic() + args.budget_s
    models = Path(os.environ.get("QURL_CACHE_DIR", "/tmp/qurl-cache"))
    from qurl_mcore.models.tiny import tiny_checkpoint

    def tiny():
        path = str(tiny_checkpoint("llama", tokenizer=False))
        gpu = step(path, 8, 64, 1000)
        cpu = on_cpu(path, 8, 64, 1000)
        rel = abs(gpu["grad_norm"] - cpu["grad_norm"]) / cpu["grad_norm"]
        return (f"bf16 GPU grad norm {gpu['grad_norm']:.5f} vs fp32 CPU {cpu['grad_norm']:.5f} (rel {rel:.1e}), "
                f"loss {gpu['loss']:.5f} vs {cpu['loss']:.5f}, step {gpu['seconds'] * 1e3:.0f} ms, "
                f"peak {gpu['peak_gib']:.3f} GiB (qurl plan {gpu['plan_gib']:.3f})")

    def one_b():
        path = str(random_llama(models / "llama-1b", 2048, 16, 16, 8, 5632, 32000))
        r = step(path, 8, 512, 32000)
        return (f"{r['params'] / 1e9:.2f}B params, step {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tokens/s, "
                f"peak {r['peak_gib']:.2f} GiB (qurl plan {r['plan_gib']:.2f})")

    def moe():
        r = step(str(tiny_checkpoint("qwen3_moe", tokenizer=False)), 8, 64, 1000)
        return (f"loss {r['loss']:.5f}, grad norm {r['grad_norm']:.4f}, peak {r['peak_gib']:.3f} GiB "
                f"(qurl plan {r['plan_gib']:.3f}; no TE)")

    def gpu_tests():
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                              *GPU_TESTS], cwd=ROOT, capture_output=True, text=True,
                             timeout=SECTIONS["gpu-tests"] + 60)
        return out.stdout.strip().splitlines()[-1] + ("" if out.returncode == 0 else "\n" + out.stdout[-3000:])

    def graphs():
        results = rollout_kernels.graph_replays()
        bad = [m for m, ok in results.items() if not ok]
        return f"{len(results) - len(bad)} of {len(results)} captures replay equal to eager" + (
            f"; DIFFER: {bad}" if bad else "")

    def decode():
        eager, graphed = (rollout_kernels.decode_speedups("cuda", graphed=g) for g in (False, True))
        return "bf16 time / quantized (eager, CUDA graphs): " + ", ".join(
            f"{fmt} M{m} {k}x{n} x{r:.2f}/x{graphed[fmt, m, k, n]:.2f}" for (fmt, m, k, n), r in eager.items())

    def fp4_moe():
        rows = rollout_kernels.fp4_moe_rows("cuda", repeats=10)
        worst = max(error for *_, error in rows)
        baselines = rollout_kernels.bf16_moe_errors("cuda")
        return (f"bf16 fused MoE time / FP4 kernels (largest error vs emulation {worst:.1e}; bf16 baselines vs "
                f"torch: " + ", ".join(f"{k} {v:.1e}" for k, v in baselines.items()) + "): "
                + ", ".join(f"{model} {method} M{batch} x{ratio:.2f}" for model, method, batch, ratio, _ in rows))

    def requant():
        linears = rollout_kernels.qwen25_7b_linears()
        base, ratios = rollout_kernels.requant_ratios("cuda", linears)
        return (f"{len(linears)} linears of Qwen2.5-7B, copy {base * 1e3:.1f} ms; re-quantize / copy: "
                + ", ".join(f"{fmt} x{r:.1f}" for fmt, r in ratios.items()))

    def throughput():
        base, rows = quant_throughput.quantize_ratios(8192, 10, "cuda")
        differ = [f"{fmt}/{gran} in {n}" for fmt, gran, _, _, n in rows if n]
        return (f"8192^2 fp32 copy {base * 1e3:.2f} ms; eager/compiled x copy: "
                + ", ".join(f"{fmt}/{gran} {e:.1f}/{c:.1f}" for fmt, gran, e, c, _ in rows)
                + f"; compiled DIFFERS from eager: {', '.join(differ)}" * bool(differ) + "; GPU vs CPU: " + cross_device())

    def experts():
        import torch

        def takes(dtype):
            a, b = torch.ones(32, 64, dtype=dtype, device="cuda"), torch.ones(2, 64, 64, dtype=dtype, device="cuda")
            try:
                torch._grouped_mm(a, b, offs=torch.tensor([16, 32], dtype=torch.int32, device="cuda"))
                return "yes"
            except RuntimeError as err:
                return f"no ({str(err)[:80]})"

        shape = "qwen3-30b-a3b"
        return (trainer_step.experts_report(shape, trainer_step.experts_seconds(shape, repeats=2, device="cuda"))
                + f"; torch._grouped_mm bf16 {takes(torch.bfloat16)}, fp32 {takes(torch.float32)}")

    bodies = {"trainer-padded": lambda: padded_section("cuda"), "trainer-overlap": overlap_section, "trainer-tiny": tiny, "gpu-tests": gpu_tests,
              "rollout-graphs": graphs, "rollout-fp4": fp4_moe, "rollout-decode": decode, "trainer-moe": moe,
              "rollout-requant": requant,  # compiling 3 formats included
              "trainer-1b": one_b, "quant-throughput": throughput, "trainer-experts": experts}
    spent = 0.0  # a dry run counts each section it would run at its budget
    for name in only or SECTIONS:
        left = args.budget_s - spent if args.dry_run else deadline - time.monotonic()
        spent += section(name, left, bodies[name], args.dry_run)


if __name__ == "__main__":
    main()
