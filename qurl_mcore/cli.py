"""The `qurl` command line.

A command imports the modules that load torch, Ray or Megatron-Core (each takes seconds to import) inside its
own function, so that `qurl --help` and the commands' parsers load none of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import warnings
from importlib import metadata
from pathlib import Path

import qurl_mcore

from .align import PROMPTS, REPLAY, ROWS, format_table, run_alignment, stdout_to_stderr
from .compare import __doc__ as compare_doc, compare, parse_variant
from .config import ConfigError, load_config
from .loop import outcome
from .loop.outcome import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_STOPPED, RunFailure
from .models import resolve_model_path
from .patching import TARGETS, PatchError, PatchSet
from .precision import FP4_FORMATS, PRECISIONS, SCOPES
from .slurm import SlurmJob, render, submit


def _positive(text: str) -> int:
    """An argparse type: a positive integer, or a one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _quant_report(args: argparse.Namespace) -> int:
    # lazy: loads torch, not at `qurl --help`
    from .quant_report import run

    try:
        print(run(args.tensor, args.rows, args.json))
    except (KeyError, ValueError, OSError) as err:
        print(f"qurl quant-report: {err.args[0] if isinstance(err, KeyError) else err}")
        return 2
    return 0


def _prepare_models(args: argparse.Namespace) -> int:
    # lazy: loads torch, not at `qurl --help`
    from .models.smollm2 import hf_checkpoint
    from .models.tiny import ARCHS, tiny_checkpoint

    print(f"smollm2: {hf_checkpoint()}")
    for arch in ARCHS:
        print(f"tiny {arch}: {tiny_checkpoint(arch)}")
    return 0


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"qurl train: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    where = args.config or "the default config"
    if args.check:
        from .preflight import preflight  # lazy: loads torch, not at `qurl --help`

        try:
            gpu = args.gpu or cfg.gpu or None
            checked = preflight(cfg, local=not (args.address or os.environ.get("RAY_ADDRESS")) and not gpu, gpu=gpu)
        except ValueError as err:  # an unknown --gpu
            print(f"qurl train --check: {err}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        if not checked.ok:
            print(f"qurl train --check: {where}: {checked.report()}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        print(f"qurl train --check: {where} is ready to run\n{checked.report()}")
        return EXIT_FINISHED
    again = shlex.join(["qurl", "train", *sys.argv[2:]]) if sys.argv[1:2] == ["train"] else "the same command"
    try:
        from .loop.driver import run  # lazy: loads torch and Ray, not at `qurl --help`

        result = run(cfg, address=args.address)
    except ConfigError as err:
        print(f"qurl train: {where}: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except RunFailure as err:
        print(f"qurl train: {err}\nqurl train: the run stopped; resume from the last checkpoint in "
              f"{cfg.checkpoint.dir} with: {again}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # before the run's own signal handling is up, or a second Ctrl-C
        print(f"qurl train: interrupted; {again} starts it again (from the last checkpoint in "
              f"{cfg.checkpoint.dir}, if any)", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"qurl train: {result.steps_done}/{cfg.steps} steps; metrics {result.log_dir / 'metrics.jsonl'}"
          + (f"; report {result.report}" if result.report else ""))
    if result.stopped and result.steps_done < cfg.steps:
        # a step still running when checkpoint.stop_grace_s ran out was abandoned: the last checkpoint is older
        print(f"qurl train: stopped; resume from the last checkpoint in {cfg.checkpoint.dir} with: {again}",
              file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_FINISHED


def _patch(args: argparse.Namespace) -> int:
    if args.target is None and args.action != "status":
        print(f"qurl patch {args.action}: give --target, one of {sorted(TARGETS)}")
        return 2
    codes = [_patch_target(args, target) for target in ([args.target] if args.target else sorted(TARGETS))]
    return max(codes) if args.target else 0  # status of every target: those not installed are only reported


def _patch_target(args: argparse.Namespace, target: str) -> int:
    try:
        ps = PatchSet.installed(target, Path(args.patches) if args.patches else None)
        where = f"{ps.target.dist} {ps.version} at {ps.root}"
        if args.action == "apply":
            done = ps.apply()
            print(f"{where}: applied {done or 'nothing new'}; {len(ps.patches)} patch(es) pinned")
        elif args.action == "revert":
            print(f"{where}: reverted {ps.revert() or 'nothing'}")
        else:
            states = ps.status()
            for name, state in states.items():
                print(f"{state:9s} {name}")
            print(f"{where}: {len(states)} patch(es) pinned, manifest {ps.manifest_path}")
            if args.action == "check" and any(s != "applied" for s in states.values()):
                return 1
    except PatchError as err:
        print(f"qurl patch {args.action}: {err}")
        return 2
    return 0


def _launch_slurm(args: argparse.Namespace) -> int:
    bad = [item for item in args.env if "=" not in item]
    if bad:
        print(f"qurl launch slurm: --env takes KEY=VALUE, got {bad}", file=sys.stderr)
        return 2
    env = dict(item.split("=", 1) for item in args.env)
    job = SlurmJob(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, config=args.config, overrides=args.overrides,
        workdir=args.workdir, layout=args.layout, rollout_nodes=args.rollout_nodes, job_name=args.job_name, gpu=args.gpu,
        partition=args.partition, account=args.account, time=args.time, cpus_per_node=args.cpus_per_node,
        container_image=args.container_image, container_mounts=args.container_mounts, venv=args.venv,
        log_dir=args.log_dir, ckpt_dir=args.ckpt_dir, env=env, command=args.train_command,
        object_store_bytes=args.object_store_gb * 2**30,
    )
    try:
        if args.dry_run:
            print(render(job), end="")
            return 0
        path, job_id = submit(job)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"qurl launch slurm: {err}", file=sys.stderr)
        return 2
    print(f"submitted job {job_id}: {path}")
    return 0


def _add_launch(sub) -> None:
    launch = sub.add_parser("launch", help="launch on a cluster").add_subparsers(dest="where", required=True)
    p = launch.add_parser("slurm", help="render the Slurm job (Ray head + workers + qurl train) and sbatch it")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--config", required=True, help="the training YAML file")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", help="Slurm time limit, e.g. 04:00:00; the job requeues itself before it")
    p.add_argument("--container-image", help="run every step in this image (pyxis/enroot)")
    p.add_argument("--container-mounts", help="pyxis mounts (default: at their own paths, the work directory, the "
                                              "checkout, and the directories of the config, its data, model and "
                                              "checkpoints)")
    p.add_argument("--gpu", help="the nodes' GPU, h100-80g, h200-141g or b200-180g: plan the memory as qurl plan "
                                 "does (default: the config's gpu; none named: not planned)")
    p.add_argument("--layout", choices=["colocated", "disaggregated"], help="default: the config's")
    p.add_argument("--rollout-nodes", type=int,
                   help="disaggregated: nodes that only roll out (default: as many as the config's engines fill)")
    p.add_argument("--cpus-per-node", type=int, default=16)
    p.add_argument("--object-store-gb", type=int, default=10, help="Ray object store per node (default 10)")
    p.add_argument("--job-name", help="default: the config file's name")
    p.add_argument("--workdir", default=".", help="where qurl train runs, which every node sees; the config's "
                                                  "relative paths are from there (default: here)")
    p.add_argument("--venv", help="the Python environment to activate on the nodes (default: the one this command "
                                  "runs in; with --container-image none, the image's); '' for none")
    p.add_argument("--log-dir", help="default: the config's logging.dir (relative: under WORKDIR)")
    p.add_argument("--ckpt-dir", help="default: the config's checkpoint.dir (relative: under WORKDIR)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment, e.g. NCCL_IB_HCA=mlx5 (never put secrets here)")
    p.add_argument("--train-command", help="replace `qurl train --config ...` with this shell command")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to qurl train")
    p.set_defaults(func=_launch_slurm)


def _align(args: argparse.Namespace) -> int:
    precisions = [r for item in args.precisions for r in item.split(",") if r] if args.precisions else None
    try:
        with stdout_to_stderr():  # engine logs to stderr, the result alone to stdout
            rows = run_alignment(precisions, args.model, scope=args.scope, fmt=args.fmt, prompts=args.prompts,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed)
    except (ValueError, OSError) as err:
        print(f"qurl align: {err}")
        return 2
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


def _export(args: argparse.Namespace) -> int:
    src, out = Path(args.checkpoint), args.out or args.out_option
    hf_dir = (src / "config.json").is_file() and not (src / "meta.json").is_file()
    try:  # the arguments first, before Megatron's import and its warnings
        if args.out and args.out_option and args.out != args.out_option:
            raise ValueError(f"two outputs, {args.out} and --out {args.out_option}: give one")
        if not out:
            raise ValueError("give the output directory: qurl export CHECKPOINT --out OUT (or CHECKPOINT OUT)")
        if args.uaq_scale is not None and not hf_dir:
            raise ValueError(f"{src}: --uaq-scale is for an HF checkpoint directory (slime's --save-hf); a qurl "
                             "checkpoint records its own UAQ factor: leave --uaq-scale out")
        if hf_dir and args.uaq_scale is None:
            raise ValueError(f"{src} is an HF checkpoint (config.json, no meta.json): pass --uaq-scale S, the UAQ "
                             "factor its run trained with (slime: qurl_uaq_scale), to write it unscaled")
        if not src.exists():
            raise ValueError(f"{src}: no such checkpoint or directory")
        # lazy: loads torch and Megatron-Core, not at `qurl --help`
        from .export import export_checkpoint
        from .megatron.export import claim_output, unscale_hf_checkpoint
        from .preflight import unwritable

        problem = unwritable(Path(out))  # before the ranks start: their failure would come back as a traceback
        if problem:
            raise ValueError(f"{problem}; give a directory the export can write")
        claim_output(out, src, force=args.force)
        out = (unscale_hf_checkpoint(src, out, args.uaq_scale, args.uaq_scope) if hf_dir
               else export_checkpoint(src, out, dtype=args.dtype))
    except (OSError, ValueError) as err:
        print(f"qurl export: {err}")
        return 2
    print(f"qurl export: {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .sizing import format_plan, model_config, size_run  # lazy: loads torch, not at `qurl --help`

    try:
        cfg = load_config(args.config, args.overrides)
        hf, source = model_config(cfg.model.path)
        gpu = args.gpu or cfg.gpu or "h100-80g"
        result = size_run(cfg, hf, gpu, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                          master=args.master, link=args.link, source=source)
    except (ConfigError, ValueError, OSError) as err:
        print(f"qurl plan: {' '.join(str(err).split())}")
        return 2
    out = result.to_dict()
    if args.trace:
        # lazy: the trace imports Megatron (and SGLang) in a process of its own
        from .plantrace import format_trace, trace_plan

        try:
            out["trace"] = trace_plan(cfg, hf, gpu)
        except (RuntimeError, ValueError) as err:
            print(f"qurl plan --trace: {err}")
            return 2
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_plan(result) + ("\n" + format_trace(out["trace"]) if args.trace else ""))
    return 0 if result.fits or args.warn_only else 3


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="bytes per GPU, weight push and decode ceiling of a config, and whether it fits")
    p.add_argument("--config", required=True, help="the run's YAML file (launch/configs/*.yaml)")
    p.add_argument("--gpu", help="h100-80g, h200-141g or b200-180g (default: the config's gpu, else h100-80g)")
    p.add_argument("--gpus-per-node", type=_positive, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=_positive, help="nodes you have; a layout that needs more is a problem")
    p.add_argument("--master", default="host", help="where engines keep full-precision masters: host (the "
                                                     "plugin's default) or device")
    p.add_argument("--link", help="the weight push's link: nvlink, infiniband or pcie (default: by layout)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--warn-only", action="store_true", help="exit 0 when a GPU does not fit (default: exit 3)")
    p.add_argument("--trace", action="store_true", help="also run a trainer rank's step at full size on fake CUDA "
                                                        "devices and print its measured peak beside the plan's "
                                                        "(minutes of CPU; no GPU, no weights)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.recompute=full")
    p.set_defaults(func=_plan)


def _compare(args: argparse.Namespace) -> int:
    # key=value among the configs are overrides, as every command takes them; --set too
    overrides = [*(item for item in args.configs if "=" in item), *args.set]
    try:
        variants = [parse_variant(item) for item in args.configs if "=" not in item]
        if not variants:
            raise ValueError("give at least one CONFIG besides the key=value overrides")
        done = compare(variants, args.seeds, Path(args.out), base=Path(args.base) if args.base else None,
                       overrides=overrides, last=args.last, report_only=args.report_only,
                       drop_checkpoints=args.drop_checkpoints, jobs=args.jobs, mixed_commits=args.mixed_commits,
                       say=lambda line: print(f"qurl compare: {line}"))
    except (ConfigError, ValueError, OSError) as err:
        print(f"qurl compare: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"qurl compare: report {done.report}")
    if done.failed:
        print(f"qurl compare: {len(done.failed)} run(s) failed: {', '.join(done.failed)}", file=sys.stderr)
    return EXIT_STOPPED if done.stopped else EXIT_FAILED if done.failed else EXIT_FINISHED


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="several configs x seeds, --jobs at once; curves with their spread and a "
                                       "final table (docs/studies.md)",
                       description=compare_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", metavar="CONFIG[:LABEL] | key=value",
                   help="qurl train YAML files (partial ones with --base; LABEL defaults to the file name), and "
                        "overrides for every run, e.g. steps=4")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of every config (default 0 1 2)")
    p.add_argument("--out", default="runs/compare", help="runs and report go here (default runs/compare)")
    p.add_argument("--base", help="a full config under every CONFIG, which then holds only what differs")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="key=value",
                   help="overrides for every run, as key=value among the configs")
    p.add_argument("--last", type=_positive, default=4, help="the table averages each run's last K steps (default 4)")
    p.add_argument("--report-only", action="store_true", help="write the report from the runs so far, run nothing")
    p.add_argument("--jobs", type=_positive, default=1,
                   help="runs at once (default 1); with RAY_ADDRESS, the cluster must have room for them all")
    p.add_argument("--drop-checkpoints", action="store_true",
                   help="delete a run's checkpoints once it finished (a later, longer config then redoes it)")
    p.add_argument("--mixed-commits", action="store_true",
                   help="let one label's runs come from different code (refused otherwise: records name their "
                        "commit)")
    p.set_defaults(func=_compare)


def _eval(args: argparse.Namespace) -> int:
    from .loop.evaluation import evaluate_model  # lazy: loads torch, not at `qurl --help`

    flags = {"precision": args.precision, "eval.n": args.n, "eval.temperature": args.temperature,
             "eval.num_prompts": args.num_prompts}
    try:  # the flags as overrides, checked like the config's fields; a path stays a string
        cfg = load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None)])
        if args.data:
            cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, data=args.data))
        cfg.resolved_precision()  # a scope or format the precision does not take
        try:  # before the prompts and the engine
            resolve_model_path(args.model)
        except OSError as err:
            raise ValueError(f"--model {err}") from None
        # without a config no training run is known: the generated additions need not leave any out
        result = evaluate_model(cfg, args.model, held_out=args.config is not None)
    except (ConfigError, ValueError, OSError) as err:
        print(f"qurl eval: {err}", file=sys.stderr)
        return 2
    precision, scope, fmt = cfg.resolved_precision()
    result = {"model": args.model, "precision": precision.name, "scope": scope, "format": fmt,
              "data": cfg.eval.data or ("additions that are no training prompt of the config" if args.config
                                        else "additions (no --config: training prompts not left out)"),
              "n": cfg.eval.n,
              "temperature": cfg.eval.temperature, "num_prompts": len(result["samples"]) // cfg.eval.n, **result}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(" ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in result["metrics"].items())
          + f" ({result['num_prompts']} prompts x {cfg.eval.n}, {precision.name} engine)")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out accuracy of an HF checkpoint served by one engine of a precision "
                                    "(pass@1 greedy, mean@n sampled)")
    p.add_argument("--model", required=True, help="HF checkpoint directory (e.g. a run's checkpoint.dir/hf)")
    p.add_argument("--precision", choices=list(PRECISIONS),
                   help="the engine's precision, its rollout side (default: the config's)")
    p.add_argument("--data", help=".jsonl or .parquet prompts (keys data.prompt_key/answer_key; default: the "
                                  "config's eval.data, else additions, with --config none of its training prompts)")
    p.add_argument("--n", type=_positive, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, help="0: greedy, accuracy = pass@1 (default); > 0: mean@n")
    p.add_argument("--num-prompts", type=_positive, help="the data's first prompts (default 64)")
    p.add_argument("--config", help="a qurl train YAML for the rest (data.reward, data.system_prompt, "
                                    "rollout.max_new_tokens, ...)")
    p.add_argument("--out", help="write the metrics and every sample here as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="e.g. rollout.max_new_tokens=1024 data.reward=math")
    p.set_defaults(func=_eval)


def _add_align(sub) -> None:
    p = sub.add_parser("align", help="train-vs-rollout alignment per precision (MoEResQ Table 2; top-k "
                       "expert metrics for an MoE)")
    p.add_argument("--model", help="HF checkpoint directory, 'smollm2' or 'tiny-<arch>', as model.path "
                   "(default: the tiny random Qwen3-MoE); a dense model gets the log-prob metrics only")
    p.add_argument("--precisions", nargs="+", metavar="PRECISION",
                   help=f"any of {', '.join(PRECISIONS)}, each optionally with {REPLAY} (the trainer replays "
                   f"the engine's routing) (default: {', '.join(ROWS)})")
    p.add_argument("--scope", choices=list(SCOPES), default="experts", help="quantized linears (default: experts)")
    p.add_argument("--fmt", choices=FP4_FORMATS, default="nvfp4", help="FP4 format (default: nvfp4)")
    p.add_argument("--prompts", type=_positive, default=4,
                   help=f"fixed prompts to sample from, 1-{len(PROMPTS)} (default 4)")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="response length (default 32)")
    p.add_argument("--seed", type=int, default=0, help="rollout engine's sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(func=_align)


def version() -> str:
    """The installed distribution's version, else (a checkout on PYTHONPATH) the package's own, which setup.py
    reads too; with where the package is, since a checkout can shadow an installed copy."""
    try:
        number = metadata.version("qurl-mcore")
    except metadata.PackageNotFoundError:
        number = qurl_mcore.__version__
    return f"qurl-mcore {number} ({Path(__file__).parent})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qurl", description="Quantized-rollout RL for Megatron-Core and SGLang.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("quant-report", help="each format's error and the RC gain on a real weight matrix")
    rep.add_argument("--tensor", default="token_embd.weight", help="GGUF tensor name of SmolLM2-135M-Instruct")
    rep.add_argument("--rows", type=_positive, default=4096, help="first rows of the tensor to use (default 4096)")
    rep.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rep.set_defaults(func=_quant_report)
    prep = sub.add_parser("prepare-models", help="convert/generate the cached test and demo checkpoints")
    prep.set_defaults(func=_prepare_models)
    tr = sub.add_parser("train", help="run the QuRL loop: SGLang rollout, Megatron training, weights back each step",
                        epilog="exit codes:\n" + outcome.__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--config", help="the run's YAML file (launch/configs/*.yaml); defaults apply without one")
    tr.add_argument("--address", help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    tr.add_argument("--check", action="store_true",
                    help="check the config as a whole, print the resolved run and exit (0: ready, 2: problems)")
    tr.add_argument("--gpu", help="with --check: plan the run's memory on this GPU (e.g. h100-80g; default: "
                                  "this machine's)")
    tr.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.lr=1e-6 precision=fp8")
    tr.set_defaults(func=_train)
    pat = sub.add_parser("patch", help="pinned source patch sets for installed packages (docs/patches.md)")
    pat.add_argument("action", choices=["apply", "check", "revert", "status"],
                     help="check exits 1 unless every pinned patch is applied")
    pat.add_argument("--target", choices=sorted(TARGETS), help="required but for status (default: every target)")
    pat.add_argument("--patches", help="patch directory (default: the checkout's patches/)")
    pat.set_defaults(func=_patch)
    _add_launch(sub)
    _add_align(sub)
    _add_plan(sub)
    _add_eval(sub)
    _add_compare(sub)
    exp = sub.add_parser("export", help="a run's checkpoint as an HF checkpoint (transformers, SGLang load it), "
                                        "or a UAQ-scaled HF checkpoint unscaled")
    exp.add_argument("checkpoint", help="a checkpoint step directory, or a checkpoint.dir (its newest valid one)")
    exp.add_argument("out", nargs="?", help="the HF checkpoint directory to write: new, empty, or an earlier export")
    exp.add_argument("--out", dest="out_option", metavar="OUT", help="OUT as an option, as eval and compare take it")
    exp.add_argument("--force", action="store_true",
                     help="replace OUT even if it holds other files, once the export is whole (never a checkpoint)")
    exp.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                     help="of a qurl checkpoint's export (an HF directory keeps its tensors' dtypes)")
    exp.add_argument("--uaq-scale", type=float, default=None, metavar="S",
                     help="CHECKPOINT is an HF directory saved UAQ-scaled by S (slime's --save-hf with uaq_hook): "
                          "write it unscaled")
    exp.add_argument("--uaq-scope", choices=list(SCOPES), default="all",
                     help="with --uaq-scale: the scope its UAQ rescaled, the precision's: " +
                          ", ".join(f"{p.name} {p.uaq}" for p in PRECISIONS.values() if p.uaq))
    exp.set_defaults(func=_export)
    args = parser.parse_args(argv)
    return _held_warnings(args.func, args)


def _held_warnings(command, args: argparse.Namespace) -> int:
    """Run `command` with the Python warnings of the libraries it imports held back (Megatron-Core's "Apex is
    not installed", ...): shown after it when it succeeds (exit 0), dropped when it fails, where they would bury
    its one-line error. qurl_mcore's own warnings are always shown. A run that routes warnings to its log
    (`qurl train`) does so from then on. Warning options (`python -W`, `PYTHONWARNINGS=default`) turn the
    holding off: every warning as it comes, as Python shows it."""
    if sys.warnoptions:
        return command(args)
    with warnings.catch_warnings(record=True) as held:
        code = command(args)
    ours = str(Path(__file__).parent)
    for w in held:
        if code == 0 or w.filename.startswith(ours):
            print(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line), end="",
                  file=sys.stderr)
    return code
