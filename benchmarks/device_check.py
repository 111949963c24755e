"""The GPU check's sections (benchmarks/device_check.sh runs this on the lent GPU machine), one summary line
each, skipped once the time budget no longer fits them:

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

Models are random checkpoints written here (no tokenizer, no network).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import quant_throughput
import rollout_kernels
import torch

ROOT = Path(__file__).resolve().parents[1]
#: the `gpu`-marked tests that need no SGLang (the GPU machine has none)
GPU_TESTS = ("tests/loop/test_trainer_gpu.py", "tests/quant/test_gemm.py", "tests/megatron/test_spec.py",
             "tests/sglang/test_plugin_units.py")


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
    """One trainer step (PPO loss, lr 1e-5) on this process's device: metrics, seconds, peak memory and the
    planner's peak for the same config."""
    from qurl_mcore.config import load_config
    from qurl_mcore.loop.trainer import PolicyTrainer
    from qurl_mcore.models.registry import shape
    from qurl_mcore.sizing import model_config, trainer_bytes

    cfg = load_config(None, [f"model.path={model_path}", "precision=bf16", "uaq.enabled=false", "train.loss=ppo",
                             "train.lr=1e-5", f"train.micro_batch_size={min(rows, 4)}",
                             f"rollout.context_length={length}", f"rollout.max_new_tokens={length // 2}", *overrides])
    planned = trainer_bytes(shape(model_config(model_path)[0]), cfg, cuda=torch.cuda.is_available())["peak"]
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
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
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


def section(name: str, deadline: float, need_s: float, body) -> None:
    left = deadline - time.monotonic()
    if left < need_s:
        print(f"SECTION {name}: skipped ({left:.0f} s left, needs ~{need_s:.0f} s)", flush=True)
        return
    start = time.monotonic()
    try:
        print(f"SECTION {name}: {body()} [{time.monotonic() - start:.0f} s]", flush=True)
    except Exception as err:  # noqa: BLE001 - one line per section, whatever happened
        print(f"SECTION {name}: FAIL {type(err).__name__}: {str(err)[-600:]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=420.0)
    args = parser.parse_args()
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
                              *GPU_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=400)
        return out.stdout.strip().splitlines()[-1] + ("" if out.returncode == 0 else "\n" + out.stdout[-3000:])

    def graphs():
        results = rollout_kernels.graph_replays()
        bad = [m for m, ok in results.items() if not ok]
        return f"{len(results) - len(bad)} of {len(results)} captures replay equal to eager" + (
            f"; DIFFER: {bad}" if bad else "")

    def decode():
        speedups = rollout_kernels.decode_speedups("cuda")
        return "bf16 time / quantized: " + ", ".join(
            f"{fmt} M{m} {k}x{n} x{r:.2f}" for (fmt, m, k, n), r in speedups.items())

    def requant():
        linears = rollout_kernels.qwen25_7b_linears()
        base, ratios = rollout_kernels.requant_ratios("cuda", linears)
        return (f"{len(linears)} linears of Qwen2.5-7B, copy {base * 1e3:.1f} ms; re-quantize / copy: "
                + ", ".join(f"{fmt} x{r:.1f}" for fmt, r in ratios.items()))

    def throughput():
        base, rows = quant_throughput.quantize_ratios(8192, 10, "cuda")
        return f"8192^2 fp32 copy {base * 1e3:.2f} ms; eager/compiled x copy: " + ", ".join(
            f"{fmt}/{gran} {e:.1f}/{c:.1f}" for fmt, gran, e, c in rows)

    section("trainer-tiny", deadline, 60, tiny)
    section("rollout-graphs", deadline, 30, graphs)
    section("rollout-decode", deadline, 30, decode)
    section("rollout-requant", deadline, 90, requant)  # compiling 3 formats included
    section("trainer-1b", deadline, 120, one_b)
    section("trainer-moe", deadline, 40, moe)
    section("gpu-tests", deadline, 90, gpu_tests)
    section("quant-throughput", deadline, 120, throughput)


if __name__ == "__main__":
    main()
