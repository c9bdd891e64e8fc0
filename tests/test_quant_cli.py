"""``devin-compile quantize calibrate | run | validate`` end to end on the real SmolLM2 (small slices),
and the CLI's answers to bad input."""
import json
import os

import pytest

from devin_compile.cli import main


def test_bad_method_and_group_size_are_clear_errors(tmp_path, capsys):
    assert main(["quantize", "run", "--calib", str(tmp_path), "--method", "hqq", "--out", str(tmp_path / "q")]) == 2
    assert "method 'hqq' is unsupported; valid: ['rtn', 'awq', 'gptq']" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--group-size", "100", "--out", str(tmp_path / "q")]) == 2
    assert "group_size=100 is unsupported; valid: [32, 64, 128]" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--target", "half", "--out", str(tmp_path / "q")]) == 2
    assert "target 'half' is unknown" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--anchors", "-1", "--out", str(tmp_path / "q")]) == 2
    assert "anchors" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--refits", "-1", "--out", str(tmp_path / "q")]) == 2
    assert "refits=-1" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--loss-weight", "-1", "--out", str(tmp_path / "q")]) == 2
    assert "loss_weight" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--per-linear", "{up_proj: 1}", "--out",
                 str(tmp_path / "q")]) == 2
    assert "--per-linear '{up_proj: 1}' is not valid JSON" in capsys.readouterr().err
    assert main(["quantize", "run", "--calib", str(tmp_path), "--per-linear", '{"up_proj": {"damp": 0}}', "--out",
                 str(tmp_path / "q")]) == 2
    assert "per_linear['up_proj'] damp=0" in capsys.readouterr().err
    assert main(["quantize", "calibrate", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "c")]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_run_validate_on_smollm2(tmp_path, capsys):
    calib, q = tmp_path / "calib", tmp_path / "q"
    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "notes.md").write_text("# Notes\n\n- one\n- two\n" * 40)
    # several --data paths (a file and a folder); --quiet: no progress
    assert main(["quantize", "calibrate", "--data", _text(tmp_path), str(folder), "--chunks", "2", "--chunk-len", "128",
                 "--quiet", "--out", str(calib)]) == 0
    meta = json.loads((calib / "calib.json").read_text())
    assert meta["tokens"] == 256 and len(meta["linear_input"]) == 211  # 7 linears x 30 layers + lm_head
    assert meta["data"].split(os.pathsep) == [_text(tmp_path), str(folder / "notes.md")]
    assert "calibrating" not in capsys.readouterr().out
    assert main(["quantize", "run", "--calib", str(calib), "--method", "rtn", "--group-size", "128",
                 "--out", str(q)]) == 0
    out = capsys.readouterr().out
    assert "RTN INT4 g128: 210/210 (100%), done in " in out  # the per-linear loop's progress (piped: log lines)
    assert "128 does not divide K=576: largest dividing size 64" in out
    assert main(["quantize", "validate", "--quantized", str(q), "--data", _text(tmp_path), "--chunks", "2",
                 "--chunk-len", "128"]) == 0
    rep = json.loads((q / "validate.json").read_text())
    quality = rep["quality"]
    assert quality["tokens"] == 2 * 127 and 0 < quality["kl"] < 2 and 0.3 < quality["top1"] <= 1
    *layers, head = rep["layers"]  # the decoder linears, then the output head (INT8 by default)
    assert len(layers) == 120 and all(r["precision"] == "int4" for r in layers)
    assert (head["linear"], head["precision"]) == ("lm_head", "int8")
    assert {r["group_size"] for r in layers} == {64, 128}  # down_proj's K=1536 takes 128
    assert rep["int4_bytes_total"] < rep["fp_bytes_total"] / 5
    assert 0 <= quality["top1_chunk_se"] < 0.5
    assert (q / "validate.md").read_text().startswith("# Validation of")
    assert "| top-1, standard error over chunks |" in (q / "validate.md").read_text()
    # the saved artifact does not match another model: a clear error
    from transformers import LlamaConfig, LlamaForCausalLM

    from devin_compile.quant import artifact

    other = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4)).eval()
    with pytest.raises(ValueError, match="different model"):
        artifact.load(q, other)


def _text(tmp_path) -> str:
    """A slice of the shipped calibration set's dialogue long enough for 2 x 128 calibration and evaluation tokens."""
    from devin_compile.quant.corpus import default_data_dir

    text = (default_data_dir() / "dialogue-shakespeare.txt").read_text()[:20000]
    path = tmp_path / "slice.txt"
    path.write_text(text)
    return str(path)
