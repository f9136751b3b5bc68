"""InfoBatch on LightningModules as users write them: a plain ``loss`` return, any batch structure.

Four user modules (tiny, seeded, built from configs, never downloaded): a Hugging Face GPT-2 on character tokens with
tuple samples (list batches from ``default_collate``, or dict batches from a collate function), a timm ViT on ``(x, y)``
tuple batches, a BERT classifier with a padding collate returning a ``BatchEncoding``, and a hand-written
``nn.TransformerEncoder`` classifier on dataclass batches. Each trains with InfoBatch unchanged: pruned epochs are
shorter, ``training_step`` receives exactly the batch its own collate function makes, and the loss trained on is
``mean(w_i * l_i)`` with ``l_i`` the hand-computed ``F.cross_entropy(..., reduction="none")`` per sample. Then
``per_sample_loss=fn``, the automatic path's functions without a Trainer, the errors (mismatch, detached, wrong
shape), manual optimization through ``weighted_loss``, and InfoBatch inside the curriculum on tuple batches.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import namedtuple
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import timm
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate
from transformers import (
    BatchEncoding,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.modeling_outputs import CausalLMOutput

from lightning_effi.callbacks import Curriculum, InfoBatchCallback
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.errors import DataConfigError
from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
from lightning_effi.infobatch import functional as ib
from lightning_effi.infobatch import weighted_loss
from lightning_effi.infobatch.callback import ForwardCapture
from tests.helpers.harness import make_trainer

N, BS, EPOCHS = 24, 4, 3  # E = 3, delta = 0.875: epoch 0 full, epoch 1 pruned, epoch 2 full (annealing)
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "


# ------------------------------------------------------------------------------------------------- user data
class CharBlocks(Dataset):
    """Character tokens of ``TEXT``, ``N`` blocks of 12: tuple samples ``(input_ids, labels)`` (labels = inputs, as
    for a causal LM whose model shifts them)."""

    def __init__(self) -> None:
        vocab = sorted(set(TEXT))
        ids = torch.tensor([vocab.index(c) for c in TEXT * 4])
        self.blocks = [ids[3 * i : 3 * i + 12] for i in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.blocks[i], self.blocks[i].clone()


class SmallImages(Dataset):
    """``(image float[3, 8, 8], label)`` tuples, 3 classes."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 3, 8, 8, generator=g), torch.randint(0, 3, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class Sentences(Dataset):
    """Variable-length token sequences with a binary label: ``{"input_ids": int64[L], "label": int}``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        lengths = torch.randint(3, 11, (N,), generator=g)
        self.items = [torch.randint(1, 32, (int(n),), generator=g) for n in lengths]
        self.labels = [int(x.sum()) % 2 for x in self.items]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.items[i], "label": self.labels[i]}


@dataclasses.dataclass
class TokenBatch:
    """A user's dataclass batch."""

    tokens: Tensor
    y: Tensor


class Tokens(Dataset):
    """``(tokens int64[8], class)`` tuples, 3 classes (the class is the first token's residue: learnable)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 64, (N, 8), generator=g)
        self.y = self.x[:, 0] % 3

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def dict_collate(samples: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Tuple samples in, a dict batch out."""
    x, y = default_collate(samples)
    return {"input_ids": x, "labels": y}


def tuple_collate(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    x, y = default_collate(samples)
    return x, y


def padding_collate(samples: list[dict[str, Any]]) -> BatchEncoding:
    """Pads to the longest sequence (id 0) and returns a Hugging Face ``BatchEncoding``."""
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.int64)
    mask = torch.zeros(len(samples), length, dtype=torch.int64)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        mask[row, : len(s["input_ids"])] = 1
    labels = torch.tensor([s["label"] for s in samples])
    return BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


def dataclass_collate(samples: list[tuple[Tensor, Tensor]]) -> TokenBatch:
    x, y = default_collate(samples)
    return TokenBatch(x, y)


class UserData(pl.LightningDataModule):
    """A DataModule as users write it: a plain shuffling DataLoader with their collate function."""

    def __init__(self, dataset: Dataset, collate_fn: Callable | None = None, batch_size: int = BS) -> None:
        super().__init__()
        self.train_dataset, self.collate_fn, self.batch_size = dataset, collate_fn, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate_fn)


# ---------------------------------------------------------------------------------------------- user modules
class UserModule(pl.LightningModule):
    """Records what its ``training_step`` received and computed (for the tests only; the step returns a plain
    loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, Any]] = []

    def remember(self, batch: Any, logits: Tensor, loss: Tensor) -> None:
        meta = batch_meta(self._trainer) or {}
        index = meta["index"].clone() if "index" in meta else None
        self.steps.append({"batch": batch, "logits": logits.detach(), "loss": loss.detach(), "index": index})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CharGPT2(UserModule):
    """A Hugging Face GPT-2 (from a config) on character tokens; the model shifts the labels itself."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if isinstance(batch, Mapping):
            out = self.model(**batch)
        else:
            x, y = batch
            out = self.model(input_ids=x, labels=y)
        self.remember(batch, out.logits, out.loss)
        return out.loss


class ViT(UserModule):
    """A timm ViT (``pretrained=False``) on ``(x, y)`` batches."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=8,
            patch_size=4,
            embed_dim=16,
            depth=1,
            num_heads=2,
            num_classes=3,
        )
        self.label_smoothing = label_smoothing

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        self.remember(batch, logits, loss)
        return loss


class BertClassifier(UserModule):
    """A Hugging Face BERT sequence classifier (from a config) on padded ``BatchEncoding`` batches."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.remember(batch, out.logits, out.loss)
        return out.loss


class EncoderClassifier(UserModule):
    """A hand-written ``nn.TransformerEncoder`` classifier on dataclass batches; returns ``{"loss": ...}``."""

    def __init__(self, penalty: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)
        self.penalty = penalty

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        tokens, y = (batch.tokens, batch.y) if isinstance(batch, TokenBatch) else batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, y) + self.penalty * self.head.weight.pow(2).sum()
        self.remember(batch, logits, loss)
        return {"loss": loss}


def gpt2_hand(logits: Tensor, batch: Any) -> Tensor:
    """Per-sample causal-LM loss by hand: token cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``,
    averaged per sample."""
    labels = batch["labels"] if isinstance(batch, Mapping) else batch[1]
    b = labels.shape[0]
    tokens = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    return tokens.view(b, -1).mean(1)


def classifier_hand(logits: Tensor, batch: Any) -> Tensor:
    if isinstance(batch, TokenBatch):
        labels = batch.y
    else:
        labels = batch["labels"] if isinstance(batch, Mapping) else batch[-1]
    return F.cross_entropy(logits, labels, reduction="none")


#: name -> (module, dataset, collate_fn, the batch type the module receives, the hand per-sample loss)
CASES: dict[str, tuple[Callable[[], UserModule], Callable[[], Dataset], Any, type, Callable]] = {
    "gpt2-list": (CharGPT2, CharBlocks, None, list, gpt2_hand),
    "gpt2-dict": (CharGPT2, CharBlocks, dict_collate, dict, gpt2_hand),
    "vit-tuple": (ViT, SmallImages, tuple_collate, tuple, classifier_hand),
    "bert-batchencoding": (BertClassifier, Sentences, padding_collate, BatchEncoding, classifier_hand),
    "encoder-dataclass": (EncoderClassifier, Tokens, dataclass_collate, TokenBatch, classifier_hand),
}


class Outputs(pl.Callback):
    """Per training batch: the epoch, the loss Lightning optimised, the per-sample losses InfoBatch used and the
    weights of the batch's samples."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
        index = batch_meta(trainer)["index"]
        self.rows.append(
            {
                "epoch": trainer.current_epoch,
                "loss": outputs["loss"],
                "per_sample": outputs["per_sample_loss"],
                "weights": cb.current_weights()[index],
            }
        )


def assert_same_batch(a: Any, b: Any) -> None:
    """Same structure (types included) and equal tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, Mapping):
        assert list(a) == list(b)
        for key in a:
            assert_same_batch(a[key], b[key])
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            assert_same_batch(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_batch(x, y)
    else:
        assert a == b


def fit(tmp_path, module: pl.LightningModule, data: pl.LightningDataModule, *callbacks, **kw) -> InfoBatchCallback:
    cb = next((c for c in callbacks if isinstance(c, InfoBatchCallback)), None)
    if cb is None:
        cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0)
        callbacks = (cb, *callbacks)
    pl.seed_everything(0)
    make_trainer(tmp_path, list(callbacks), max_epochs=EPOCHS, **kw).fit(module, datamodule=InfoBatchDataModule(data))
    return cb


# ----------------------------------------------------------------------------------- plain-loss modules train
@pytest.mark.parametrize("case", list(CASES))
def test_plain_loss_modules_train_with_infobatch(tmp_path, case):
    make_module, make_data, collate, batch_type, hand = CASES[case]
    pl.seed_everything(0)
    module, dataset, outputs = make_module(), make_data(), Outputs()
    cb = fit(tmp_path, module, UserData(dataset, collate), outputs)
    assert cb.per_sample_source == "auto"
    # pruned epochs have fewer steps: the plan's samples in batches of BS
    steps = [sum(r["epoch"] == e for r in outputs.rows) for e in range(EPOCHS)]
    sizes = [h["size"] for h in cb.history]
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"]
    assert steps == [math.ceil(size / BS) for size in sizes] and steps[1] < steps[0] == steps[2] == N // BS
    # training_step received exactly what the user's own collate function makes of the batch's samples
    assert len(module.steps) == len(outputs.rows) == sum(steps)
    for step in module.steps:
        assert type(step["batch"]) is batch_type
        assert_same_batch(step["batch"], (collate or default_collate)([dataset[int(i)] for i in step["index"]]))
    # the loss trained on is mean(w_i * l_i), l_i = F.cross_entropy(..., reduction="none") per sample, by hand
    for step, row in zip(module.steps, outputs.rows):
        per_sample = hand(step["logits"], step["batch"])
        torch.testing.assert_close(row["per_sample"], per_sample, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).mean(), rtol=1e-5, atol=1e-6)
        if row["epoch"] != 1:  # full epochs: unit weights, the user's own loss
            assert torch.equal(row["weights"], torch.ones_like(row["weights"]))
            torch.testing.assert_close(row["loss"], step["loss"], rtol=1e-5, atol=1e-6)
    pruned = [r for r in outputs.rows if r["epoch"] == 1]
    assert any(bool((r["weights"] == 2.0).any()) for r in pruned)  # kept well-learned samples weigh 1 / (1 - r)
    assert all(set(r["weights"].tolist()) <= {1.0, 2.0} for r in pruned)
    assert bool(cb.seen.all())  # every sample scored


class NoBatchIdx(CharGPT2):
    """``def training_step(self, batch)``: Lightning passes ``batch_idx`` only to a step that takes it."""

    def training_step(self, batch: Any) -> Tensor:  # type: ignore[override]
        return super().training_step(batch, -1)


def test_a_training_step_without_batch_idx_trains_with_infobatch(tmp_path):
    """InfoBatch's wrapper read as ``(batch, *args)``, so Lightning passed ``batch_idx`` to a step without it: a
    TypeError at the first batch (qa83-compat 04). Lightning now reads the user's own signature (``__wrapped__``);
    the pruned epoch trains on the weighted losses as with a two-argument step."""
    module, outputs = NoBatchIdx(), Outputs()
    cb = fit(tmp_path, module, UserData(CharBlocks()), outputs)
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"] and cb.per_sample_source == "auto"
    assert len(module.steps) == len(outputs.rows) == sum(math.ceil(h["size"] / BS) for h in cb.history)
    assert any(bool((r["weights"] == 2.0).any()) for r in outputs.rows if r["epoch"] == 1)
    assert "training_step" not in vars(module)  # the module's own step is back after the fit


class FetchesItsOwnBatches(CharGPT2):
    def training_step(self, dataloader_iter):  # type: ignore[override]
        batch = next(dataloader_iter)
        return super().training_step(batch, 0)


def test_a_training_step_that_fetches_its_own_batches_is_refused_at_setup(tmp_path):
    """Lightning hands a ``training_step(self, dataloader_iter)`` the loader's iterator, which InfoBatch's wrapper
    then read as the batch: it asked for the InfoBatchDataModule the fit had (qa84-break 02). Named at setup."""
    module = FetchesItsOwnBatches()
    with pytest.raises(ValueError, match=r"training_step\(self, dataloader_iter\) fetches its own batches"):
        fit(tmp_path, module, UserData(CharBlocks()))
    assert module.steps == [] and "training_step" not in vars(module)


def test_the_step_still_returns_per_sample_loss_path(tmp_path):
    """A module that returns ``{"loss", "per_sample_loss"}`` keeps its contract (no forward capture after the first
    batch)."""

    class Returns(EncoderClassifier):
        def training_step(self, batch, batch_idx):
            self.hooks.append(len(self._forward_hooks))  # the capture's hook on the module during the step
            per_sample = F.cross_entropy(self(batch.tokens), batch.y, reduction="none")
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample * 2}  # a score of the user's choice

    pl.seed_everything(0)
    outputs, module = Outputs(), Returns()
    module.hooks = []
    cb = fit(tmp_path, module, UserData(Tokens(), dataclass_collate), outputs)
    assert cb.per_sample_source == "returned"
    assert module.hooks == [1] + [0] * (len(outputs.rows) - 1) and not module._forward_hooks
    for row in outputs.rows:
        torch.testing.assert_close(row["loss"], (row["weights"] * row["per_sample"]).mean())


class MaskedTokens(Dataset):
    """A masked LM's samples as its collate leaves them: ``{"input_ids": int64[8], "labels": int64[8]}`` with the
    first ``i % 4`` positions of sample ``i`` labelled, the rest -100: the samples ``i % 4 == 0`` have no labelled
    token (a draw of DataCollatorForLanguageModeling that masked none of theirs)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randint(0, 32, (N, 8), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        labels = torch.full((8,), -100, dtype=torch.int64)
        labels[: i % 4] = self.x[i, : i % 4]
        return {"input_ids": self.x[i], "labels": labels}


class UserMaskedLM(UserModule):
    """Hugging Face's BertForMaskedLM from a config: its loss is the mean over the batch's labelled tokens."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16)  # fmt: skip
        self.model = BertForMaskedLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.remember(batch, out.logits, out.loss)
        return out.loss


def test_a_token_mean_loss_trains_automatically_and_a_sample_without_labels_is_not_scored(tmp_path):
    """A masked LM's loss (the mean over the batch's labelled tokens) was refused, asking for per_sample_loss=fn; and
    a sample whose draw labelled none of its tokens was scored 0, so pruned as well learned (10-16% of the samples of
    each epoch in a helper's MLM run, qa38-user 04). Now each sample's mean weighs by its labelled tokens (their mean
    is the module's loss), the scores are the samples' mean token losses, and a sample without a labelled token keeps
    its score (here: never scored, so never pruned as well learned)."""
    pl.seed_everything(0)
    module, outputs = UserMaskedLM(), Outputs()
    cb = fit(tmp_path, module, UserData(MaskedTokens()), outputs)
    assert cb.per_sample_source == "auto"
    for step, row in zip(module.steps, outputs.rows, strict=True):
        labels = step["batch"]["labels"]
        tokens = F.cross_entropy(step["logits"].flatten(0, 1), labels.flatten(), reduction="none").view(len(labels), -1)
        counts = (labels != -100).sum(1).float()
        per_sample = tokens.sum(1) * len(labels) / counts.sum()
        torch.testing.assert_close(row["per_sample"], per_sample, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).mean(), rtol=1e-5, atol=1e-6)
    unlabelled = torch.arange(N) % 4 == 0
    assert not cb.seen[unlabelled].any() and cb.seen[~unlabelled].all()
    assert bool((cb.score[~unlabelled] > 0).all())
    # the detected reduction is in the checkpoint: a resumed run trains the same one (it was detected again, and a
    # batch where both reductions gave the loss's value trained the other, qa40-break 04)
    state = cb.state_dict()
    assert state["token_mean"] is True and state["causal_shift"] is False
    from lightning_effi.infobatch.callback import validate_state

    validate_state(state, N)
    with pytest.raises(ValueError, match=r"the checkpoint's token_mean must be None \(not detected yet\) or a bool"):
        validate_state({**state, "token_mean": 1}, N)


def test_the_reduction_is_kept_from_the_first_batch_that_tells_and_ignored_class_labels_are_a_labelled_mean():
    """qa39-break 01: where the samples' means and the labelled-token mean give the same value (close per-sample
    losses near initialisation) the gradients still differ; the samples' means were taken by value on such batches,
    so a run flipped between reductions. Such a batch is undecided (trained as the labelled-token mean, the HF and
    torch default) and the first batch that tells them apart fixes the reduction. qa39-break 05: torch's
    F.cross_entropy over [B, C] logits with a -100 label is the mean over the labelled samples: reproduced, the
    unlabelled sample not scored (it stopped the fit, "not plain cross-entropy")."""
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.0, 0.2]], requires_grad=True)
    y = torch.tensor([0, -100, 2])
    found = ib.auto_losses(logits, (logits, y), F.cross_entropy(logits, y))
    each = F.cross_entropy(logits, y, reduction="none")
    assert found.token_mean is True and torch.allclose(found.per_sample, each * torch.tensor([1.5, 0.0, 1.5]))
    assert torch.isnan(found.scores[1]) and torch.allclose(found.scores[[0, 2]], each[[0, 2]])
    # equal counts: both reductions agree and train alike; undecided
    y = torch.tensor([0, 1, 2])
    same = ib.auto_losses(logits, (logits, y), F.cross_entropy(logits, y))
    assert same.token_mean is None and torch.allclose(same.per_sample, F.cross_entropy(logits, y, reduction="none"))
    # a run whose earlier batch gave the samples' means must go on with them
    y = torch.tensor([0, -100, 2])
    with pytest.raises(ValueError, match=r"this run's earlier batches gave the samples means"):
        ib.auto_losses(logits, (logits, y), F.cross_entropy(logits, y), token_mean=False)
    sample_mean = F.cross_entropy(logits, y, reduction="none").mean()
    assert ib.auto_losses(logits, (logits, y), sample_mean, token_mean=False).token_mean is False


def test_a_returned_per_sample_score_scores_the_samples(tmp_path):
    """``"per_sample_score"`` beside ``"per_sample_loss"``: the score table takes it (NaN: not scored); a score of
    another shape is refused naming the contract."""

    class Scores(EncoderClassifier):
        def __init__(self, shape_ok: bool = True) -> None:
            super().__init__()
            self.shape_ok = shape_ok

        def training_step(self, batch, batch_idx):
            per_sample = F.cross_entropy(self(batch.tokens), batch.y, reduction="none")
            index = batch_meta(self._trainer)["index"]
            score = torch.where(index % 2 == 0, index.float(), torch.full_like(per_sample, float("nan")))
            score = score if self.shape_ok else score[:1]
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "per_sample_score": score.detach()}

    cb = fit(tmp_path, Scores(), UserData(Tokens(), dataclass_collate))
    even = torch.arange(N) % 2 == 0
    assert cb.seen[even].all() and not cb.seen[~even].any()
    assert torch.equal(cb.score[even], torch.arange(N)[even].float())

    class ScoresBesidePlainLoss(EncoderClassifier):  # the automatic per-sample loss, the user's scores (qa39-break 02)
        def training_step(self, batch, batch_idx):
            index = batch_meta(self._trainer)["index"]
            loss = F.cross_entropy(self(batch.tokens), batch.y)
            return {"loss": loss, "per_sample_score": 1000.0 + index.float()}

    cb = fit(tmp_path / "auto", ScoresBesidePlainLoss(), UserData(Tokens(), dataclass_collate))
    assert cb.per_sample_source == "auto" and torch.equal(cb.score, 1000.0 + torch.arange(N).float())
    with pytest.raises(ValueError, match=r'"per_sample_score" must be a float tensor of shape \(4,\)'):
        fit(tmp_path / "bad", Scores(shape_ok=False), UserData(Tokens(), dataclass_collate))


# ------------------------------------------------------------------------------------------ per_sample_loss=fn
def smoothed(outputs: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The user's per-sample loss for a label-smoothed ViT: ``outputs`` is the module's forward output."""
    return F.cross_entropy(outputs, batch[1], reduction="none", label_smoothing=0.2)


def test_per_sample_loss_fn_trains_on_the_weighted_mean_of_fn(tmp_path):
    pl.seed_everything(0)
    module, outputs = ViT(label_smoothing=0.2), Outputs()
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875, per_sample_loss=smoothed)
    fit(tmp_path, module, UserData(SmallImages(), tuple_collate), cb, outputs)
    assert cb.per_sample_source == "fn" and "per_sample_loss=smoothed" in repr(cb)
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"] and cb.history[1]["size"] < N
    for step, row in zip(module.steps, outputs.rows, strict=True):
        per_sample = F.cross_entropy(step["logits"], step["batch"][1], reduction="none", label_smoothing=0.2)
        torch.testing.assert_close(row["per_sample"], per_sample)
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).mean())
        if row["epoch"] == 0:
            torch.testing.assert_close(row["loss"], step["loss"])  # fn's mean is the module's own loss


def test_a_fn_whose_mean_is_not_the_loss_warns(tmp_path):
    pl.seed_everything(0)
    plain = lambda outputs, batch: F.cross_entropy(outputs, batch.y, reduction="none")  # noqa: E731
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875, per_sample_loss=plain)
    with pytest.warns(UserWarning, match=r"mean of per_sample_loss=fn's values .* differs from the \"loss\""):
        fit(tmp_path, EncoderClassifier(penalty=1.0), UserData(Tokens(), dataclass_collate), cb)


def test_a_returned_per_sample_loss_whose_mean_is_not_the_loss_warns(tmp_path):
    """A step returning ``{"loss": ce.mean() + penalty, "per_sample_loss": ce}``: InfoBatch trains on the weighted
    mean of ``ce`` in place of the returned loss, so the penalty is not trained; said on the first batch, as for
    ``per_sample_loss=fn``."""

    class WithPenalty(EncoderClassifier):
        def training_step(self, batch, batch_idx):
            per_sample = F.cross_entropy(self(batch.tokens), batch.y, reduction="none")
            return {"loss": per_sample.mean() + self.head.weight.pow(2).sum(), "per_sample_loss": per_sample}

    pl.seed_everything(0)
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875)
    with pytest.warns(UserWarning, match=r'"per_sample_loss" training_step returned .* differs .* not trained'):
        fit(tmp_path, WithPenalty(), UserData(Tokens(), dataclass_collate), cb)
    assert cb.per_sample_source == "returned"


def test_a_token_mean_loss_beside_samples_means_is_told_as_a_reduction(tmp_path):
    """A step returning a token mean over the batch's labelled tokens as its loss and each sample's mean as
    "per_sample_loss" (a sequential recommender's positions): the warning blamed a regulariser that is not there
    (qa43-user 05); it names the unequal weighing and how to keep the token mean."""

    class TokenMean(CharGPT2):
        def training_step(self, batch, batch_idx):
            logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:].clone()
            labels[: len(labels) // 2, : labels.shape[1] // 2] = -100  # half the samples with half their tokens
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            counts = (labels != -100).sum(1)
            loss = per_token.sum() / counts.sum()
            return {"loss": loss, "per_sample_loss": per_token.sum(1) / counts}

    pl.seed_everything(0)
    with pytest.warns(UserWarning, match=r"differs .* or the loss weighs the samples unequally, e\.g\. a mean over"):
        fit(tmp_path, TokenMean(), UserData(CharBlocks(), dict_collate), InfoBatchCallback(prune_ratio=0.5))


def test_a_term_outside_the_per_sample_losses_that_is_zero_at_first_warns_once_it_grows(tmp_path):
    """A penalty ``|w - w0|_1`` (L2-SP's, in L1) is exactly 0 at the first batch and grows after the first step:
    the mismatch between ``mean(fn)`` and the step's loss is warned at the first batch where it appears, once."""

    class L2SP(EncoderClassifier):
        def on_fit_start(self) -> None:
            self.w0 = self.head.weight.detach().clone()

        def training_step(self, batch, batch_idx):
            ce = F.cross_entropy(self(batch.tokens), batch.y)
            return ce + (self.head.weight - self.w0).abs().sum()

    plain = lambda outputs, batch: F.cross_entropy(outputs, batch.y, reduction="none")  # noqa: E731
    pl.seed_everything(0)
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875, per_sample_loss=plain)
    steps = Steps()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, L2SP(), UserData(Tokens(), dataclass_collate), cb, steps)
    mismatch = [str(w.message) for w in caught if 'differs from the "loss"' in str(w.message)]
    assert len(mismatch) == 1 and steps.done > 2, mismatch


class Steps(pl.Callback):
    def __init__(self) -> None:
        self.done = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.done += 1


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda o, b: F.cross_entropy(o, b[1], reduction="none").detach(), r"has no grad .*float tensor of shape"),
        # the default reduction='mean' is named, not a packing collate, and fn is not told to pass fn (qa75-infobatch
        # 01)
        (
            lambda o, b: F.cross_entropy(o, b[1]),
            r"has shape \(\) for a batch of 4 samples \(one value: .*default reduction='mean'; compute it with "
            r"reduction='none'.*fn\(outputs, batch\) must return it$",
        ),
        # the batch's loss broadcast to its samples: scores by batch (qa75-infobatch, beside 01)
        (lambda o, b: F.cross_entropy(o, b[1]).expand(4), r"is one value broadcast to the batch's 4 samples"),
        # fewer values than samples: a packing collate's loss per row is named (qa51-llm 02); one value of shape (1,)
        # names the batch's reduction first, then a packing into one row (qa76-break 07)
        (lambda o, b: F.cross_entropy(o, b[1], reduction="none")[:2], r"\(2,\) .* samples \(fewer values .*packs"),
        (
            lambda o, b: F.cross_entropy(o, b[1]).reshape(1),
            r"\(1,\) for a batch of 4 samples \(one value: .*reduction='none'.*; or a collate that packs the samples "
            r"into one row",
        ),
        (lambda o, b: b[1], r"is a torch.int64 tensor; a per-sample loss is a float tensor of shape \(4,\)"),
        # a fresh tensor with requires_grad=True but no graph: the model would not train
        (lambda o, b: torch.rand(len(b[1]), requires_grad=True), r"is a leaf tensor .*no grad_fn.*shape \(4,\)"),
    ],
)
def test_bad_fn_outputs_fail_on_the_first_batch_naming_the_contract(tmp_path, fn, match):
    steps = Steps()
    with pytest.raises(ValueError, match="per_sample_loss=fn.*" + match):
        fit(tmp_path, ViT(), UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=fn), steps)
    assert steps.done == 0


def drop_class_0(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """A collate that filters samples (those of class 0), as users write one to skip bad data."""
    return tuple_collate([s for s in samples if int(s[1]) != 0])


def test_a_collate_that_drops_samples_is_refused_naming_it(tmp_path):
    """The batch held fewer rows than the samples InfoBatch drew; the error blamed the per-sample loss ("shape (5,)
    for a batch of 8 samples") and offered per_sample_loss=fn, which cannot help (qa32-break 06)."""
    steps = Steps()
    with pytest.raises(ValueError) as err:
        fit(tmp_path, ViT(), UserData(SmallImages(), drop_class_0), steps)
    message = str(err.value)
    assert (
        message.startswith("InfoBatchCallback: the training batch holds ")
        and f"rows for the {BS} samples InfoBatch drew" in message
    )
    assert "the loader's collate_fn (drop_class_0) returned another number of rows than the samples it was" in message
    assert "a collate must not leave samples out" in message and "per_sample_loss=fn" not in message
    assert "concatenated" not in message  # fewer rows: no pair
    assert steps.done == 0


def pair_collate(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Two views of each image stacked block by block, ``[2B, ...]`` (first views, then second views)."""
    x, y = tuple_collate(samples)
    return torch.cat([x, x.flip(-1)]), torch.cat([y, y])


def test_a_loss_per_row_of_a_two_rows_a_sample_batch_is_told_to_give_one_per_sample(tmp_path):
    """A collate that makes two rows of each drawn sample (a preference pair concatenated, [2B, T], or two views) with
    a loss per row: the refusal blamed the collate only, where the loss needed one value per drawn sample
    (qa113-distill 04). It says so, with the reduction; that loss trains."""
    with pytest.raises(ValueError) as err:
        fit(tmp_path, ViT(), UserData(SmallImages(), pair_collate))
    message = str(err.value)
    assert f"holds {2 * BS} rows for the {BS} samples InfoBatch drew" in message
    assert f"return one loss per drawn sample: {BS} values, e.g. per_sample.view(2, {BS}).mean(0)" in message

    class TwoViews(ViT):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
            x, y = batch
            per_row = F.cross_entropy(self(x), y, reduction="none")
            per_sample = per_row.view(2, -1).mean(0)
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample}

    cb = fit(tmp_path, TwoViews(), UserData(SmallImages(), pair_collate))
    assert cb.per_sample_source == "returned" and [h["kind"] for h in cb.history][:2] == ["full", "prune"]


def test_token_losses_from_fn_are_refused(tmp_path):
    """A ``[B, T]`` token-loss tensor (a common slip with language models) is not a per-sample loss."""

    def tokens(outputs, batch):
        logits, labels = outputs.logits[:, :-1], batch[1][:, 1:]
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [B, T - 1]

    with pytest.raises(ValueError, match=r"has shape \(4, 11\) for a batch of 4 samples"):
        fit(tmp_path, CharGPT2(), UserData(CharBlocks()), InfoBatchCallback(per_sample_loss=tokens))


def test_fn_and_a_returned_per_sample_loss_are_ambiguous(tmp_path):
    class Returns(ViT):
        def training_step(self, batch, batch_idx):
            per_sample = F.cross_entropy(self(batch[0]), batch[1], reduction="none")
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample}

    with pytest.raises(ValueError, match='returns "per_sample_loss" and per_sample_loss=fn is given'):
        fit(tmp_path, Returns(), UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=smoothed))


def test_a_returned_per_sample_loss_without_grad_is_refused(tmp_path):
    class Detached(ViT):
        def training_step(self, batch, batch_idx):
            per_sample = F.cross_entropy(self(batch[0]), batch[1], reduction="none")
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample.detach()}

    with pytest.raises(ValueError, match='"per_sample_loss" returned by training_step has no grad'):
        fit(tmp_path, Detached(), UserData(SmallImages(), tuple_collate))


def test_a_returned_leaf_per_sample_loss_is_refused(tmp_path):
    """``requires_grad=True`` alone is not "with grad": a leaf (no ``grad_fn``) carries no gradient to the model."""

    class Leaf(ViT):
        def training_step(self, batch, batch_idx):
            per_sample = F.cross_entropy(self(batch[0]), batch[1], reduction="none")
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample.detach().requires_grad_()}

    steps = Steps()
    with pytest.raises(ValueError, match=r'"per_sample_loss" returned by training_step is a leaf tensor'):
        fit(tmp_path, Leaf(), UserData(SmallImages(), tuple_collate), steps)
    assert steps.done == 0


def test_per_sample_loss_must_be_callable():
    with pytest.raises(ValueError, match="per_sample_loss must be a function fn"):
        InfoBatchCallback(per_sample_loss="cross_entropy")


# ------------------------------------------------------------------------------------------ the automatic path
def test_mismatched_loss_fails_on_the_first_batch_asking_for_fn(tmp_path):
    """A loss with an extra term (an L2 penalty) is not the plain cross-entropy of the logits: refused before any
    optimizer step, with the way out."""
    steps = Steps()
    with pytest.raises(ValueError, match=r"does not reproduce the loss training_step returned.*per_sample_loss=fn"):
        fit(tmp_path, EncoderClassifier(penalty=1.0), UserData(Tokens(), dataclass_collate), steps)
    assert steps.done == 0


def test_a_batch_without_labels_or_a_step_without_module_call_asks_for_fn(tmp_path):
    class Unlabelled(ViT):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self(x).logsumexp(-1).mean()

    bare = torch.utils.data.TensorDataset(SmallImages().x)  # samples (x,): list batches [x]
    with pytest.raises(ValueError, match=r"needs labels in the batch.*the batch is a list.*per_sample_loss=fn"):
        fit(tmp_path, Unlabelled(), UserData(bare))

    class NoCall(UserModule):  # computes its logits without calling a module
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3 * 8 * 8, 3))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(batch[0].flatten(1) @ self.w, batch[1])

    # no module called: fn would be given outputs=None, so the returned per-sample loss is asked for (qa113-peft 01)
    with pytest.raises(ValueError, match=r"returns a plain loss and called no module.*return \{\"loss\": \.\.\., "
                       r"\"per_sample_loss\": \.\.\.\} from training_step"):  # fmt: skip
        fit(tmp_path / "b", NoCall(), UserData(SmallImages(), tuple_collate))


class Split(UserModule):
    """Calls its parts from ``training_step`` (no ``forward``), then a criterion module and a torchmetrics metric."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 3)
        self.criterion = nn.CrossEntropyLoss()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.embed(x).mean(1)
        for layer in self.layers:
            h = torch.relu(layer(h))
        logits = self.head(h)
        loss = self.criterion(logits, y)
        self.accuracy(logits, y)
        self.remember(batch, logits, loss)
        return loss


def test_the_forward_output_is_the_last_outermost_module_call(tmp_path):
    """The head's output, not the criterion's nor the metric's; a call nested in another watched call (the
    encoder's layers inside ``self(x)``) is not recorded; the hooks are gone after the step."""
    module = Split()
    x, y = Tokens().x[:4], Tokens().y[:4]
    with ForwardCapture(module) as capture:
        out = module.training_step((x, y), 0)
    assert capture.captured and torch.equal(capture.output, module.steps[-1]["logits"])
    assert float(out.detach()) == float(F.cross_entropy(capture.output, y).detach())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    encoder = EncoderClassifier()
    with ForwardCapture(encoder) as capture:
        logits = encoder(x)
        encoder.embed(x)  # a later outermost call wins
    assert capture.output.shape == (4, 8, 16) and logits.shape == (4, 3)
    with ForwardCapture(encoder) as capture:
        encoder.training_step(TokenBatch(x, y), 0)
    assert torch.equal(capture.output, encoder.steps[-1]["logits"])  # self(x): its parts are nested
    # and through a Trainer: the automatic path finds the head's logits
    outputs = Outputs()
    cb = fit(tmp_path, Split(), UserData(Tokens()), outputs)
    assert cb.per_sample_source == "auto" and [h["kind"] for h in cb.history] == ["full", "prune", "full"]
    for row in outputs.rows:
        torch.testing.assert_close(row["loss"], (row["weights"] * row["per_sample"]).mean())


def test_find_logits_and_labels_in_every_structure():
    logits = torch.randn(2, 3)
    labels = torch.tensor([0, 2])
    assert ib.find_logits(logits) is logits
    assert ib.find_logits({"logits": logits, "loss": 0}) is logits
    assert ib.find_logits(CausalLMOutput(logits=logits)) is logits
    assert ib.find_logits(dataclasses.make_dataclass("Out", ["logits"])(logits)) is logits
    assert ib.find_logits((torch.tensor(0.0), logits)) is None and ib.find_logits({"scores": logits}) is None
    Pair = namedtuple("Pair", ["x", "target"])  # noqa: PYI024
    for batch in (
        (torch.randn(2, 5), labels),
        [torch.randn(2, 5), labels],
        {"x": torch.randn(2, 5), "labels": labels},
        {"label": labels},
        BatchEncoding({"input_ids": torch.ones(2, 4), "labels": labels}),
        TokenBatch(torch.ones(2, 4), labels),
        Pair(torch.randn(2, 5), labels),
    ):
        assert ib.find_labels(batch) is labels, type(batch)
    assert ib.find_labels(torch.randn(2, 5)) is None and ib.find_labels({"input_ids": labels}) is None
    assert ib.find_labels((labels,)) is None  # one element: no (x, y) pair


def test_per_sample_cross_entropy_equals_the_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(4, 5, generator=g), torch.tensor([0, 4, -100, 2])
    expected = torch.stack(
        [F.cross_entropy(logits[i : i + 1], labels[i : i + 1], ignore_index=-100, reduction="sum") for i in range(4)]
    )
    assert torch.allclose(ib.per_sample_cross_entropy(logits, labels), expected) and float(expected[2]) == 0.0
    probs = torch.softmax(torch.randn(4, 5, generator=g), -1)
    assert torch.allclose(
        ib.per_sample_cross_entropy(logits, probs), -(probs * logits.log_softmax(-1)).sum(-1)
    )  # soft labels
    # [B, T, V]: token losses averaged over each sample's non-ignored tokens, with and without the causal shift
    logits, labels = torch.randn(3, 6, 7, generator=g), torch.randint(0, 7, (3, 6), generator=g)
    labels[0, 3:] = -100
    labels[2, :] = -100  # no label at all: 0
    for shift in (False, True):
        lg, lb = (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)
        hand = []
        for i in range(3):
            keep = lb[i] != -100
            hand.append(F.cross_entropy(lg[i][keep], lb[i][keep]) if keep.any() else torch.tensor(0.0))
        assert torch.allclose(ib.per_sample_cross_entropy(logits, labels, shift=shift), torch.stack(hand))
    one = torch.randn(3, 1, 7, requires_grad=True)  # shifted one-token sequences: no labelled token, 0 per sample
    out = ib.per_sample_cross_entropy(one, torch.zeros(3, 1, dtype=torch.long), shift=True)
    assert out.tolist() == [0.0, 0.0, 0.0] and out.requires_grad
    with pytest.raises(ValueError, match=r"need integer labels \[B, T\]"):
        ib.per_sample_cross_entropy(logits, labels[:, :4])
    with pytest.raises(ValueError, match=r"logits must be \[B, C\] or \[B, T, V\]"):
        ib.per_sample_cross_entropy(torch.randn(4), labels)


def test_the_causal_shift_is_detected_and_a_mismatch_is_explained():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 32, (3, 10))
    out = model(input_ids=ids, labels=ids)
    per_sample, shift = ib.auto_per_sample_loss(out, {"input_ids": ids, "labels": ids}, out.loss)
    assert shift is True and torch.allclose(per_sample, gpt2_hand(out.logits, {"labels": ids}))
    aligned = F.cross_entropy(out.logits.transpose(1, 2), ids)  # a loss without the shift
    assert ib.auto_per_sample_loss(out.logits, (ids, ids), aligned)[1] is False
    # padding: HF's loss is the mean over the batch's tokens, not the mean of per-sample means (it was refused, and a
    # per_sample_loss=fn asked for): each sample's mean weighs by its labelled tokens, the scores are the means
    padded = ids.clone()
    padded[0, 4:] = -100
    padded[2, :] = -100  # no labelled token: not scored
    out = model(input_ids=ids, labels=padded)
    found = ib.auto_losses(out, {"labels": padded}, out.loss)
    shifted = padded[:, 1:]
    tokens = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), shifted.flatten(), reduction="none").view(3, -1)
    counts = (shifted != -100).sum(1).float()
    assert counts.tolist() == [3.0, 9.0, 0.0]  # labelled tokens after the shift
    means = tokens.sum(1) / counts.clamp(min=1)
    assert found.shift is True and found.token_mean is True
    assert torch.allclose(found.per_sample, means * counts * 3 / 12) and torch.allclose(
        found.per_sample.mean(), out.loss
    )
    assert torch.allclose(found.scores[:2], means[:2]) and torch.isnan(found.scores[2])
    with pytest.raises(ValueError, match=r"neither as the mean of the samples' means nor as the mean over the batch"):
        ib.auto_per_sample_loss(out, {"labels": padded}, out.loss * 1.01)
    with pytest.raises(ValueError, match=r"non-finite loss"):
        ib.auto_per_sample_loss(out, {"labels": ids}, torch.tensor(float("nan")))
    assert ib.loss_tolerance(torch.ones(1)) == 1e-4 and ib.loss_tolerance(torch.ones(1, dtype=torch.bfloat16)) > 0.03


def test_labels_outside_the_classes_are_refused_before_the_cross_entropy():
    """Labels outside ``[0, C)`` (other than -100) raise a ValueError naming the shapes and the label range, before
    ``F.cross_entropy`` (whose IndexError, or CUDA device-side assert, says nothing about ``per_sample_loss``)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1, generator=g)  # a binary classifier's single logit
    with pytest.raises(
        ValueError,
        match=r"range over \[0, 1\], outside the 1 class\(es\) \[0, 1\) of the logits "
        r"\(4, 1\) \(\[B, 1\] logits with 0/1 labels: a binary cross-entropy\?\)",
    ):
        ib.per_sample_cross_entropy(logits, torch.tensor([0, 1, 1, 0]))
    logits = torch.randn(4, 3, generator=g)
    with pytest.raises(ValueError, match=r"range over \[-1, 2\].*an ignore_index other than -100"):
        ib.per_sample_cross_entropy(logits, torch.tensor([0, -1, 2, 1]))
    with pytest.raises(ValueError, match=r"range over \[0, 3\], outside the 3 class"):
        ib.per_sample_cross_entropy(logits, torch.tensor([0, 3, 2, 1]))
    tokens = torch.randn(2, 5, 7, generator=g)
    with pytest.raises(ValueError, match=r"range over \[0, 7\], outside the 7 class\(es\) \[0, 7\) of the logits"):
        ib.per_sample_cross_entropy(tokens, torch.tensor([[1, 2, 3, 4, 7], [0, 0, 0, -100, -100]]), shift=True)
    # -100 is ignored, not out of range (the hand value is checked in the test above)
    assert float(ib.per_sample_cross_entropy(logits, torch.tensor([0, -100, 2, 1]))[1]) == 0.0
    y = torch.tensor([0, 1, 1, 0])
    bce = F.binary_cross_entropy_with_logits(logits[:, 0], y.float())
    with pytest.raises(ValueError, match=r"automatic per-sample loss does not apply: the labels .*per_sample_loss=fn"):
        ib.auto_per_sample_loss(logits[:, :1], (logits, y), bce)


class BinaryHead(EncoderClassifier):
    """One logit per sample and a binary cross-entropy loss on 0/1 labels."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, y = batch
        return F.binary_cross_entropy_with_logits(self(tokens).squeeze(1), (y > 0).float())


class IgnoresMinusOne(EncoderClassifier):
    """Cross-entropy with ``ignore_index=-1``: every fourth label is -1."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, y = batch
        return F.cross_entropy(self(tokens), y, ignore_index=-1)


class MinusOneLabels(Tokens):
    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i] if i % 4 else torch.tensor(-1)


@pytest.mark.parametrize(
    "module, dataset, match",
    [
        (BinaryHead, Tokens, r"outside the 1 class\(es\) \[0, 1\) of the logits \(4, 1\).*binary cross-entropy"),
        (IgnoresMinusOne, MinusOneLabels, r"range over \[-1, \d\], outside the 3 class.*ignore_index other than"),
    ],
)
def test_losses_over_other_labels_ask_for_fn_on_the_first_batch(tmp_path, module, dataset, match):
    steps = Steps()
    match = r"automatic per-sample loss does not apply: .*" + match + ".*per_sample_loss=fn"
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, module(), UserData(dataset(), tuple_collate), steps)
    assert steps.done == 0


def test_a_bfloat16_loss_is_refused_and_a_float16_one_checked_to_its_rounding():
    """A bfloat16 loss's rounding alone reaches ~1% of a plain cross-entropy, so a 1% auxiliary term cannot be told
    from it: the automatic path refuses a bfloat16 loss. A float16 loss is checked (relative tolerance 4 eps =
    3.9e-3): its plain cross-entropy passes, a 1% extra term does not."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(16, 5, generator=g), torch.randint(0, 5, (16,), generator=g)
    batch = (logits, y)
    bf16 = logits.bfloat16()
    with pytest.raises(ValueError, match=r"cannot check a torch.bfloat16 loss.*8 significant bits.*per_sample_loss=fn"):
        ib.auto_per_sample_loss(bf16, batch, F.cross_entropy(bf16, y))
    half = logits.half()
    ce = F.cross_entropy(half, y)
    per_sample, _ = ib.auto_per_sample_loss(half, batch, ce)
    assert per_sample.dtype == torch.float32
    torch.testing.assert_close(per_sample, F.cross_entropy(half.float(), y, reduction="none"))
    with pytest.raises(ValueError, match="does not reproduce the loss"):
        ib.auto_per_sample_loss(half, batch, ce + 0.01 * ce)


class ZLoss(EncoderClassifier):
    """Cross-entropy plus ``coef`` times a z-loss (the squared log-partition, an auxiliary term with its own
    gradient: about 1% of the loss at ``coef=0.01``), in the module's dtype or (``upcast``) in float32."""

    def __init__(self, coef: float, upcast: bool) -> None:
        super().__init__()
        self.coef, self.upcast = coef, upcast

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits = self(batch.tokens)
        logits = logits.float() if self.upcast else logits
        loss = F.cross_entropy(logits, batch.y) + self.coef * logits.logsumexp(-1).pow(2).mean()
        self.remember(batch, logits, loss)
        return loss


@pytest.mark.parametrize(
    "coef, upcast, match",
    [
        (0.01, False, r"cannot check a torch.bfloat16 loss"),  # accepted before (tolerance 3.1%): z-loss dropped
        (0.0, False, r"cannot check a torch.bfloat16 loss"),  # even a plain one: no check possible in bfloat16
        (0.01, True, r"does not reproduce the loss training_step returned"),  # the float32 check sees the 1%
        (0.0, True, None),  # a float32 loss of bfloat16 logits: checked to 1e-4, trains
    ],
)
def test_bf16_true_never_drops_an_auxiliary_term(tmp_path, coef, upcast, match):
    steps, outputs, module = Steps(), Outputs(), ZLoss(coef, upcast)
    kw = dict(precision="bf16-true")
    if match is not None:
        with pytest.raises(ValueError, match=match + ".*per_sample_loss=fn"):
            fit(tmp_path, module, UserData(Tokens(), dataclass_collate), steps, **kw)
        assert steps.done == 0
        return
    cb = fit(tmp_path, module, UserData(Tokens(), dataclass_collate), outputs, **kw)
    assert cb.per_sample_source == "auto" and [h["kind"] for h in cb.history] == ["full", "prune", "full"]
    for step, row in zip(module.steps, outputs.rows, strict=True):
        per_sample = F.cross_entropy(step["logits"], step["batch"].y, reduction="none")
        assert step["logits"].dtype == torch.float32 and torch.equal(row["per_sample"], per_sample)
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).mean())


# --------------------------------------------------------------------------------------- manual optimization
class ManualViT(ViT):
    def __init__(self, call_weighted: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.call_weighted = call_weighted

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        logits = self(x)
        per_sample = F.cross_entropy(logits, y, reduction="none")
        loss = per_sample.mean()
        for _ in range(self.call_weighted):
            loss = weighted_loss(self, per_sample)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.remember(batch, logits, loss)
        return loss


class ManualRows(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
        self.rows.append(
            {"epoch": trainer.current_epoch, "weights": cb.current_weights()[batch_meta(trainer)["index"]]}
        )


def test_manual_optimization_trains_through_weighted_loss(tmp_path):
    pl.seed_everything(0)
    module, rows = ManualViT(), ManualRows()
    cb = fit(tmp_path, module, UserData(SmallImages(), tuple_collate), rows)
    assert cb.per_sample_source == "manual" and bool(cb.seen.all())
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"] and cb.history[1]["size"] < N
    steps = [sum(r["epoch"] == e for r in rows.rows) for e in range(EPOCHS)]
    assert steps[1] < steps[0] and cb.steps_in_epoch == steps[2]  # the optimizer steps are counted
    for step, row in zip(module.steps, rows.rows, strict=True):
        per_sample = F.cross_entropy(step["logits"], step["batch"][1], reduction="none")
        torch.testing.assert_close(step["loss"], (row["weights"] * per_sample).mean())
    assert any(bool((r["weights"] == 2.0).any()) for r in rows.rows)


def test_manual_optimization_passes_its_scores_through_weighted_loss(tmp_path):
    """weighted_loss(self, per_sample, per_sample_score): the scores in place of the losses, NaN not scored (manual
    optimization had no way to leave a sample unscored, qa39-break note)."""

    class ManualScores(ManualViT):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            per_sample = F.cross_entropy(self(x), y, reduction="none")
            index = batch_meta(self._trainer)["index"]
            score = torch.where(index % 2 == 0, index.float(), torch.full_like(per_sample, float("nan")))
            loss = weighted_loss(self, per_sample, score)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    cb = fit(tmp_path, ManualScores(), UserData(SmallImages(), tuple_collate))
    even = torch.arange(N) % 2 == 0
    assert cb.seen[even].all() and not cb.seen[~even].any()
    assert torch.equal(cb.score[even], torch.arange(N)[even].float())


class TwoOptimizerViT(ViT):
    """Manual optimization with two optimizers stepped once a batch: global_step advances 2 a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Parameter(torch.ones(3))

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = weighted_loss(self, F.cross_entropy(self(x), y, reduction="none")) + self.other.square().sum()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.model.parameters(), lr=0.01), torch.optim.SGD([self.other], lr=0.01)]


class EpochEnds(pl.Callback):
    """InfoBatch's progress clock and the batches trained, at each epoch's end."""

    def __init__(self) -> None:
        self.progress: list[float] = []
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def on_train_epoch_end(self, trainer, pl_module):
        ib = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
        self.progress.append(ib.effi_progress_done())


def test_two_optimizers_a_batch_count_one_step_of_infobatchs_progress(tmp_path):
    """With two optimizers stepped once a batch, InfoBatch counted each optimizer.step() in its progress clock (0.722
    after the first of 3 epochs, 1.0 after the second, in the helper's run). A batch now counts one step."""
    module, ends = TwoOptimizerViT(), EpochEnds()
    cb = fit(tmp_path, module, UserData(SmallImages(), tuple_collate), ends)
    assert module.trainer.global_step == 2 * ends.batches and cb.history[1]["kind"] == "prune"
    assert ends.progress == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_weighted_loss_without_infobatch_is_the_plain_mean(tmp_path):
    pl.seed_everything(0)
    module = ManualViT()
    make_trainer(tmp_path, max_epochs=1).fit(module, datamodule=UserData(SmallImages(), tuple_collate))
    assert len(module.steps) == N // BS
    for step in module.steps:
        per_sample = F.cross_entropy(step["logits"], step["batch"][1], reduction="none")
        torch.testing.assert_close(step["loss"], per_sample.mean())


@pytest.mark.parametrize(
    "calls, match",
    [(0, "calls manual_backward before weighted_loss"), (2, "called twice in one training_step")],
)
def test_manual_optimization_must_call_weighted_loss_once(tmp_path, calls, match):
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, ManualViT(call_weighted=calls), UserData(SmallImages(), tuple_collate))


def test_manual_optimization_refuses_fn_at_setup_and_a_step_that_never_weights(tmp_path):
    with pytest.raises(ValueError, match="per_sample_loss=fn does not apply with manual optimization"):
        fit(tmp_path, ManualViT(), UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=smoothed))

    class Idle(ManualViT):  # neither weights nor backpropagates
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(ValueError, match="this step did not call it"):
        fit(tmp_path / "b", Idle(), UserData(SmallImages(), tuple_collate))
    with pytest.raises(RuntimeError, match="call it inside training_step"):
        InfoBatchCallback().weighted_loss(torch.ones(2, requires_grad=True))


# ---------------------------------------------------------------------------------- with the curriculum, tuples
def first_value(batch: Any) -> Tensor:
    """The curriculum's difficulty: a sample's first token, read from a ``(tokens, y)`` tuple batch."""
    return batch[0][:, 0].long()


CL_METRICS = {
    "first": dict(
        difficulty_type="value",
        clustering_type="schedule_based",
        analysis=first_value,
        min_difficulty=16,
        max_difficulty=63,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=10, difficulty_step=1),
    )
}


class ThinRows(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        meta = batch_meta(trainer)
        self.rows.append(
            {
                "loss": outputs["loss"],
                "weights": meta["infobatch_weight"],
                "candidates": meta["infobatch_candidates"],
                "difficulty": meta["cl_difficulty"]["first"],
            }
        )


def test_infobatch_thins_inside_the_curriculum_on_tuple_batches(tmp_path):
    """Tuple batches ``(tokens, y)`` from ``default_collate`` (a list), a value-based difficulty read from the
    tuple; 24 samples in micro-batches of 4: steps 1-6 are data epoch 0 (never thinned), thinning until step
    floor(0.75 * 16) = 12."""
    pl.seed_everything(0)
    module, rows, dataset = EncoderClassifier(), ThinRows(), Tokens()
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=1)
    trainer = make_trainer(tmp_path, [cb, Curriculum(metrics=CL_METRICS, seed=3), rows], max_steps=16, max_epochs=-1)
    trainer.fit(module, datamodule=CurriculumDataModule(UserData(dataset)))
    assert cb.per_sample_source == "auto" and trainer.global_step == 16 and cb.thin_stop() == 12
    kept = [len(s["index"]) for s in module.steps]
    assert kept[:6] == [BS] * 6 and kept[12:] == [BS] * 4 and sum(kept[6:12]) < BS * 6 and min(kept) >= 1
    for step, row in zip(module.steps, rows.rows, strict=True):
        batch = step["batch"]
        assert type(batch) is list  # the user's batch, as default_collate makes it
        assert_same_batch(batch, default_collate([dataset[int(i)] for i in step["index"]]))
        assert all(int(t) <= row["difficulty"] for t in batch[0][:, 0])  # eligible at the batch's difficulty
        per_sample = F.cross_entropy(step["logits"], batch[1], reduction="none")
        assert row["candidates"] == BS
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).sum() / BS)  # thinned_loss


# ------------------------------------------------------------------------------- frozen teachers, EMA copies
class Distill(UserModule):
    """A trainable student and a frozen teacher (``requires_grad_(False)``) in one module; the teacher is called
    before (``order="ts"``) or after (``"st"``) the student, for a logged agreement; the loss is the student's
    cross-entropy. An ``nn.Dropout`` (no parameter) is applied to the teacher's logits last."""

    def __init__(self, order: str = "st", frozen: bool = True) -> None:
        super().__init__()
        self.order, self.frozen = order, frozen
        self.student = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))
        self.teacher = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3)).requires_grad_(not frozen)
        self.dropout = nn.Dropout(0.1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # not frozen: left out of the optimizer (and called under no_grad), as many distillation recipes do
        return torch.optim.SGD(self.parameters() if self.frozen else self.student.parameters(), lr=0.1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.order == "ts":
            with torch.no_grad():
                teacher = self.dropout(self.teacher(x))
        logits = self.student(x)
        if self.order == "st":
            with torch.no_grad():
                teacher = self.dropout(self.teacher(x))
        self.agreement = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
        loss = F.cross_entropy(logits, y)
        self.remember(batch, logits, loss)
        return loss


def student_loss(outputs: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(outputs, batch[1], reduction="none")


def test_the_capture_skips_modules_without_a_trainable_parameter():
    """A frozen teacher (and a parameterless dropout) called after the student: the student's logits are captured,
    named by their attribute path; unfreezing the teacher between steps makes it watched again."""
    module = Distill("st")
    x, y = SmallImages().x[:4], SmallImages().y[:4]
    with ForwardCapture(module) as capture:
        module.training_step((x, y), 0)
    assert capture.captured and torch.equal(capture.output, module.steps[-1]["logits"])
    assert capture.output.requires_grad and capture.source == "self.student (Sequential)"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    module.teacher.requires_grad_(True)
    with ForwardCapture(module) as capture:
        module.training_step((x, y), 0)
    assert capture.source == "self.teacher (Sequential)" and not capture.output.requires_grad
    with ForwardCapture(ViT()) as capture:
        capture.module(x)
    assert capture.source == "self (ViT)"


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "out_of_the_optimizer"])
@pytest.mark.parametrize("fn", [None, student_loss], ids=["auto", "fn"])
@pytest.mark.parametrize("order", ["ts", "st"])
def test_a_frozen_teacher_called_before_or_after_the_student(tmp_path, order, fn, frozen):
    """The per-sample loss is the student's, whichever order (before the fix, ``order="st"`` took the teacher's
    output: "has no grad" with fn, a mismatch on the automatic path); also for a teacher that is not frozen but no
    optimizer holds (its logits were taken and the fit refused as "not plain cross-entropy", qa42-user 03)."""
    pl.seed_everything(0)
    module, outputs = Distill(order, frozen), Outputs()
    teacher = copy_state(module.teacher)
    cb = fit(tmp_path, module, UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=fn), outputs)
    assert cb.per_sample_source == ("auto" if fn is None else "fn")
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"] and cb.history[1]["size"] < N
    for step, row in zip(module.steps, outputs.rows, strict=True):
        per_sample = F.cross_entropy(step["logits"], step["batch"][1], reduction="none")
        torch.testing.assert_close(row["per_sample"], per_sample)
        torch.testing.assert_close(row["loss"], (row["weights"] * per_sample).mean())
    assert all(torch.equal(v, module.teacher.state_dict()[k]) for k, v in teacher.items())  # still frozen


class PromptTuned(UserModule):
    """Prompt tuning / model reprogramming: a frozen network fed its input plus one trained tensor, called directly in
    ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3)).requires_grad_(False)
        self.prompt = nn.Parameter(torch.zeros(3, 8, 8))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x + self.prompt)
        loss = F.cross_entropy(logits, y)
        self.remember(batch, logits, loss)
        return loss


@pytest.mark.parametrize("fn", [None, student_loss], ids=["auto", "fn"])
def test_a_frozen_network_fed_a_trained_prompt_gives_the_forward_output(tmp_path, fn):
    """A frozen network whose input carries the gradient (a trained prompt) was skipped as a frozen teacher: the
    automatic loss was refused, and ``per_sample_loss=fn`` was handed ``outputs=None`` (qa113-peft 01). Its output
    is taken when no module with trained parameters was called, so both train on the step's own loss; a frozen
    teacher under no_grad beside a trained student is still passed over."""
    pl.seed_everything(0)
    module, outputs = PromptTuned(), Outputs()
    cb = fit(tmp_path, module, UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=fn), outputs)
    assert cb.per_sample_source == ("auto" if fn is None else "fn")
    for step, row in zip(module.steps, outputs.rows, strict=True):
        per_sample = F.cross_entropy(step["logits"], step["batch"][1], reduction="none")
        torch.testing.assert_close(row["per_sample"], per_sample)
    x, y = SmallImages().x[:4], SmallImages().y[:4]
    student = Distill("st")
    with ForwardCapture(student) as capture:
        student.training_step((x, y), 0)
    assert capture.source == "self.student (Sequential)"


def copy_state(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "module, source", [(ViT, r"self \(ViT\)"), (lambda: Distill("st"), r"self\.student \(Sequential\)")]
)
def test_a_per_sample_loss_without_grad_names_the_module_whose_output_was_used(tmp_path, module, source):
    detached = lambda outputs, batch: student_loss(outputs.detach(), batch)  # noqa: E731
    with pytest.raises(ValueError, match=r"per_sample_loss=fn has no grad .*the output of " + source):
        fit(tmp_path, module(), UserData(SmallImages(), tuple_collate), InfoBatchCallback(per_sample_loss=detached))


# ------------------------------------------------------------------------------ checkpoints: evaluation, resume
class EvalViT(ViT):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])


class EvalData(UserData):
    """``UserData`` on ``SmallImages`` with validation / test / predict loaders (in order)."""

    def __init__(self) -> None:
        super().__init__(SmallImages(), tuple_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=8, collate_fn=tuple_collate)

    test_dataloader = predict_dataloader = val_dataloader


def same(a: Any, b: Any) -> bool:
    """Equal nested states: tensors equal, NaN equal to NaN (an epoch's threshold without well-learned samples)."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def evaluate(trainer: pl.Trainer, fn: str, path: Any, module: pl.LightningModule | None = None) -> Any:
    """``trainer.<fn>(module, datamodule=InfoBatchDataModule(EvalData()), ckpt_path=path)``: the logged loss, or
    the logits."""
    module = module or EvalViT()
    datamodule = InfoBatchDataModule(EvalData())
    if fn == "predict":
        return torch.cat(trainer.predict(module, datamodule=datamodule, ckpt_path=path))
    out = getattr(trainer, fn)(module, datamodule=datamodule, ckpt_path=path, verbose=False)
    return out[0]["test_loss" if fn == "test" else "val_loss"]


@pytest.fixture(scope="module")
def infobatch_run(tmp_path_factory):
    """A 3-epoch InfoBatch fit with a checkpoint after every epoch: its Trainer, module, callback and root."""
    root = tmp_path_factory.mktemp("ib_ckpt")
    ckpt = ModelCheckpoint(dirpath=root / "ckpts", save_top_k=-1, filename="{epoch}")
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0)
    pl.seed_everything(0)
    module = EvalViT()
    trainer = make_trainer(root, [cb, ckpt], max_epochs=EPOCHS, limit_val_batches=1.0)
    trainer.fit(module, datamodule=InfoBatchDataModule(EvalData()))
    return trainer, module, cb, root


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_evaluating_a_checkpoint_with_infobatch_in_the_trainer(tmp_path, infobatch_run, fn):
    """``trainer.validate/test/predict(ckpt_path=...)`` with InfoBatch in the Trainer (a new Trainer with the same
    callback, one with other InfoBatch settings, the fit's own Trainer) gives exactly what a Trainer without it
    gives; the fit's callback state is untouched. Before the fix: "written with other settings (checkpoint, now):
    {'dataset_size': (24, 0), 'num_epochs': (3, 0)}"."""
    trainer, module, cb, root = infobatch_run
    path = root / "ckpts" / "epoch=1.ckpt"  # mid-run: the score table and plan of a pruned epoch
    state = torch.load(path, weights_only=True)["callbacks"][cb.state_key]
    assert state["config"]["dataset_size"] == N and state["config"]["num_epochs"] == EPOCHS
    before = copy.deepcopy(cb.state_dict())
    reference = evaluate(make_trainer(tmp_path / "plain", [], limit_val_batches=1.0), fn, path)
    results = [
        evaluate(
            make_trainer(
                tmp_path / "new", [InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0)], limit_val_batches=1.0
            ),
            fn,
            path,
        ),
        evaluate(
            make_trainer(tmp_path / "other", [InfoBatchCallback(prune_ratio=0.3)], limit_val_batches=1.0), fn, path
        ),
        evaluate(trainer, fn, path, module),
    ]
    for got in results:
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(reference))
    assert same(cb.state_dict(), before)
    assert cb.history[-1]["epoch"] == EPOCHS - 1 and not cb._evaluating


def test_infobatch_added_on_resume_or_to_a_trained_trainer_is_refused(tmp_path):
    """A fit resumed from a checkpoint written without InfoBatch, with InfoBatch added: its score table would start
    empty part-way through, its epochs counted from epoch 0, and the record read as pruned from the start. Refused
    at train start, before a batch, as random-LTD and the V-cycle refuse it."""
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "plain", filename="last")
    plain = make_trainer(tmp_path, [ckpt], max_epochs=1)
    plain.fit(EvalViT(), datamodule=EvalData())
    module, cb = EvalViT(), InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0)
    trainer = make_trainer(tmp_path, [cb], max_epochs=EPOCHS)
    with pytest.raises(ValueError, match=r"InfoBatchCallback: added on resume at step \d+, from a checkpoint without"):
        trainer.fit(module, datamodule=InfoBatchDataModule(EvalData()), ckpt_path=tmp_path / "plain" / "last.ckpt")
    assert trainer.global_step > 0 and not cb.seen.any()  # stopped before any batch was scored


def test_a_resumed_fit_still_refuses_other_settings(tmp_path, infobatch_run):
    """``fit(ckpt_path=...)`` keeps its checks: another run length (same state key) that would anneal the
    checkpoint's pruned epoch and other identity arguments (another state key) are refused; the same settings
    resume."""
    _, _, cb, root = infobatch_run
    path = root / "ckpts" / "epoch=0.ckpt"

    def resume(callback: InfoBatchCallback, epochs: int = EPOCHS, at: Path = path) -> pl.Trainer:
        trainer = make_trainer(tmp_path, [callback], max_epochs=epochs)
        trainer.fit(EvalViT(), datamodule=InfoBatchDataModule(EvalData()), ckpt_path=at)
        return trainer

    # epoch 1 prunes in the 3-epoch run (annealing from 2); a 2-epoch run anneals from floor(0.875 * 2) = 1
    with pytest.raises(ValueError, match=r"other settings \(checkpoint, now\): \{'num_epochs': \(3, 2\)\}"):
        resume(InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0), epochs=2, at=root / "ckpts" / "epoch=1.ckpt")
    with pytest.raises(ValueError, match=r"written with other settings \(InfoBatchCallback\{") as err:
        resume(InfoBatchCallback(prune_ratio=0.3, delta=0.875, seed=0))
    assert str(err.value).endswith("pass strict=False to resume its scores and plan with this configuration")
    resumed = InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=0)
    assert resume(resumed).current_epoch == EPOCHS
    assert same(resumed.history, cb.history) and torch.equal(resumed.score, cb.score)
    # strict=False does what the message says: the other settings' scores and plan are resumed (it refused before,
    # as if the checkpoint had no InfoBatch state), and the next epochs prune at the new ratio
    lenient = InfoBatchCallback(prune_ratio=0.3, delta=0.875, seed=0, strict=False)
    with pytest.warns(UserWarning, match=r"other settings \(checkpoint, now\): \{'prune_ratio': \(0\.5, 0\.3\)\}"):
        assert resume(lenient).current_epoch == EPOCHS
    assert same(lenient.history[:1], cb.history[:1]) and lenient.history[1]["kind"] == cb.history[1]["kind"] == "prune"
    assert 0 < lenient.history[1]["saved"] < cb.history[1]["saved"]  # 0.3 of the well-learned, not 0.5


def test_the_automatic_loss_names_where_it_took_the_labels():
    """A (x, y, index) batch: the automatic loss takes the last tuple element as labels (documented), and its
    errors did not say so ("labels range over [2, 63]" or "your loss is not plain cross-entropy", while the user's
    loss was exactly F.cross_entropy(self(x), y)); both now name the element."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(4, 3, generator=g), torch.tensor([0, 2, 1, 1])
    index = torch.tensor([7, 8, 9, 10])
    with pytest.raises(ValueError, match=r"labels from batch\[2\] \(the last element of the tuple batch\)"):
        ib.auto_per_sample_loss(logits, (logits, y, index), F.cross_entropy(logits, y))
    small = torch.tensor([0, 1, 2, 0])  # in range, but not the labels the loss used
    with pytest.raises(ValueError) as err:
        ib.auto_per_sample_loss(logits, (logits, y, small), F.cross_entropy(logits, y))
    assert "against labels (4,) from batch[2] (the last element of the tuple batch)" in str(err.value)
    assert "a tuple batch's labels are taken from its last element" in str(err.value)
    assert ib.labels_source({"labels": y}) == "batch['labels']" and ib.labels_source(torch.zeros(2)) == ""


def cutmix_collate(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """MixUp in the collate function, as torchvision's v2.MixUp does it: each row mixed with the previous one,
    class-probability targets."""
    x, y = tuple_collate(samples)
    soft = F.one_hot(y, 3).float()
    return 0.7 * x + 0.3 * x.roll(1, 0), 0.7 * soft + 0.3 * soft.roll(1, 0)


def test_targets_mixed_in_the_collate_warn_that_the_rescaling_is_not_unbiased(tmp_path):
    """CutMix / MixUp in the collate was accepted without a word, while a mixed row carries its partners' content
    and the rescaling is no longer unbiased (qa37-user 04: 0.89-0.94 of the full-data weight for the well-learned
    samples)."""
    with pytest.warns(UserWarning, match=r"targets are class probabilities \(4, 3\) \(CutMix / MixUp in the collate"):
        cb = fit(tmp_path, ViT(), UserData(SmallImages(), cutmix_collate))
    assert cb.per_sample_source == "auto"


def test_an_odd_batch_error_of_timm_mixup_gets_a_note(tmp_path):
    """timm's Mixup wants even batches; a pruned epoch's last batch can be odd (qa37-user 06)."""

    class EvenOnly(ViT):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            assert batch[0].shape[0] % 2 == 0, "Batch size should be even when using this"
            return super().training_step(batch, batch_idx)

    with pytest.raises(AssertionError) as caught:
        fit(tmp_path, EvenOnly(), UserData(SmallImages(), batch_size=6))
    assert any("set drop_last=True" in note for note in getattr(caught.value, "__notes__", []))


# ------------------------------------------------------------------------------------- dense prediction (qa44-user)
class WithAuxHead(UserModule):
    """A main head and an auxiliary head (deep supervision), the auxiliary one called last."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16))
        self.head, self.aux_head = nn.Linear(16, 3), nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        features = self.backbone(x)
        return F.cross_entropy(self.head(features), y) + 0.4 * F.cross_entropy(self.aux_head(features), y)


def test_a_fn_given_an_auxiliary_heads_output_names_it(tmp_path):
    """per_sample_loss=fn gets the output of the last module called, here the auxiliary head: InfoBatch then trained
    the auxiliary loss alone, and the warning blamed a term left out (qa44-user 01). It names the module fn got and
    the others the step called."""
    pl.seed_everything(0)
    with pytest.warns(UserWarning, match=r"fn received the output of self\.aux_head \(Linear\).*also called self\.ba"):
        data = UserData(SmallImages(), tuple_collate)
        fit(tmp_path, WithAuxHead(), data, InfoBatchCallback(per_sample_loss=student_loss))

    def upsampling(outputs: Tensor, batch: Any) -> Tensor:
        raise RuntimeError("size mismatch")

    with pytest.raises(RuntimeError, match="size mismatch") as raised:
        fit(tmp_path, WithAuxHead(), data, InfoBatchCallback(per_sample_loss=upsampling))
    assert "fn received the output of self.aux_head" in "".join(getattr(raised.value, "__notes__", []))


def test_a_per_sample_loss_of_nothing_beside_a_finite_loss_is_refused_naming_it(tmp_path):
    """An image whose pixels are all ignore_index: its mean loss is 0 / 0 while the step's loss is finite; the fit
    stopped with the non-finite loss error's advice to lower the learning rate (qa44-user 05)."""

    class Ignored(ViT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            y = y.clone()
            y[0] = -100  # the first sample has nothing to learn from
            per_sample = F.cross_entropy(self(x), y, reduction="none", ignore_index=-100) / (y != -100)
            return {"loss": per_sample[y != -100].mean(), "per_sample_loss": per_sample}

    pl.seed_everything(0)
    from lightning_effi.core.nonfinite import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"returned by training_step is not finite for rows \[0\] of the"):
        fit(tmp_path, Ignored(), UserData(SmallImages(), tuple_collate))


def sort_by_label(samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """A collate that sorts the samples (by label here; by length for pack_padded_sequence in an RNN's recipe)."""
    return tuple_collate(sorted(samples, key=lambda s: int(s[1])))


def test_a_collate_that_reorders_the_samples_is_refused_naming_it(tmp_path):
    """The rows no longer followed the order of the indices InfoBatch drew: 20 of 24 scores were another sample's
    loss, and the 1/(1-r) weights went to other rows, in silence (qa45-break 01)."""
    steps = Steps()
    with pytest.raises(DataConfigError) as err:
        fit(tmp_path, ViT(), UserData(SmallImages(), sort_by_label), steps)
    assert "collate_fn (sort_by_label) puts the samples of a batch in another order" in str(err.value)
    assert "enforce_sorted=False" in str(err.value) and steps.done == 0


class _ValidatesWithItsTrainingStep(pl.LightningModule):
    """A user's module whose ``validation_step`` reuses its ``training_step`` (a common pattern), with a plain loss."""

    reuse = True

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(30, 8), nn.Linear(8, 3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, labels = batch
        return F.cross_entropy(self.head(self.embed(ids).mean(1)), labels)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        step = self.training_step if self.reuse else type(self).training_step.__get__(self)
        self.log("val_loss", step(batch, batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _ClassifierData(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 30, (40, 6), generator=g)
        self.data = torch.utils.data.TensorDataset(ids, ids[:, 0] % 3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


@pytest.mark.parametrize("val_check_interval", [3, 1.0])
def test_a_validation_step_that_reuses_the_training_step_leaves_infobatch_alone(tmp_path: Path, val_check_interval):
    """Validation (and the sanity check) through the module's ``training_step`` is not a training step: InfoBatch's
    scores and plans equal those of the same module validating with the class's own step. Validation's losses became
    the last training batch's samples' scores (other plans), or the fit failed blaming the collate_fn or asking for
    the InfoBatchDataModule it had (qa86-break 10)."""
    results = []
    for reuse in (False, True):
        pl.seed_everything(0)
        model = _ValidatesWithItsTrainingStep()
        model.reuse = reuse
        cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7)
        trainer = make_trainer(
            tmp_path / str(reuse),
            [cb],
            max_epochs=3,
            limit_val_batches=1,
            num_sanity_val_steps=1,
            val_check_interval=val_check_interval,
        )
        trainer.fit(model, datamodule=InfoBatchDataModule(_ClassifierData()))
        results.append((cb.score.clone(), [(h["size"], h["saved"]) for h in cb.history], trainer.callback_metrics))
    (score_a, plans_a, metrics_a), (score_b, plans_b, metrics_b) = results
    assert torch.equal(score_a, score_b) and plans_a == plans_b and plans_a[1][1] > 0
    assert metrics_a["val_loss"] == metrics_b["val_loss"]


class _ManualAccumulation(pl.LightningModule):
    """Manual optimization accumulating 2 batches per optimizer step (Lightning's documented pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.emb, self.out = nn.Embedding(64, 16), nn.Linear(16, 64)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        x = batch["input_ids"]
        per_sample = F.cross_entropy(self.out(self.emb(x[:, :-1])).transpose(1, 2), x[:, 1:], reduction="none")
        loss = weighted_loss(self, per_sample.mean(1))
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0 or self.trainer.is_last_batch:
            self.optimizers().step()
            self.optimizers().zero_grad()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_accumulation_counts_every_batch_in_the_progress_and_the_saving(tmp_path: Path):
    """Under manual optimization a batch counts one step of the progress, also one that steps no optimizer: the
    progress is ``n / E`` at the end of epoch ``n - 1`` and 1 at the end of the run (it counted the stepping
    batches only and ended at 0.90, and the saved fraction at 0.1389 for the monitor's 0.125, qa86-break 09)."""
    from lightning_effi.callbacks import EfficiencyMonitor
    from tests.helpers.tiny import TinyDataModule, TokenBlocks

    class EpochProgress(pl.Callback):
        def __init__(self) -> None:
            self.done: list[float] = []

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.done.append(cb.effi_progress_done())

    pl.seed_everything(0)
    cb, monitor, log = (
        InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7),
        EfficiencyMonitor(print_summary=False),
        EpochProgress(),
    )
    data = InfoBatchDataModule(TinyDataModule(TokenBlocks(n=40), batch_size=8))
    make_trainer(tmp_path, [monitor, cb, log], max_epochs=4).fit(_ManualAccumulation(), datamodule=data)
    assert log.done == [0.25, 0.5, 0.75, 1.0]
    saved = sum(h["saved"] for h in cb.history)
    assert saved > 0 and cb.totals()["saved_fraction"] == saved / 160
    assert monitor.summary["saved/infobatch/samples_frac"] == pytest.approx(saved / 160)


class SignedLoss(ViT):
    """A per-sample loss of either sign (a policy-gradient loss's shape: -advantage x log-prob), with or without a
    per-sample score beside it."""

    def __init__(self, score: bool) -> None:
        super().__init__()
        self.score = score

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        nll = F.cross_entropy(self(x), y, reduction="none")
        advantage = torch.linspace(-1.0, 1.0, len(y))
        out = {"loss": (advantage * nll).mean(), "per_sample_loss": advantage * nll}
        return out | ({"per_sample_score": nll.detach()} if self.score else {})


@pytest.mark.parametrize("score", [False, True], ids=["loss_only", "with_score"])
def test_negative_per_sample_losses_are_warned_unless_scored(tmp_path, score):
    """Negative per-sample losses were taken as scores in silence: samples pruned by their advantage's sign
    (qa114-rl 06). Warned once, naming per_sample_score; not with a score returned beside the loss."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, SignedLoss(score), UserData(SmallImages(), tuple_collate))
    negative = [str(w.message) for w in caught if "holds negative values" in str(w.message)]
    assert len(negative) == (0 if score else 1), negative
    if not score:
        assert negative[0].startswith('InfoBatchCallback: the "per_sample_loss" returned by training_step holds')
        assert 'return "per_sample_score"' in negative[0]
