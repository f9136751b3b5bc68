"""Tiny seeded models and in-memory datasets shared by the tests of every technique."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader
from lightning_effi.reference.data.base import PaddingCollate
from lightning_effi.tasks import BertMaskedLM, BertSequenceClassifier, GPT2CausalLM, ImageClassifier

TINY_GPT2 = dict(vocab_size=64, n_positions=32, n_layer=2, n_embd=32, n_head=2, attn_implementation="eager")
TINY_BERT = dict(vocab_size=64, max_length=32, n_layer=2, n_embd=32, n_head=2, attn_implementation="eager", dropout=0.0)
TINY_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)


def sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: deterministic and with optimizer state, for resume comparisons."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def tiny_gpt2(**kw: Any) -> GPT2CausalLM:
    return GPT2CausalLM(**{**TINY_GPT2, "optimizer": sgd, **kw})


def tiny_bert_mlm(**kw: Any) -> BertMaskedLM:
    return BertMaskedLM(**{**TINY_BERT, "optimizer": sgd, **kw})


def tiny_bert_cls(**kw: Any) -> BertSequenceClassifier:
    return BertSequenceClassifier(**{**TINY_BERT, "num_classes": 2, "optimizer": sgd, **kw})


def tiny_cnn(**kw: Any) -> ImageClassifier:
    return ImageClassifier("effi_cnn_small", model_kwargs={"widths": [8, 16]}, optimizer=sgd, **kw)


def tiny_vit(**kw: Any) -> ImageClassifier:
    return ImageClassifier("vit_tiny_patch16_224", model_kwargs=TINY_VIT, optimizer=sgd, **kw)


class TokenBlocks(Dataset):
    """``n`` fixed blocks of ``seq_len`` random token ids (seeded): ``{"input_ids": int64[T]}``."""

    def __init__(self, n: int = 40, seq_len: int = 16, vocab_size: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i]}


class Sentences(Dataset):
    """``n`` variable-length token sequences with binary labels: ``{"input_ids": int64[L_i], "labels": int64[]}``."""

    def __init__(self, n: int = 40, max_len: int = 16, vocab_size: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, max_len + 1, (n,), generator=g)
        self.items = [torch.randint(1, vocab_size, (int(L),), generator=g) for L in lengths]
        self.labels = (torch.stack([x.float().mean() for x in self.items]) > vocab_size / 2).long()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i], "labels": self.labels[i]}

    def sequence_lengths(self) -> Any:
        return torch.tensor([len(x) for x in self.items]).numpy()


class Images(Dataset):
    """``n`` random 32x32 images with labels in [0, 10): ``{"pixel_values": float[3,32,32], "labels": int64[]}``."""

    def __init__(self, n: int = 40, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class TinyDataModule(pl.LightningDataModule):
    """Wraps in-memory datasets; the train loader is a :class:`ResumableDataLoader` sharded by the trainer's rank."""

    def __init__(
        self,
        train: Dataset,
        val: Dataset | None = None,
        batch_size: int = 8,
        collate_fn: Any = None,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.train_dataset, self.val_dataset = train, val if val is not None else train
        self.batch_size, self.collate_fn, self.num_workers, self.seed = batch_size, collate_fn, num_workers, seed

    def train_dataloader(self) -> ResumableDataLoader:
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        sampler = EpochShuffleSampler(self.train_dataset, num_replicas=world, rank=rank, seed=self.seed)
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val_dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)


def seqlen_truncate(
    min_difficulty: int = 8, max_difficulty: int = 16, total_curriculum_step: int = 2, difficulty_step: int = 8
) -> dict[str, Any]:
    """A curriculum's ``metrics`` with one ``seqlen_truncate`` metric growing linearly from ``min_difficulty`` to
    ``max_difficulty`` over ``total_curriculum_step`` steps, in multiples of ``difficulty_step``."""
    return {
        "seqlen_truncate": dict(
            difficulty_type="value",
            clustering_type="single_cluster",
            min_difficulty=min_difficulty,
            max_difficulty=max_difficulty,
            schedule_type="fixed_linear",
            schedule_config=dict(total_curriculum_step=total_curriculum_step, difficulty_step=difficulty_step),
        )
    }


def tiny_lm_data(**kw: Any) -> TinyDataModule:
    return TinyDataModule(TokenBlocks(), **kw)


class TokenStream(torch.utils.data.IterableDataset):
    """The 16 first :class:`TokenBlocks` as a stream: a training set without a length."""

    def __iter__(self) -> Any:
        return iter(TokenBlocks(n=16)[i] for i in range(16))


class TokenStreamData(pl.LightningDataModule):
    """:class:`TokenStream` in batches of 4 (a train dataloader without a length)."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(TokenStream(), batch_size=4)


def tiny_sentence_data(**kw: Any) -> TinyDataModule:
    return TinyDataModule(Sentences(), collate_fn=PaddingCollate(pad_token_id=0), **kw)


def tiny_image_data(**kw: Any) -> TinyDataModule:
    return TinyDataModule(Images(), **kw)


class GPT2WithoutTest(GPT2CausalLM):
    """The reference GPT-2 task without a ``test_step`` (a user's module that never tests): ``test=true`` is refused."""

    test_step = None  # type: ignore[assignment]


class HandLM(pl.LightningModule):
    """A hand-written token model with no FLOPs hook: an embedding (64 x 16) and a linear head, ``training_step``
    calling ``self(ids)`` on the batch's ``input_ids`` (``shift=True``: the causal slice ``ids[:, :-1]`` against
    ``ids[:, 1:]``, which is not a tensor of the batch itself). Its training FLOPs are the head's matmul:
    ``3 * 2 * B * T' * 16 * 64`` for ``T'`` positions (forward and backward)."""

    def __init__(self, shift: bool = False) -> None:
        super().__init__()
        self.shift = shift
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        inputs, targets = (ids[:, :-1], ids[:, 1:]) if self.shift else (ids, ids)
        return torch.nn.functional.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HFMixtralLM(pl.LightningModule):
    """A tiny Hugging Face Mixtral LM (vocabulary 32, width 16, 4 experts of which 2 per token) as ``self.model``,
    trained on ``(ids,)`` tuple batches with its own ``labels=ids`` loss; ``config`` overrides the
    ``MixtralConfig`` (``num_hidden_layers``, ``use_cache``, ``output_router_logits``, ...)."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        import transformers

        base = dict(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        )  # fmt: skip
        self.model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**base, **config}))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HandImageLinear(pl.LightningModule):
    """A hand-written linear classifier on ``{"pixel_values": [B, 3, 32, 32], "labels": [B]}`` batches (CIFAR-10's and
    :class:`Images`'), seeded weights (``torch.manual_seed(0)``), plain SGD at lr 0.1, a plain mean loss: for
    resume tests that compare final weights bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3 * 32 * 32, 10)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch["pixel_values"].flatten(1)), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TimmViTWithEma(pl.LightningModule):
    """A timm recipe as users write it: a ViT (16 x 16 images, patches of 4, 4 blocks of width 16) as ``self.net`` and
    timm's ``ModelEmaV3`` of it (its copy trainable, in eval mode), updated after every batch; ``(x, y)`` batches."""

    def __init__(self) -> None:
        super().__init__()
        import timm
        from timm.utils import ModelEmaV3

        self.net = timm.create_model(
            "vit_tiny_patch16_224", img_size=16, patch_size=4, depth=4, embed_dim=16, num_heads=2, num_classes=3
        )
        self.ema = ModelEmaV3(self.net, decay=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update(self.net, step=self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.01)
