"""random-LTD's default ``max_value`` from the data (issue: "random-LTD defaults from the data").

A user's HF GPT-2 built with ``n_positions=256`` trained on 64-token character blocks of Tiny Shakespeare, with a
plain ``loss`` return and ``(x, y)`` tuple batches, and ``RandomLTDCallback(min_value=16, seq_per_step=16)`` left
at its default ``max_value``: the schedule must end at the 64 tokens the layers see (not at ``n_positions``).
Writes the EfficiencyMonitor's compute counts of the run (layer-tokens and FLOPs saved against the same run without
token dropping: an accounting check, not a quality claim) to ``results/random_ltd_max_value.json``.

    python experiments/bench/random_ltd_max_value.py [--steps 40] [--data ../shared/data/tinyshakespeare/input.txt]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_effi import EfficiencyMonitor, RandomLTDCallback

ROOT = Path(__file__).resolve().parents[2]


class CharGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=65, n_positions=256, n_layer=4, n_embd=32, n_head=2, attn_implementation="eager")
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/tinyshakespeare/input.txt")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/bench/results/random_ltd_max_value.json")
    args = parser.parse_args()

    text = args.data.read_text()
    lookup = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([lookup[c] for c in text[: 64 * 64]]).view(64, 64)
    loader = DataLoader(TensorDataset(ids, ids.clone()), batch_size=8, shuffle=True)

    torch.manual_seed(0)
    monitor = EfficiencyMonitor(print_summary=False)
    ltd = RandomLTDCallback(min_value=16, seq_per_step=16, seed=0)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[monitor, ltd],
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(CharGPT2(), train_dataloaders=loader)
    s = monitor.summary
    result = {
        "n_positions": 256,
        "block_tokens": 64,
        "max_value": ltd.max_value,
        "steps": args.steps,
        "layer_tokens": s["layer_tokens"],
        "baseline_layer_tokens": s["baseline_layer_tokens"],
        "layer_tokens_saved_frac": s["saved/random_ltd/layer_tokens_frac"],
        "flops_saved_frac": s["flops_saved_frac"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
