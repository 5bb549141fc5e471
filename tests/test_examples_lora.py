"""examples/lora_smollm2.py's own parts, without the model: its arguments, its batches (padding is
never learnt), its checkpoints (the newest whole one; a half-written or foreign file is not one)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_examples_load import example

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="the models extra is not installed (make setup installs it)")
lora = example("lora_smollm2")


def test_defaults_fine_tune_with_diloco_on_the_adapters():
    args = lora.parse_args([])
    assert (args.steps, args.sync, args.compression, args.rank, args.checkpoint_every) == (30, "diloco:10", "fp16", 8,
                                                                                            10)


@pytest.mark.parametrize(("argv", "says"), [
    (["--steps", "0"], "--steps"), (["--batch", "0"], "--batch"), (["--rank", "-1"], "--rank"),
    (["--threads", "0"], "--threads"), (["--lr", "0"], "--lr"), (["--lr", "2"], "--lr"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"), (["--export-int8"], "--save"),
    (["--compression", "int4"], "--compression")])
def test_bad_arguments_are_refused_naming_them(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        lora.parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_batch_pads_on_the_right_and_learns_no_padding():
    ids, mask, labels = lora.batch_of([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[5, 6, 7], [8, -100, -100]]


def test_the_newest_whole_checkpoint_is_resumed(tmp_path):
    assert lora.newest_checkpoint(None) is None and lora.newest_checkpoint(tmp_path / "none") is None
    for step in (10, 20, 30):
        lora.save_checkpoint(tmp_path, step, {"step": step})
    (tmp_path / ".step-000040.pt.tmp").write_bytes(b"half")  # a save cut short
    (tmp_path / "step-50.ptx").write_bytes(b"not ours")
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-000020.pt", "step-000030.pt"], \
        "the two newest are kept"
    newest = lora.newest_checkpoint(tmp_path)
    assert newest.name == "step-000030.pt" and torch.load(newest, weights_only=True) == {"step": 30}


def test_the_corpus_is_question_and_answer_text():
    assert len(lora.CORPUS) >= 8
    assert all(isinstance(q, str) and isinstance(a, str) and q.endswith("?") and a for q, a in lora.CORPUS)
