"""Train a small Megatron-core GPT with context parallelism on packed variable-length data.

Runs on CPU over gloo (and on GPUs over NCCL unchanged). Every CP size trains the same model
on the same data, so ``--context-parallel-size 1`` prints the same losses as 2 or 4 (``MCX_DEMO_SHORT=1`` or
``--train-iters 3`` for a smoke run)::

    torchrun --nproc-per-node 4 examples/train_gpt.py --context-parallel-size 4 --cp-comm-type p2p
    torchrun --nproc-per-node 1 examples/train_gpt.py --context-parallel-size 1

Data is generated: documents of random length (not multiples of 2*cp) whose tokens follow
a per-document arithmetic progression, packed back to back (THD) - learnable, so the loss
falls within a few dozen steps. ``--qkv-format sbhd`` trains on fixed-length rows instead.
World size = CP size x data-parallel size (tensor/pipeline parallel stay 1 here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cp_ext.megatron.args import (  # noqa: E402
    add_arguments,
    add_megatron_cp_arguments,
    check_cp_args,
    cp_attention_options_from_args,
    cp_comm_type_from_args,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-LM's CP flags, megatron_cp_ext's own, and the demo's model/data knobs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_megatron_cp_arguments(parser)
    add_arguments(parser)
    demo = parser.add_argument_group("demo")
    demo.add_argument("--train-iters", type=int, default=30, help="optimizer steps (3 is a CI smoke run)")
    demo.add_argument("--num-layers", type=int, default=2)
    demo.add_argument("--hidden-size", type=int, default=64)
    demo.add_argument("--num-attention-heads", type=int, default=4)
    demo.add_argument("--num-query-groups", type=int, default=2, help="< heads means GQA")
    demo.add_argument("--vocab-size", type=int, default=128)
    demo.add_argument("--seq-length", type=int, default=512, help="tokens per micro-batch (per DP rank)")
    demo.add_argument("--min-doc-len", type=int, default=5)
    demo.add_argument("--max-doc-len", type=int, default=150)
    demo.add_argument("--qkv-format", choices=("thd", "sbhd"), default="thd")
    demo.add_argument("--micro-batch-size", type=int, default=2, help="rows per micro-batch for sbhd")
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--seed", type=int, default=1234)
    demo.add_argument("--json-out", default=None, help="rank 0 writes losses and timings here")
    args = parser.parse_args(argv)
    lo, hi = args.min_doc_len, args.max_doc_len
    problem = check_cp_args(args)
    if not problem and not (0 <= lo <= hi and hi >= 1):
        problem = f"--min-doc-len/--max-doc-len: need 0 <= min <= max and max >= 1, got {lo}, {hi}"
    if problem:
        parser.error(problem)
    return args


def init_parallel(args: argparse.Namespace) -> tuple[int, int]:
    """Process groups: CP inner (consecutive ranks), DP outer. Returns (dp_rank, dp_size)."""
    world, cp = dist.get_world_size(), args.context_parallel_size
    if world % cp:
        raise SystemExit(f"world size {world} is not a multiple of --context-parallel-size {cp}")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
    )
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A small RoPE GPT from our CP layer spec; identical weights for every CP size."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cp_ext.megatron import get_gpt_layer_cp_spec, install_cp_rope

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=4 * args.hidden_size,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=cp_comm_type_from_args(args),
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        window_size=args.window_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_cp_spec(options=cp_attention_options_from_args(args)),
        vocab_size=args.vocab_size,
        max_sequence_length=max(args.seq_length, args.max_doc_len),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return install_cp_rope(model).to(device)


def make_batch(args: argparse.Namespace, step: int, dp_rank: int) -> dict:
    """This DP rank's global (unsharded) micro-batch for ``step``; same on every CP rank."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 1_009 + dp_rank)
    if args.qkv_format == "thd":
        lengths, total = [], 0
        while total < args.seq_length:
            n = int(torch.randint(args.min_doc_len, args.max_doc_len + 1, (1,), generator=gen))
            lengths.append(min(n, args.seq_length - total))
            total += lengths[-1]
    else:
        lengths = [args.seq_length] * args.micro_batch_size
    docs, labels, masks = [], [], []
    for n in lengths:
        start = int(torch.randint(args.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        doc = (start + stride * torch.arange(n + 1)) % args.vocab_size
        docs.append(doc[:n])
        labels.append(doc[1:])
        mask = torch.ones(n)
        mask[-1:] = 0.0  # no target across a document boundary (an empty document has none)
        masks.append(mask)
    cu = torch.tensor([0] + lengths).cumsum(0)
    if args.qkv_format == "thd":
        cat = lambda xs: torch.cat(xs).unsqueeze(0)  # noqa: E731 - [1, T] is Megatron's packed layout
        return {"tokens": cat(docs), "labels": cat(labels), "loss_mask": cat(masks), "cu_seqlens": cu}
    return {"tokens": torch.stack(docs), "labels": torch.stack(labels), "loss_mask": torch.stack(masks)}


def local_batch(args: argparse.Namespace, batch: dict, device: torch.device) -> dict:
    """This CP rank's tokens (position ids keep their true in-document values)."""
    from megatron.core import parallel_state

    from megatron_cp_ext.megatron import shard_batch_for_cp

    cp_group = parallel_state.get_context_parallel_group()
    tensors = {k: v.to(device) for k, v in batch.items() if k != "cu_seqlens"}
    if args.qkv_format == "thd":
        # the model's mask: the workload balance evens out attention work under it
        mask = {"window_size": tuple(args.window_size) if args.window_size else (-1, -1),
                "chunk_size": args.cp_attention_chunk_size}  # fmt: skip
        cu = batch["cu_seqlens"]
        # "te" names Megatron's own split, which needs documents padded to multiples of 2*cp;
        # these are not, so the demo then splits with the default balance. Either way the
        # packed_seq_params returned carry the split, so every layer uses it.
        balance = "workload" if args.cp_load_balance == "te" else args.cp_load_balance
        return shard_batch_for_cp(tensors, cu_seqlens=cu, cp_group=cp_group, balance=balance, causal=True, **mask)
    s = tensors["tokens"].shape[1]
    tensors["position_ids"] = torch.arange(s, device=device).expand_as(tensors["tokens"])
    return shard_batch_for_cp(tensors, cp_group=cp_group)


def train_step(model, optimizer, batch: dict) -> tuple[float, int]:
    """One step; returns (global mean loss, global token count)."""
    optimizer.zero_grad(set_to_none=True)
    loss_TOK = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
    )
    mask = batch["loss_mask"].float()
    # Global normaliser first, so the per-rank partial gradients just add up.
    stats = torch.stack([mask.sum(), torch.tensor(float(mask.numel()), device=mask.device)])
    dist.all_reduce(stats)
    local_sum = (loss_TOK.float() * mask).sum()
    (local_sum / stats[0]).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params])
    loss_sum = local_sum.detach().reshape(1)
    packed = torch.cat([flat, loss_sum])
    dist.all_reduce(packed)  # sum over CP (partial sums) and DP (global normaliser): one collective
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = packed[offset : offset + n].view_as(p).clone()
        offset += n
    optimizer.step()
    return float(packed[-1] / stats[0]), int(stats[1])


def run(args: argparse.Namespace) -> dict:
    """Train ``args.train_iters`` steps on the default process group (already initialised):
    the losses and step times. Megatron's model-parallel state is set up here, not torn down."""
    dp_rank, _ = init_parallel(args)
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    model = build_model(args, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(
            f"GPT {args.num_layers}x{args.hidden_size}, CP {args.context_parallel_size} "
            f"({' '.join(args.cp_comm_type)}), world {dist.get_world_size()}, {args.qkv_format}, {device.type}",
            flush=True,
        )
    losses, times = [], []
    for step in range(args.train_iters):
        batch = local_batch(args, make_batch(args, step, dp_rank), device)
        start = time.perf_counter()
        loss, tokens = train_step(model, optimizer, batch)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank0:
            print(f"step {step + 1:4d}  loss {loss:.6f}  tokens/s {tokens / times[-1]:10.1f}", flush=True)
    return {"losses": losses, "step_seconds": times}


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    args = parse_args(argv)
    if os.environ.get("MCX_DEMO_SHORT"):  # CI smoke run of the README command
        args.train_iters = min(args.train_iters, 3)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = run(args)
    if dist.get_rank() == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result, "args": vars(args)}, f, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
