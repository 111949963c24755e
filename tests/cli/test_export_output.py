"""`qurl export CKPT OUT` never deletes what it did not write: a directory of the user's, a checkpoint, the
checkpoint exported or a directory inside one; `--force` replaces a user's directory, never a checkpoint."""
import json

import pytest
import torch

from qurl_mcore.cli import main
from qurl_mcore.checkpoint import finalize, verify, write_file


def _checkpoint(root, step=1):
    """A published checkpoint (what `qurl export` is given); its state need not be a model's for these refusals."""
    files = [write_file(root, step, "rank0.pt", {"model": {"w": torch.zeros(2)}})]
    return finalize(root, step, files, {"world_size": 1, "config": {}})


def _uaq_scaled_hf(path):
    """A small HF checkpoint directory (`qurl export --uaq-scale` input) with one tensor UAQ rescales."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(4)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


@pytest.mark.parametrize("where", ["step", "checkpoint_dir"])
def test_export_into_the_checkpoint_itself_is_refused_and_the_checkpoint_survives(tmp_path, capsys, where):
    step = _checkpoint(tmp_path / "ckpt")
    out = step if where == "step" else tmp_path / "ckpt"
    for force in ([], ["--force"]):
        assert main(["export", str(step), str(out), *force]) == 2
        assert verify(step) is None  # meta.json and rank0.pt untouched
    assert "must not be" in capsys.readouterr().out


def test_export_into_a_directory_inside_a_checkpoint_is_refused(tmp_path, capsys):
    step = _checkpoint(tmp_path / "ckpt")
    hf = _uaq_scaled_hf(tmp_path / "hf_in")
    assert main(["export", str(hf), str(step / "hf"), "--uaq-scale", "1.5"]) == 2
    assert "inside a checkpoint directory" in capsys.readouterr().out and not (step / "hf").exists()


def test_a_directory_of_the_users_is_refused_and_kept_then_replaced_with_force(tmp_path, capsys):
    hf = _uaq_scaled_hf(tmp_path / "hf_in")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export", str(hf), str(out), "--uaq-scale", "1.5"]) == 2
    said = capsys.readouterr().out
    assert "holds files no export wrote (notes.txt)" in said and "--force" in said
    assert (out / "notes.txt").read_text() == "keep me"
    assert main(["export", str(hf), str(out), "--uaq-scale", "1.5", "--force"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    # an export's own directory is replaced by the next export without --force
    assert main(["export", str(hf), str(out), "--uaq-scale", "2.0"]) == 0


def test_force_never_replaces_a_directory_holding_checkpoints(tmp_path, capsys):
    runs = tmp_path / "runs"
    step = _checkpoint(runs / "demo" / "checkpoints")
    hf = _uaq_scaled_hf(tmp_path / "hf_in")
    assert main(["export", str(hf), str(runs), "--uaq-scale", "1.5", "--force"]) == 2
    assert "holds a checkpoint" in capsys.readouterr().out and verify(step) is None


def test_a_partial_directory_no_export_wrote_is_kept(tmp_path, capsys):
    hf = _uaq_scaled_hf(tmp_path / "hf_in")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "data.csv").write_text("1,2")
    assert main(["export", str(hf), str(tmp_path / "out"), "--uaq-scale", "1.5"]) == 2
    assert "no export wrote it" in capsys.readouterr().out
    assert (tmp_path / "out.partial" / "data.csv").read_text() == "1,2"


def test_out_as_an_option_or_positionally_and_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    hf = _uaq_scaled_hf(tmp_path / "hf")
    assert main(["export", str(hf), "--out", str(tmp_path / "a"), "--uaq-scale", "1.5"]) == 0
    assert main(["export", str(hf), str(tmp_path / "b"), "--uaq-scale", "1.5"]) == 0
    assert (tmp_path / "a" / "model.safetensors").is_file() and (tmp_path / "b" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["export", str(hf), str(tmp_path / "c"), "--out", str(tmp_path / "d"), "--uaq-scale", "1.5"]) == 2
    assert f"two outputs, {tmp_path / 'c'} and --out {tmp_path / 'd'}: give one" in capsys.readouterr().out
    assert main(["export", str(hf)]) == 2
    assert "give the output directory" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "bad"), "--out", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().out == f"qurl export: {tmp_path / 'bad'}: no such checkpoint or directory\n"
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_force_never_replaces_a_megatron_lm_checkpoint(tmp_path, capsys):
    """A Megatron-LM / slime --save directory (torch_dist slices, its iteration file) is a checkpoint too."""
    save = tmp_path / "megatron"
    (save / "iter_0000001").mkdir(parents=True)
    (save / "iter_0000001" / "__0_0.distcp").write_bytes(b"slices")
    (save / "latest_checkpointed_iteration.txt").write_text("1")
    hf = _uaq_scaled_hf(tmp_path / "hf_in")
    assert main(["export", str(hf), str(save), "--uaq-scale", "1.5", "--force"]) == 2
    assert "holds a checkpoint" in capsys.readouterr().out
    assert (save / "iter_0000001" / "__0_0.distcp").read_bytes() == b"slices"


def test_an_output_nothing_can_be_written_in_is_refused_before_the_ranks_start(tmp_path, capsys):
    """/proc refuses every write (root's too): one line and rc 2, not a rank's traceback."""
    step = _checkpoint(tmp_path / "ckpt")
    assert main(["export", str(step), "/proc/x"]) == 2
    assert capsys.readouterr().out == ("qurl export: nothing can be written in /proc/x (No such file or directory); "
                                       "give a directory the export can write\n")
