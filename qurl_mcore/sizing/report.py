"""The plan as the lines `qurl plan` prints (`--json` prints `Plan.to_dict()`)."""
from __future__ import annotations

from .gpus import GB, NVLINK_ALLREDUCE_S, GiB
from .speed import EMULATED, FP4_KERNELS
from .verdict import Plan


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def format_plan(p: Plan) -> str:
    """The plan as the lines `qurl plan` prints."""
    t, e, pu, ro, hw = p.trainer, p.engines, p.push, p.rollout, p.hardware
    m = pu["measured"]
    which = "distributed" if t["distributed_optimizer"] else "replicated"
    w = e["weights"]
    lines = [
        (f"model     {p.model['source']}: {p.model['model_type']}, {p.model['parameters'] / 1e9:.2f}B parameters, "
         f"{p.model['layers']} layers" + (f", {p.model['experts']} experts" if p.model["experts"] else "")),
        f"hardware  {hw['gpu']} ({hw['hbm_gib']:.1f} GiB, {hw['hbm_tb_s']} TB/s), {hw['layout']}, "
        f"{hw['nodes_needed']} node(s) of {hw['gpus_per_node']} GPUs",
        f"trainer   per GPU (TP {t['split']['tp']} PP {t['split']['pp']} EP {t['split']['ep']} DP "
        f"{t['split']['dp']}, {t['dtype']}, {t['parameters'] / 1e9:.2f}B parameters on the fullest stage):",
        (f"            params {_gib(t['params'])}, gradients {_gib(t['gradients'])}"
         + (f", reference model {_gib(t['reference'])}" if t["reference"] else "")),
        f"            main params + Adam {_gib(t['main_params']['replicated'] + t['optimizer']['replicated'])} "
        f"replicated, {_gib(t['main_params']['distributed'] + t['optimizer']['distributed'])} with the "
        f"distributed optimizer (using {which})",
        ("            activations: " + ", ".join(f"{r} {_gib(v)}" for r, v in t["activations"].items())
         + f" (using {t['recompute']}; {t['microbatches_per_step']} micro-batch(es) per step)"),
        (f"            peak {_gib(t['peak'])} (with a push's export {_gib(t['peak_with_push'])})"
         + (f"; the update-capture metric's weight copies: {_gib(t['update_capture']['during'])} during a step, "
            f"{_gib(t['update_capture']['end'])} at its end" if t["update_capture"]["end"] else "")),
        (f"engines   {e['count']} x TP {e['tp']}, {e['precision']} ({e['format'] or 'bf16'}, scope {e['scope']}); "
         f"per GPU: weights {_gib(w['gpu_weights'])}, masters {_gib(w['gpu_masters'])} on the {e['master']}, KV "
         f"cache {_gib(e['kv'])} ({e['kv_tokens']} tokens), SGLang reserve {_gib(e['reserve'])}; peak "
         f"{_gib(e['peak'])}, "
         + (f"rollout.mem_fraction {e['mem_fraction']}" if e["mem_fraction"] is not None else
            "no rollout.mem_fraction holds it")
         + (f"; released while the trainer steps: {_gib(e['released'])} stay" if p.hardware["offload"] else "")
         + (f"; host RAM for masters {_gib(e['host_masters_per_node'])} per node" if e["host_masters"] else "")),
        (f"push      {pu['bytes'] / GB:.2f} GB in {pu['dtype']}, {pu['buckets']} bucket(s) of <= "
         f"{pu['bucket_bytes'] >> 20} MiB; wire time (bytes / link bandwidth) {pu['seconds']:.2f} s on "
         f"{pu['link']} (" + ", ".join(f"{k} {v:.2f} s" for k, v in pu["seconds_by_link"].items()) + "); "
         + (f"measured for this model: {m['seconds']} s over {m['over']} ({m['source']})" if m["this_model"] else
            f"measured pushes take longer than wire time: {m['source']} reports {m['seconds']} s for "
            f"{m['model']} over {m['over']}")),
        f"rollout   decode ceiling per engine, tokens/s bf16 -> {e['precision']}: batch 1 "
        f"{ro['bf16']['tokens_per_s_batch1']:.0f} -> {ro['quantized']['tokens_per_s_batch1']:.0f} "
        f"(x{ro['ratio_batch1']:.2f}); batch {ro['bf16']['batch']} -> {ro['quantized']['batch']} of "
        f"{ro['context']} tokens: {ro['bf16']['tokens_per_s']:.0f} -> {ro['quantized']['tokens_per_s']:.0f} "
        f"(x{ro['ratio']:.2f})"
        + (f"; latency bound {1 / ro['latency_floor_s']:.0f} at batch 1 ({2 * p.model['layers']} TP all-reduces "
           f"of {NVLINK_ALLREDUCE_S * 1e6:.0f} us a step)" if ro["latency_floor_s"] else "")
        + {EMULATED: f"; {e['format']} is emulated on a {hw['gpu']} (no {e['format']} tensor cores): dequantized "
                     "to bf16, no speed-up from its weights",
           FP4_KERNELS: f"; {e['format']} on the FP4 Triton kernels (packed weights, routed experts, bf16 MMAs): "
                        "a model until a GPU measures them (benchmarks/device_check.sh, rollout-fp4)",
           }.get(ro["gemm"], ""),
    ]
    for v in p.verdict:
        state = f"fits, {v['margin_gib']:.1f} GiB free" if v["fits"] else "does NOT fit"
        lines.append(f"verdict   {v['gpu']} GPU: {v['peak_gib']:.1f} of {v['hbm_gib']:.1f} GiB, {state}")
    lines += [f"problem   {x}" for x in p.problems]
    return "\n".join(lines)
