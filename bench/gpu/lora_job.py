"""Fine-tuning on CUDA (bench/gpu, check 6), with no model to download: a small Llama made from
its config (4 layers, 512 wide), saved and loaded back as a checkpoint would be.

- LoRA (peft, r=8 on q_proj and v_proj) in bf16: 20 steps on a fixed batch; the loss falls;
  peak GPU memory.
- QLoRA: the same model loaded 4-bit (bitsandbytes NF4) when bitsandbytes is there; its
  peak memory against bf16's.
- torch's bf16 compression hook (DistributedDataParallel's default_hooks.bf16_compress_hook,
  CUDA tensors only) in a 2-process gloo run on the one GPU (NCCL will not put two ranks on
  one device): the loss of the two ranks agrees.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch


def lora(path: str, quantized: bool) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"dtype": torch.bfloat16}
    if quantized:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to("cuda") if not quantized else \
        AutoModelForCausalLM.from_pretrained(path, device_map={"": 0}, **kwargs)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(round(float(loss), 4))
    return {"first_loss": losses[0], "last_loss": losses[-1], "learned": losses[-1] < losses[0],
            "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20)}


def hooked(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256).cuda(), device_ids=None)
    model.register_comm_hook(state=None, hook=default_hooks.bf16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank + 1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
        opt.step()
    first = next(model.parameters()).detach()
    gathered = [torch.zeros_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"same_weights": bool(torch.allclose(gathered[0], gathered[1])), "ranks": world}, f)
    dist.destroy_process_group()


def main() -> None:
    result: dict = {"cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        print(json.dumps(result), flush=True)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=8)).save_pretrained(path)
        for name, quantized in (("bf16", False), ("nf4", True)):
            try:
                result[name] = lora(path, quantized)
            except ImportError as exc:
                result[name] = {"skipped": f"{exc.name or exc} is not installed"}
            except Exception as exc:  # noqa: BLE001 - said, and the other parts still run
                result[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    try:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tempfile.mktemp(suffix=".json")
        mp.spawn(hooked, args=(2, port, out), nprocs=2, join=True)
        with open(out) as f:
            result["bf16_hook"] = json.load(f)
    except Exception as exc:  # noqa: BLE001
        result["bf16_hook"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
