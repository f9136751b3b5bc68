"""Four LightningModules written the way users write them, with their own DataModules: no ``effi_*`` hook, no
``per_sample_loss``, plain ``loss`` returns, tuple batches where users use them. They are the contract of
"your own LightningModule works unchanged"; nothing here may import from ``lightning_effi``.

- :class:`CharGPT2`: an HF ``GPT2LMHeadModel`` (built from a config, ``n_positions=256``) on character tokens of
  Tiny Shakespeare, samples ``(x, y)`` with ``y = x`` (HF shifts the labels inside), ``return out.loss``.
- :class:`TimmViT`: a timm ViT on ``(image, label)`` batches, ``F.cross_entropy``.
- :class:`BertClassifier`: an HF ``BertForSequenceClassification`` on variable-length sentences with a padding collate
  returning dicts, ``return self.model(**batch).loss``.
- :class:`EncoderClassifier`: a hand-written ``nn.TransformerEncoder`` (``batch_first=True``) classifier on
  ``(tokens, label)`` batches.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


# --------------------------------------------------------------------------------------------------------- data
class CharBlocks(Dataset):
    """``n`` blocks of ``block`` characters of Tiny Shakespeare (or of a seeded random text when the file is absent),
    as ``(x, y)`` token-id tuples with ``y = x``."""

    def __init__(self, n: int = 32, block: int = 32) -> None:
        text = SHAKESPEARE.read_text()[: n * block + 1] if SHAKESPEARE.exists() else None
        if text is None:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 65, (n * block,), generator=g)
        else:
            chars = sorted(set(SHAKESPEARE.read_text()))
            lookup = {c: i for i, c in enumerate(chars)}
            ids = torch.tensor([lookup[c] for c in text[: n * block]])
        self.blocks = ids.view(n, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks[i], self.blocks[i].clone()


class RandomImages(Dataset):
    """``n`` seeded ``(image[3, 32, 32], label)`` pairs, the label a function of the image (learnable)."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = (self.x.mean((1, 2, 3)) > 0).long() + 2 * (self.x[:, 0].mean((1, 2)) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


class Sentences(Dataset):
    """``n`` seeded variable-length sentences (token ids 1..63, 0 is padding, 5 to 24 tokens) with a binary label:
    dict samples ``{"input_ids": int64[L], "labels": int}``."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(2)
        lengths = torch.randint(5, 25, (n,), generator=g)
        self.items = [torch.randint(1, 64, (int(n_),), generator=g) for n_ in lengths]
        self.labels = [int(s.float().mean() > 32) for s in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i], "labels": self.labels[i]}


def pad_collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding to the longest sentence of the batch, as ``DataCollatorWithPadding`` does."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        mask[row, : len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["labels"] for s in samples])}


class TokenLabels(Dataset):
    """``n`` seeded ``(tokens[16], label)`` pairs for the hand-written encoder."""

    def __init__(self, n: int = 32, length: int = 16) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 32, (n, length), generator=g)
        self.y = (self.x[:, 0] >= 16).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class UserData(pl.LightningDataModule):
    """A plain DataModule: the same dataset for training and validation, a shuffling loader."""

    def __init__(self, dataset: Dataset, batch_size: int = 4, collate_fn=None) -> None:
        super().__init__()
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate_fn)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)


# ------------------------------------------------------------------------------------------------------ modules
class CharGPT2(pl.LightningModule):
    def __init__(self, n_layer: int = 4, n_positions: int = 256, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=65, n_positions=n_positions, n_layer=n_layer, n_embd=32, n_head=2, attn_implementation="eager"
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(input_ids=x, labels=y).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.model(input_ids=x, labels=y).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TimmViT(pl.LightningModule):
    def __init__(self, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=32,
            patch_size=8,
            depth=depth,
            embed_dim=32,
            num_heads=2,
            num_classes=4,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class BertClassifier(pl.LightningModule):
    def __init__(self, n_layer: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=n_layer,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=2,
            attn_implementation="eager",
        )
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Encoder(nn.Module):
    """A hand-written transformer classifier: embedding, ``nn.TransformerEncoder``, mean pooling, a linear head."""

    def __init__(self, vocab: int = 32, width: int = 32, depth: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, 64, width))
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.encoder(h).mean(1))


class EncoderClassifier(pl.LightningModule):
    def __init__(self, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Encoder(depth=depth)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


#: name -> (module factory, DataModule factory)
USER_MODULES = {
    "gpt2_chars": (CharGPT2, lambda: UserData(CharBlocks())),
    "timm_vit": (TimmViT, lambda: UserData(RandomImages())),
    "bert_cls": (BertClassifier, lambda: UserData(Sentences(), collate_fn=pad_collate)),
    "torch_encoder": (EncoderClassifier, lambda: UserData(TokenLabels())),
}
