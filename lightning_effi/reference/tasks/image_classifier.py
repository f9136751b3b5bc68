"""Image classification over any timm model, plus a small CIFAR CNN registered in timm's model registry."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import timm
import torch.nn.functional as F
from timm.models import register_model
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_effi.reference.tasks.base import EffiTask, OptimizerFactory, SchedulerFactory


class SmallCNN(nn.Module):
    """A small VGG-style CNN for 32x32 inputs: per stage conv3x3-BN-ReLU then 2x2 max-pool, global average pool,
    linear head. About 21 MFLOPs forward per 32x32 image with the default widths (32, 64, 128).

    Input ``(B, 3, H, W)`` float; output logits ``(B, num_classes)``. Has the timm classifier interface
    (``forward_features``, ``forward_head``, ``get_classifier``, ``reset_classifier``).
    """

    def __init__(
        self, num_classes: int = 10, in_chans: int = 3, widths: Sequence[int] = (32, 64, 128), drop_rate: float = 0.0
    ):
        super().__init__()
        if not widths or any(int(w) <= 0 for w in widths):
            raise ValueError(f"SmallCNN: widths must be a non-empty list of positive ints, got {list(widths)}")
        layers: list[nn.Module] = []
        prev = in_chans
        for w in widths:
            layers += [nn.Conv2d(prev, int(w), 3, padding=1, bias=False), nn.BatchNorm2d(int(w)), nn.ReLU(inplace=True)]
            layers += [nn.MaxPool2d(2)]
            prev = int(w)
        self.features = nn.Sequential(*layers)
        self.num_features = prev
        self.num_classes = num_classes
        self.drop_rate = drop_rate
        self.head = nn.Linear(prev, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: Tensor) -> Tensor:
        return self.features(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x.mean(dim=(2, 3))
        x = F.dropout(x, self.drop_rate, self.training)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()


@register_model
def effi_cnn_small(pretrained: bool = False, **kwargs: Any) -> SmallCNN:
    """timm entry point ``effi_cnn_small``: :class:`SmallCNN` (no pretrained weights exist)."""
    if pretrained:
        raise ValueError("effi_cnn_small has no pretrained weights; use pretrained=False")
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    return SmallCNN(**kwargs)


def create_timm_model(model_name: str, num_classes: int, **model_kwargs: Any) -> nn.Module:
    """``timm.create_model(model_name, pretrained=False, num_classes=..., **model_kwargs)`` with a clear error for an
    unknown name (lists the closest registered names)."""
    if not timm.is_model(model_name):
        close = difflib.get_close_matches(model_name, timm.list_models(), n=5)
        hint = f"; did you mean one of {close}?" if close else "; see timm.list_models()"
        raise ValueError(f"model.model_name: unknown timm model {model_name!r}{hint}")
    return timm.create_model(model_name, pretrained=False, num_classes=num_classes, **model_kwargs)


class ImageClassifier(EffiTask):
    """Image classification with any timm model (built from its config, no pretrained weights).

    Batch: ``{"pixel_values": float (B, C, H, W), "labels": int64 (B,)}``. Per-sample loss: cross-entropy ``(B,)``
    (with optional label smoothing). Metrics: ``val/acc``, ``test/acc`` (torchmetrics multiclass accuracy).

    Args:
        model_name: a timm model name, e.g. ``effi_cnn_small`` or ``vit_tiny_patch16_224`` with
            ``model_kwargs={"img_size": 32, "patch_size": 4}``.
        num_classes: number of classes. model_kwargs: extra ``timm.create_model`` arguments.
        label_smoothing: in [0, 1).
        optimizer, scheduler, weight_decay: see :class:`~lightning_effi.reference.tasks.base.EffiTask`.

    Raises:
        ValueError: unknown model name, ``num_classes < 2`` or ``label_smoothing`` outside [0, 1).
    """

    def __init__(
        self,
        model_name: str = "effi_cnn_small",
        num_classes: int = 10,
        model_kwargs: Mapping[str, Any] | None = None,
        label_smoothing: float = 0.0,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay)
        if not isinstance(model_name, str):
            raise ValueError(f"model.model_name: expected a timm model name (a string), got {model_name!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"model.num_classes must be an int >= 2, got {num_classes!r}")
        if (
            isinstance(label_smoothing, bool)
            or not isinstance(label_smoothing, (int, float))
            or not 0.0 <= label_smoothing < 1.0
        ):
            raise ValueError(f"model.label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.model = create_timm_model(model_name, int(num_classes), **dict(model_kwargs or {}))
        self.label_smoothing = label_smoothing
        blocks = getattr(self.model, "blocks", None)
        self.effi_num_layers = len(blocks) if isinstance(blocks, nn.Sequential | nn.ModuleList) else 0
        self.val_acc = MulticlassAccuracy(num_classes=int(num_classes), average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=int(num_classes), average="micro")

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {"x": batch["pixel_values"]}

    def effi_data_limits(self) -> dict[str, int]:
        return {"num_classes": int(self.hparams.num_classes)}

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.model(pixel_values)

    def per_sample_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self.model(batch["pixel_values"])
        loss = F.cross_entropy(logits.float(), batch["labels"], reduction="none", label_smoothing=self.label_smoothing)
        return loss, logits

    def update_metrics(self, stage: str, batch: Mapping[str, Tensor], output: Tensor) -> None:
        metric = self.val_acc if stage == "val" else self.test_acc
        metric(output.argmax(dim=-1), batch["labels"])
        self.log(f"{stage}/acc", metric, prog_bar=True, on_step=False, on_epoch=True)

    def effi_count_tokens(self, batch: Mapping[str, Tensor]) -> int:
        """Tokens in a batch: ``B x (patches + prefix tokens)`` for a ViT, 0 for a CNN."""
        patch_embed = getattr(self.model, "patch_embed", None)
        if patch_embed is None:
            return 0
        per_image = int(patch_embed.num_patches) + int(getattr(self.model, "num_prefix_tokens", 0))
        return per_image * int(batch["pixel_values"].shape[0])
