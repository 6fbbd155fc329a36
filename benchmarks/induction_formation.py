"""When does a small Qwen2 model learn to copy? The measurement behind the tiny agent's shape.

Copying a number from the prompt into a tool call, or a tool's output into the answer,
needs induction heads: find the earlier occurrence of the current token, predict its
successor. This trains a Qwen2 model from a config on the build's copy drills (random
tokens with a 10-30-token stretch repeated after a random gap; the repeat after its first
token is the target) and reports, every `--eval-every` steps, the argmax accuracy on those
targets for 256 held-out drills. Induction shows as a sudden jump from ~0.05 to > 0.9; the
run stops there. docs/results.md ("The tiny agent's warm start") has the shapes measured.

    python benchmarks/induction_formation.py                     # the tiny agent's shape
    python benchmarks/induction_formation.py --hidden 192 --layers 4 --heads 4 --kv-heads 2 \\
        --intermediate 512 --name old-shape                        # the format-3 shape
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch


def drills(rng: random.Random, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` copy drills over tokens 0..vocab-1, right-padded with `vocab`; target weights."""
    rows = []
    for _ in range(n):
        segment = [rng.randrange(vocab) for _ in range(rng.randint(10, 30))]
        before = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        gap = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        head = [*before, *segment, *gap, segment[0]]
        rows.append(([*head, *segment[1:]], [0] * len(head) + [1] * (len(segment) - 1)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((n, width), vocab)
    weights = torch.zeros(n, width)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        weights[i, : len(row)] = torch.tensor(mask, dtype=torch.float32)
    return ids, weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--vocab", type=int, default=1000, help="token types in the drills")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="tiny-shape", help="output: results/induction-NAME.json")
    args = p.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=args.vocab + 1, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=10000.0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_rng, held_out = random.Random(args.seed + 1), random.Random(99)
    eval_ids, eval_weights = drills(held_out, 256, args.vocab)

    def loss_and_accuracy(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
        logits = model(ids).logits[:, :-1]
        targets, w = ids[:, 1:], weights[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        )
        right = (logits.argmax(-1) == targets).float()
        return (loss.view_as(w) * w).sum() / w.sum(), ((right * w).sum() / w.sum()).item()

    start, history = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50)  # warmup, then constant (as the build)
        loss, _ = loss_and_accuracy(*drills(train_rng, args.batch, args.vocab))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            with torch.no_grad():
                _, accuracy = loss_and_accuracy(eval_ids, eval_weights)
            history.append(
                {"step": step, "seconds": round(time.perf_counter() - start, 1),
                 "train_loss": round(loss.item(), 3), "copy_accuracy": round(accuracy, 3)}
            )  # fmt: skip
            print(json.dumps(history[-1]), flush=True)
            if accuracy > 0.9:
                break
    formed = next((h["step"] for h in history if h["copy_accuracy"] > 0.9), None)
    print(f"induction formed at step {formed}" if formed else "induction did not form")
    out = Path(__file__).parent / "results" / f"induction-{args.name}.json"
    out.parent.mkdir(exist_ok=True)
    report = {
        "args": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "formed_at_step": formed,
        "history": history,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
