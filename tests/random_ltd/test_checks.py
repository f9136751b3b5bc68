"""Random-LTD's argument, data and checkpoint checks (issue #21, "nothing silent"), and its non-finite loss policy:
the adapters' arguments (numpy ints, mappings and lists of names, the model they serve, widths the layers
contradict), settings the training data makes a no-op refused before the first batch (a peek at the data, which
leaves the loader and the random states alone), a growth longer than the run, the checkpoint's fields, and
``nonfinite_loss``."""

from __future__ import annotations

import copy
import logging
import math
import random
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_effi.adapters import (
    GenericAdapter,
    HFBertAdapter,
    HFGPT2Adapter,
    TimmViTAdapter,
    TorchTransformerAdapter,
    find_adapter,
)
from lightning_effi.callbacks import RandomLTDCallback
from lightning_effi.core.nonfinite import NonFiniteLossError
from lightning_effi.functional import random_ltd as F
from lightning_effi.models.base import MUST_BE_NONE, PASS, AttentionMask, SeqArg
from lightning_effi.random_ltd import is_converted
from lightning_effi.random_ltd.callback import _random_states_kept
from lightning_effi.tasks import GPT2CausalLM
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import (
    TINY_GPT2,
    TinyDataModule,
    TokenBlocks,
    seqlen_truncate,
    sgd,
    tiny_gpt2,
    tiny_lm_data,
    tiny_sentence_data,
)
from tests.user_modules.modules import CharBlocks, CharGPT2, EncoderClassifier, TokenLabels, UserData


def ltd(**kw):
    return RandomLTDCallback(**{"min_value": 4, "require_steps": 6, "seq_per_step": 4, "seed": 7} | kw)


def deep_gpt2(**kw):
    return tiny_gpt2(n_layer=4, **kw)


class Seen(Callback):
    """Records whether the training loop reached its first epoch and batch."""

    def __init__(self):
        self.epochs = self.batches = 0

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


# ------------------------------------------------------------------------------------------------ functional


def test_layer_tokens_refuses_negative_and_non_int_sizes_naming_them():
    with pytest.raises(ValueError, match=r"layer_tokens.batch_size must be an int >= 0, got -4"):
        F.layer_tokens(-4, 16, 8, 4, 2)
    with pytest.raises(ValueError, match=r"layer_tokens.seq_len must be an int >= 0, got 16.0"):
        F.layer_tokens(4, 16.0, 8, 4, 2)
    with pytest.raises(ValueError, match=r"layer_tokens.reserved_length must be an int >= 0, got -1"):
        F.layer_tokens(4, 16, -1, 4, 2)
    # numpy ints are ints: 4 * (8 * 2 + 16 * 2)
    assert F.layer_tokens(np.int64(4), np.int64(16), np.int64(8), np.int64(4), np.int64(2)) == 192
    assert F.layer_tokens(0, 16, 8, 4, 2) == 0


# ------------------------------------------------------------------------------------------------ GenericAdapter


def test_generic_adapter_takes_numpy_ints():
    adapter = GenericAdapter(
        "net.encoder.layers",
        max_sequence_length=np.int64(32),
        hidden_size=np.int64(32),
        intermediate_size=np.int64(64),
        num_prefix_tokens=np.int64(1),
    ).bind(EncoderClassifier(depth=4))
    values = (adapter.max_sequence_length(), adapter.hidden_size(), adapter.intermediate_size())
    assert values == (32, 32, 64) and adapter.num_prefix_tokens() == 1
    assert all(type(v) is int for v in (*values, adapter.num_prefix_tokens()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_args=["attention_mask"]), r"GenericAdapter.seq_args must be a mapping of argument name -> sequence"),
        (dict(seq_args="attention_mask"), r"GenericAdapter.seq_args must be a mapping"),
        (dict(seq_args={"attention_mask": ["x"]}), r"seq_args\['attention_mask'\] must be an int axis or a list"),
        (dict(seq_args={"attention_mask": 1.0}), r"seq_args\['attention_mask'\] must be an int axis or a list"),
        (dict(seq_args={"attention_mask": []}), r"seq_args\['attention_mask'\]: give at least one sequence axis"),
        (dict(masks=["self"]), r"GenericAdapter.masks must be a mapping of argument name -> mask kind"),
        (dict(masks={"src_mask": "causal"}), r"GenericAdapter.masks\['src_mask'\] must be one of"),
        (dict(passthrough="is_causal"), r"GenericAdapter.passthrough must be a list of .*\['is_causal'\] for one"),
        (dict(passthrough=3), r"GenericAdapter.passthrough must be a list of argument names \(strings\), got 3"),
        (dict(passthrough=["a", 3]), r"GenericAdapter.passthrough must be a list of argument names"),
        (dict(must_be_none="memory"), r"GenericAdapter.must_be_none must be a list of .*\['memory'\] for one"),
        (dict(must_be_none=3), r"GenericAdapter.must_be_none must be a list of argument names"),
        (dict(root="model"), r"GenericAdapter.root must be the nn.Module that layers starts from .* got str 'model'"),
        (dict(num_prefix_tokens=-1), r"GenericAdapter.num_prefix_tokens must be an int >= 0, got -1"),
        (dict(num_prefix_tokens=1.5), r"GenericAdapter.num_prefix_tokens must be an int >= 0, got 1.5"),
        (dict(hidden_size="32"), r"GenericAdapter.hidden_size must be an int >= 1 or None, got '32'"),
        (dict(max_sequence_length=True), r"GenericAdapter.max_sequence_length must be an int >= 1 or None"),
        # one argument in two declarations: the later one won in silence (qa102-nlp 03)
        (dict(masks={"m": "self"}, passthrough=["m"]), r"argument 'm' is declared in both masks and passthrough"),
        (dict(seq_args={"m": 1}, masks={"m": "self"}), r"argument 'm' is declared in both seq_args and masks"),
        (dict(seq_args={"m": 1}, passthrough=["m"]), r"argument 'm' is declared in both seq_args and passthrough"),
        (dict(masks={"m": "self"}, must_be_none=["m"]), r"argument 'm' is declared in both masks and must_be_none"),
    ],
)
def test_generic_adapter_refuses_bad_declarations_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenericAdapter("net.encoder.layers", **kwargs)


def test_a_name_repeated_in_one_declaration_is_one_declaration():
    """``passthrough=common + extra`` may repeat a name: one handling, not a conflict (qa103-regress 04)."""
    adapter = GenericAdapter("blocks", passthrough=["use_cache", "use_cache"], must_be_none=["past", "past"])
    assert adapter._declared == {"use_cache": PASS, "past": MUST_BE_NONE}


def test_generic_adapter_reads_hydra_containers_and_lists():
    adapter = GenericAdapter(
        "layers",
        hidden_size=8,
        seq_args=OmegaConf.create({"position_ids": [-1], "rotary": -2}),
        masks=OmegaConf.create({"attn_mask": "self"}),
        passthrough=OmegaConf.create(["use_cache"]),
        must_be_none=("cache",),
    )
    assert adapter.layer_arguments == {
        "position_ids": SeqArg((-1,)),
        "rotary": SeqArg((-2,)),
        "attn_mask": AttentionMask("self"),
        "use_cache": PASS,
        "cache": MUST_BE_NONE,
    }


class NormBlock(nn.Module):
    """A layer without nn.MultiheadAttention: a pre-norm MLP of width 32 (inner 48)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 48), nn.Linear(48, width)

    def forward(self, x):
        return x + self.down(self.up(self.norm(x)))


def test_a_hidden_size_the_layers_contradict_is_refused_at_bind():
    with pytest.raises(
        ValueError, match=r"GenericAdapter.hidden_size=64, but the layers of 'net.encoder.layers' are 32"
    ):
        GenericAdapter("net.encoder.layers", hidden_size=64).bind(EncoderClassifier(depth=4))
    with pytest.raises(ValueError, match=r"GenericAdapter.intermediate_size=128, .* MLP of width 64 \(linear1"):
        GenericAdapter("net.encoder.layers", intermediate_size=128).bind(EncoderClassifier(depth=4))
    blocks = nn.Module()
    blocks.layers = nn.ModuleList([NormBlock(), NormBlock()])
    # no attention: the normalisation width says 32 (48, the MLP's inner width, is not the hidden width)
    with pytest.raises(ValueError, match=r"hidden_size=48, .*normalisation layers normalise \[32\] features"):
        GenericAdapter("layers", hidden_size=48).bind(blocks)
    assert GenericAdapter("layers", hidden_size=32).bind(blocks).hidden_size() == 32


def test_the_mlp_width_of_a_hand_written_layer_is_read_from_its_down_projection():
    """NormBlock's MLP is 48 wide (nn.Linear(48, 32) projects it back to H = 32): intermediate_size() is 48, not the
    4H = 128 assumed before (a user's 2H-wide MLP had its FLOPs saving overstated by ~40%); a declared width the
    layer contradicts is refused; a layer without such a projection keeps 4H, with a warning naming the argument."""
    import warnings

    blocks = nn.Module()
    blocks.layers = nn.ModuleList([NormBlock(), NormBlock()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GenericAdapter("layers", hidden_size=32).bind(blocks).intermediate_size() == 48
    with pytest.raises(
        ValueError,
        match=r"intermediate_size=64, but the layers of 'layers' project an MLP of width "
        r"48 back to 32 \(an nn.Linear\(48, 32\)\)",
    ):
        GenericAdapter("layers", hidden_size=32, intermediate_size=64).bind(blocks)
    plain = nn.Module()
    plain.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(2)])
    with pytest.warns(
        UserWarning,
        match=r"intermediate_size: not given, .* the FLOPs figures take the MLP as 4H = "
        r"128 wide; pass intermediate_size",
    ):
        assert GenericAdapter("layers", hidden_size=32).bind(plain).intermediate_size() == 128


class SwiGLUBlock(nn.Module):
    """A LLaMA-style MLP of width 32 -> 48: gate and up ``Linear(32, 48)``, down ``Linear(48, 32)``."""

    def __init__(self, width: int = 32, inner: int = 48):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate, self.up, self.down = nn.Linear(width, inner), nn.Linear(width, inner), nn.Linear(inner, width)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def test_a_gated_mlp_counts_three_matrices_and_a_rebind_keeps_the_width_read_beside_a_declared_hidden_size():
    """SwiGLU: three 32 x 48 matrices are the formula's two of width 72 (before: 48, a third of the MLP uncounted).
    At a narrower level (16 wide, inner 24) with hidden_size=32 declared, the widths stay the full model's (before:
    the narrow up-projection Linear(16, 24) was read against H = 32, giving 16)."""
    blocks = nn.Module()
    blocks.layers = nn.ModuleList([SwiGLUBlock(), SwiGLUBlock()])
    adapter = GenericAdapter("layers", hidden_size=32).bind(blocks)
    assert adapter.intermediate_size() == 72
    narrow = nn.Module()
    narrow.layers = nn.ModuleList([SwiGLUBlock(16, 24), SwiGLUBlock(16, 24)])
    adapter.rebind(narrow)
    assert (adapter.hidden_size(), adapter.intermediate_size()) == (32, 72)
    declared = GenericAdapter("layers", hidden_size=32, intermediate_size=48).bind(blocks)  # the MLP's own width
    assert declared.intermediate_size() == 48  # as declared (3I/2 = 72 counts the third matrix)


def test_rebind_keeps_the_declared_widths_of_a_narrower_level():
    """The V-cycle's coarse level is narrower: the declared sizes stay as given there, no error."""
    adapter = GenericAdapter("net.encoder.layers", hidden_size=32, intermediate_size=64)
    adapter.bind(EncoderClassifier(depth=4))
    narrow = nn.Module()
    narrow.net = nn.Module()
    layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True)
    narrow.net.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    adapter.rebind(narrow)
    assert (len(adapter.layers()), adapter.hidden_size(), adapter.intermediate_size()) == (2, 32, 64)


def fit_user(tmp_path, cb, **trainer_kwargs):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [cb], **({"max_steps": 2, "max_epochs": -1} | trainer_kwargs))
    trainer.fit(EncoderClassifier(depth=4), datamodule=UserData(TokenLabels(n=16)))
    return trainer


def test_a_declared_max_sequence_length_below_the_data_is_named(tmp_path):
    adapter = GenericAdapter("net.encoder.layers", max_sequence_length=8)
    with pytest.raises(ValueError, match=r"max_value \(16\) is larger than .* \(8 tokens, GenericAdapter's max_seq"):
        fit_user(tmp_path / "a", ltd(max_value=16, adapter=adapter))
    # max_value=None: the 16-token batches the layers see contradict the declaration (at the first batch: a
    # GenericAdapter cannot tell the length from the data)
    adapter = GenericAdapter("net.encoder.layers", max_sequence_length=8)
    with pytest.raises(
        ValueError, match=r"are 16 tokens long \(at the first training batch\), longer than the model's "
    ):
        fit_user(tmp_path / "b", ltd(adapter=adapter))


def test_prefix_tokens_above_min_value_name_num_prefix_tokens(tmp_path):
    adapter = GenericAdapter("net.encoder.layers", num_prefix_tokens=8)
    with pytest.raises(ValueError, match=r"8 prefix tokens are always kept \(keep_prefix_tokens='auto': .*"
                       r"GenericAdapter's num_prefix_tokens\), more than min_value \(4\)"):  # fmt: skip
        fit_user(tmp_path, ltd(adapter=adapter))


# ------------------------------------------------------------------------------------------------ registered adapters


@pytest.mark.parametrize(
    ("cls", "expects"),
    [
        (HFBertAdapter, r"HFBertAdapter expects a BERT-style model with .encoder.layer .*; got GPT2LMHeadModel$"),
        (TimmViTAdapter, r"TimmViTAdapter expects a timm VisionTransformer with .blocks .*; got GPT2LMHeadModel$"),
        (TorchTransformerAdapter, r"TorchTransformerAdapter expects a PyTorch nn.TransformerEncoder .*got GPT2LMHead"),
        (
            HFGPT2Adapter,
            r"HFGPT2Adapter expects a GPT-2 .*; got GPT2LMHeadModel; .*: HFGPT2Adapter\(model.transformer\)",
        ),
    ],
)
def test_an_adapter_given_a_model_of_another_family_names_what_it_expects(cls, expects):
    model = tiny_gpt2().model  # a GPT2LMHeadModel
    with pytest.raises(ValueError, match=expects):
        cls(model)
    with pytest.raises(ValueError, match=rf"{cls.__name__}.root must be (an|the) nn.Module .*got str"):
        cls("model")


def test_a_registered_adapter_serves_the_model_it_matches():
    model = tiny_gpt2().model
    adapter = HFGPT2Adapter(model.transformer)
    assert adapter.root is model.transformer and len(adapter.layers()) == 2
    assert adapter.sequence_length({"input_ids": torch.zeros(3, 12, dtype=torch.long)}) == 12
    assert adapter.sequence_length((torch.zeros(3, 12),)) is None  # another structure: cannot tell


def test_a_model_attr_without_a_transformer_names_model_attr(tmp_path):
    trainer = make_trainer(tmp_path, [ltd(model_attr="model.lm_head")], max_steps=1, max_epochs=-1)
    with pytest.raises(ValueError, match=r"RandomLTDCallback.model_attr='model.lm_head' \(a Linear\): adapter: no "
                       r"model inside Linear matches .*; model_attr must name the submodule"):  # fmt: skip
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())


# ------------------------------------------------------------------------------------------------ the data's length


def test_seq_per_step_above_max_value_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"RandomLTDCallback.seq_per_step \(64\) must be <= max_value \(16\)"):
        RandomLTDCallback(min_value=4, max_value=16, seq_per_step=64)
    assert RandomLTDCallback(min_value=4, max_value=16, seq_per_step=16).seq_per_step == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(min_value=16),
            r"min_value \(16\) is equal to the sequence length the patched layers see \(16 tokens at the first "
            r"training batch\): the reserved length is never below 16, so random-LTD would never drop a token",
        ),  # fmt: skip
        (
            dict(min_value=32),
            r"min_value \(32\) is larger than the sequence length .* \(16 tokens at the first training batch",
        ),
        (dict(min_value=16, max_value=16, seq_per_step=16), r"min_value \(16\) is equal to the sequence length"),
        (dict(seq_per_step=32), r"seq_per_step \(32\) is larger than max_value=None's end .* \(16 tokens at the first"),
    ],
)
def test_no_op_settings_are_refused_before_the_first_update(tmp_path, kwargs, match):
    """Refused at the first forward, against the positions the patched layers see, before any update (at train
    start, against the ids peeked from the data, a soft-prompted model's valid min_value was refused: see
    :func:`test_min_value_counts_the_positions_in_front_of_the_ids`)."""
    seen = Seen()
    trainer = make_trainer(tmp_path, [ltd(**kwargs), seen], max_steps=2, max_epochs=-1)
    with pytest.raises(ValueError, match=match):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert (seen.batches, trainer.global_step) == (1, 0)  # raised in the first forward


class SoftPrompted(pl.LightningModule):
    """Prompt tuning: ``prompt`` learned positions in front of the ids' embeddings, HF GPT-2 called with
    ``inputs_embeds``: its blocks see ``prompt`` positions more than the data's ids."""

    def __init__(self, prompt: int) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_layer=3, n_embd=32, n_head=2))
        self.prompt = nn.Parameter(torch.zeros(1, prompt, 32))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x = torch.cat([self.prompt.expand(len(ids), -1, -1), self.model.transformer.wte(ids)], 1)
        return self.model(inputs_embeds=x).logits.logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PaddedBlocks(TokenBlocks):
    """Token blocks padded to one length, 16, each with 4 to 15 real tokens (``padding="max_length"``)."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        return item | {"attention_mask": (torch.arange(16) < 4 + i % 12).long()}


@pytest.mark.parametrize(
    ("prompt", "max_value", "refused", "padded"),
    [(0, 24, True, False), (4, 20, False, False), (4, 24, True, False), (0, 32, True, True)],
)
def test_an_explicit_max_value_is_checked_against_the_positions_of_the_first_batch(
    tmp_path, prompt, max_value, refused, padded
):
    """The ids peeked from the data at train start do not count the positions a model puts in front of them: a
    soft-prompted model whose layers see 20 positions was refused max_value=20, "larger than the 16 tokens in the
    training data" (qa70-regress 03). An explicit max_value is checked at the first batch, before any update,
    against the positions the layers see; also when that batch has padding, where every sample is padded to one
    length (skipped as a batch padded per batch, so 32 for 16 passed, qa72-break 01)."""
    seen = Seen()
    trainer = make_trainer(tmp_path, [ltd(max_value=max_value), seen], max_steps=2, max_epochs=-1)
    module = SoftPrompted(prompt) if prompt else deep_gpt2()
    data = TinyDataModule(PaddedBlocks()) if padded else tiny_lm_data()
    if refused:
        shown = rf"max_value \({max_value}\) is larger than .* \({16 + prompt} tokens at the first training batch\)"
        with pytest.raises(ValueError, match=shown):
            trainer.fit(module, datamodule=data)
        assert (seen.batches, trainer.global_step) == (1, 0)
    else:
        trainer.fit(module, datamodule=data)
        assert trainer.global_step == 2 and trainer.callbacks[0].max_value == max_value


@pytest.mark.parametrize(("prompt", "refused"), [(0, True), (16, False)])
def test_min_value_counts_the_positions_in_front_of_the_ids(tmp_path, prompt, refused):
    """min_value=16 for 16 token ids: a no-op, refused, unless the model puts positions in front of them (16 soft
    prompt positions: the layers see 32). It was refused at train start against the ids peeked from the data, "the
    sequence length the patched layers see (16 tokens)" (qa113-peft 03); it trains, dropping tokens."""
    trainer = make_trainer(tmp_path, [ltd(min_value=16, seq_per_step=4, require_steps=4)], max_steps=2, max_epochs=-1)
    module = SoftPrompted(prompt) if prompt else deep_gpt2()
    if refused:
        with pytest.raises(ValueError, match=r"min_value \(16\) is equal to the sequence length .* \(16 tokens at"):
            trainer.fit(module, datamodule=tiny_lm_data())
        return
    trainer.fit(module, datamodule=tiny_lm_data())
    assert trainer.global_step == 2 and trainer.callbacks[0].max_value == 32


@pytest.mark.parametrize(("prompt", "max_value", "refused"), [(0, None, True), (8, None, False), (8, 24, False)])
def test_a_prefix_in_front_of_a_truncated_batch_counts_for_the_curriculums_longest_batch(
    tmp_path, prompt, max_value, refused
):
    """Under a seqlen curriculum of at most 16 tokens a min_value of 20 never drops a token, unless the model puts
    positions in front of the batch's tokens: with an 8-position prefix (an image prefix, a soft prompt; kept,
    keep_prefix_tokens) the layers see 16 to 24. It was refused at setup, naming a min_value that would leave 3 text
    tokens beside the image (qa111-multimodal 02). Refused at the first forward, before any update, when nothing is
    in front; else it trains, max_value=None ending the schedule at the curriculum's longest batch plus the
    prefix."""
    from lightning_effi.curriculum import Curriculum, CurriculumDataModule

    seen = Seen()
    cb = ltd(min_value=20, max_value=max_value, keep_prefix_tokens=prompt, seq_per_step=4, require_steps=2)
    curriculum = Curriculum(metrics=seqlen_truncate(min_difficulty=8, max_difficulty=16, total_curriculum_step=2))
    trainer = make_trainer(tmp_path, [curriculum, cb, seen], max_steps=3, max_epochs=-1)
    module = SoftPrompted(prompt) if prompt else deep_gpt2()
    if refused:
        with pytest.raises(
            ValueError,
            match=r"reserved length is never below 20 tokens .* Curriculum's seqlen_truncate makes every batch at "
            r"most 16 tokens long \(max_difficulty=16\), so random-LTD would never drop a token: lower "
            r"RandomLTDCallback.min_value below 16",
        ):
            trainer.fit(module, datamodule=CurriculumDataModule(tiny_lm_data()))
        assert (seen.batches, trainer.global_step) == (1, 0) and not is_converted(module)
        return
    trainer.fit(module, datamodule=CurriculumDataModule(tiny_lm_data()))
    assert trainer.global_step == 3 and cb.max_value == 24
    assert cb.consumed_layer_tokens < cb.full_layer_tokens  # the curriculum's 16-token batches: 24 positions, 20 kept


def test_data_it_cannot_peek_is_checked_at_the_first_batch(tmp_path):
    """A user module on (x, y) tuples: the adapter cannot tell the length from the batch, the first batch decides."""
    seen = Seen()
    trainer = make_trainer(tmp_path, [ltd(min_value=32, seq_per_step=8), seen], max_steps=2, max_epochs=-1)
    with pytest.raises(ValueError, match=r"min_value \(32\) is equal to .* \(32 tokens at the first training batch"):
        trainer.fit(CharGPT2(n_layer=4), datamodule=UserData(CharBlocks(n=8, block=32)))
    assert (seen.epochs, seen.batches) == (1, 1)


class Noisy(TokenBlocks):
    """Token blocks whose samples draw from every global generator (a random augmentation)."""

    def __getitem__(self, i):
        random.random(), np.random.rand(), torch.rand(1)
        return super().__getitem__(i)


class Stream(IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.zeros(16, dtype=torch.long)}


def peek(dataset, adapter, **loader_kwargs):
    cb = ltd()
    cb.adapter = adapter
    return cb._peek_sequence_length(SimpleNamespace(train_dataloader=DataLoader(dataset, **loader_kwargs)))


def test_the_peek_reads_samples_through_the_adapter_and_leaves_the_random_states_alone():
    gpt2 = find_adapter(deep_gpt2())
    before = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    assert peek(Noisy(n=8, seq_len=12), gpt2, batch_size=4, shuffle=True) == 12
    after = random.getstate(), np.random.get_state()[1], torch.random.get_rng_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
    # variable-length samples (the first batch decides), a stream, a tuple batch GPT-2's adapter cannot read
    assert peek(tiny_sentence_data().train_dataset, gpt2, collate_fn=tiny_sentence_data().collate_fn) is None
    assert peek(Stream(), gpt2, batch_size=2) is None
    assert peek(TokenLabels(n=4), gpt2, batch_size=2) is None
    assert peek(TokenLabels(n=4), GenericAdapter("net.encoder.layers").bind(EncoderClassifier()), batch_size=2) is None
    state = torch.random.get_rng_state()
    with _random_states_kept():
        torch.rand(3)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_peek_does_not_change_the_run(tmp_path, monkeypatch):
    """A dataset that draws from the global generators: the same weights with the peek as without it (its reads
    of the dataset are outside the run's random stream, and the loader is not iterated)."""
    weights, peeked = [], []
    for n in range(2):
        if n:
            monkeypatch.setattr(RandomLTDCallback, "_peek_sequence_length", lambda self, trainer: None)
        torch.manual_seed(0)
        model, cb = deep_gpt2(), ltd(max_value=16)
        make_trainer(tmp_path / str(n), [cb], max_steps=3, max_epochs=-1).fit(
            model, datamodule=TinyDataModule(Noisy(n=16), batch_size=4)
        )
        weights.append(model.state_dict())
        peeked.append(cb._data_length)
    assert peeked == [16, None]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


# ------------------------------------------------------------------------------------------------ require_steps


class Reserved(Callback):
    """The reserved length of every training batch (``cb.current_value`` after its forward)."""

    def __init__(self, cb: RandomLTDCallback) -> None:
        self.cb, self.rs = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rs.append(self.cb.current_value)


def test_a_growth_longer_than_the_run_warns_naming_where_it_ends(tmp_path):
    """DeepSpeed's fixed_linear schedule first gives max_value at global_step == require_steps, and a run of T = 4
    optimizer steps trains steps 0..3, so require_steps >= 4 never reaches max_value=16 (the data's 16 tokens) and
    warns with the reserved length of step 3 and the largest require_steps that reaches it, 3:
    ltd_value(3, 4, 16, 6, 2) = 3 * 12 // 6 + 4 = 10; ltd_value(3, 4, 16, 4, 2) = 13 rounded down to 12. With
    require_steps=3, step 3 runs at 16: no warning (the threshold named is true)."""
    cases = {6: [4, 6, 8, 10], 4: [4, 6, 10, 12], 3: [4, 8, 12, 16]}
    for require_steps, expected in cases.items():
        cb = ltd(require_steps=require_steps, seq_per_step=2)
        reserved = Reserved(cb)
        rs = reserved.rs

        trainer = make_trainer(tmp_path / str(require_steps), [cb, reserved], max_steps=4, max_epochs=-1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
        assert rs == expected and trainer.global_step == 4  # the run does what was asked for its steps
        messages = [str(w.message) for w in caught if "RandomLTDCallback.require_steps" in str(w.message)]
        if require_steps == 3:
            assert messages == [] and rs[-1] == 16
            continue
        (msg,) = messages
        assert msg.startswith(
            f"RandomLTDCallback.require_steps={require_steps} ({require_steps} optimizer steps) does not end within "
            "the run (4 optimizer steps, steps 0..3; DeepSpeed's fixed_linear schedule reaches max_value at step "
            f"require_steps): the reserved length grows only to {expected[-1]} tokens at the run's last step "
            f"(step 3), {16 - expected[-1]} below max_value=16, never reaching max_value"
        )
        assert "pass require_steps <= 3 (max_value from that step on, the run's last step being 3) to reach it" in msg
        assert "'1dur'" not in msg  # the whole run does not reach it either


def test_a_growth_beside_infobatch_warns_alike_fresh_and_resumed(tmp_path):
    """Beside InfoBatch (24 samples, batch 4, 3 epochs, prune_ratio 0.5, delta 0.67) the run has 15 optimizer steps
    or more (6 + 3 + 6: the pruning epoch keeps at least 1 + floor(0.5 * 23) = 12 samples) and up to 18 by the
    scores. The check read Lightning's estimate of the current loader: 18 in a fresh fit (no warning), the pruned
    epoch's in a fit resumed there, warning with a length the run did not have (qa67-user 01). It warns from the
    fewest steps now, alike in both: require_steps=15 may not end within the run, 14 does."""
    from lightning_effi.callbacks import InfoBatchCallback

    def fit(require_steps: int, root: str, ckpt: ModelCheckpoint | None = None, resume: str | None = None) -> list:
        pl.seed_everything(0)
        callbacks = [InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7), ltd(require_steps=require_steps)]
        dm = callbacks[0].wrap_datamodule(TinyDataModule(TokenBlocks(n=24), batch_size=4))
        trainer = make_trainer(tmp_path / root, [*callbacks, *([ckpt] if ckpt else [])], max_epochs=3, max_steps=-1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(deep_gpt2(), datamodule=dm, ckpt_path=resume)
        return [str(w.message) for w in caught if "RandomLTDCallback.require_steps" in str(w.message)]

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=7, save_top_k=-1, filename="{step}")
    fresh = fit(15, "fresh", ckpt)
    resumed = fit(15, "resumed", resume=str(tmp_path / "ck" / "step=7.ckpt"))  # in the pruning epoch
    assert fresh == resumed and len(fresh) == 1
    assert fresh[0].startswith(
        "RandomLTDCallback.require_steps=15 (15 optimizer steps) may not end within the run: InfoBatchCallback "
        "shortens its epochs by their scores, so the run has 15 optimizer steps or more"
    )
    assert "pass require_steps <= 14 to reach it within any such run" in fresh[0]
    assert fit(14, "shorter") == []


def test_the_default_whole_run_growth_ends_one_step_after_the_run_without_a_warning(tmp_path):
    """``require_steps=None`` ("1dur", DeepSpeed's convention) resolves to T = 6 steps: max_value=16 is reached at
    step 6, after the last trained step 5, which runs at ltd_value(5, 4, 16, 6, 4) = floor(5/6 * 12 + 4) = 14
    rounded down to 12, within the documented gap ceil((16 - 4) / 6) + 4 - 1 = 5 tokens. Not warned: the default
    follows the reference; a fraction of the run never warns."""
    for require_steps in (None, "1dur", "0.9dur"):
        cb = ltd(require_steps=require_steps, max_value=16)
        reserved = Reserved(cb)
        rs = reserved.rs

        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*RandomLTDCallback.require_steps")
            make_trainer(tmp_path / str(require_steps), [cb, reserved], max_steps=6, max_epochs=-1).fit(
                deep_gpt2(), datamodule=tiny_lm_data()
            )
        assert cb.require_steps == 6  # "0.9dur": ceil(0.9 * 6) = 6
        assert rs == [F.ltd_value(s, 4, 16, 6, 4) for s in range(6)] == [4, 4, 8, 8, 12, 12]
        assert 16 - rs[-1] <= math.ceil((16 - 4) / 6) + 4 - 1


def test_a_second_fit_on_the_same_trainer_is_refused_and_a_checkpoint_resume_is_not(tmp_path):
    """A second ``trainer.fit`` on a Trainer that trained 5 steps (max_steps raised to 10) would re-derive
    ``require_steps='1dur'`` for 10 steps: r = ltd_value(5, 4, 16, 10, 4) = 8 at step 5, below the 12 of the first
    fit's last step (ltd_value(4, 4, 16, 5, 4)). Refused at train start, before any step, naming the situation and the
    fixes; the layers are restored and the weights unchanged. The same Trainer refitted from the first fit's
    checkpoint (``ckpt_path``) goes on exactly as an uninterrupted run of 10 steps (require_steps=5: a schedule both
    runs share): the same r at every step and the same layer-tokens."""
    for require_steps in (None, 5):
        ckpt = ModelCheckpoint(dirpath=tmp_path / f"ck{require_steps}", every_n_train_steps=5, filename="{step}")
        cb = ltd(require_steps=require_steps, max_value=16)
        reserved = Reserved(cb)
        rs = reserved.rs

        model = deep_gpt2()
        trainer = make_trainer(tmp_path / f"a{require_steps}", [cb, ckpt, reserved], max_steps=5, max_epochs=-1)
        trainer.fit(model, datamodule=tiny_lm_data())
        assert rs == [F.ltd_value(s, 4, 16, 5, 4) for s in range(5)] == [4, 4, 8, 8, 12]
        trainer.fit_loop.epoch_loop.max_steps = 10
        if require_steps is None:
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            with pytest.raises(ValueError) as err:
                trainer.fit(model, datamodule=tiny_lm_data())
            msg = str(err.value)
            assert msg.startswith(
                "RandomLTDCallback: this fit starts at step 5 on a Trainer that trained before (a second trainer.fit "
                "on the same Trainer: random-LTD's schedule covers one fit and does not continue into another); its "
                "schedule counts from step 0 of the run "
                "(require_steps='1dur', 10 optimizer steps in this fit: r = 8 tokens at step 5, not min_value=4)"
            )
            assert "Resume from a checkpoint written with random-LTD (trainer.fit(..., ckpt_path=...)" in msg
            assert "start random-LTD in a fresh fit (a new Trainer without ckpt_path" in msg
            assert trainer.global_step == 5 and len(rs) == 5 and cb.patched is None and not is_converted(model)
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())  # no step taken
            continue
        trainer.fit(model, datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck5" / "step=5.ckpt"))
        assert trainer.global_step == 10 and rs == [F.ltd_value(s, 4, 16, 5, 4) for s in range(10)]
        straight = ltd(require_steps=5, max_value=16)
        make_trainer(tmp_path / "straight", [straight], max_steps=10, max_epochs=-1).fit(
            deep_gpt2(), datamodule=tiny_lm_data()
        )
        assert cb.consumed_layer_tokens == straight.consumed_layer_tokens > 0


def test_random_ltd_added_on_resume_from_a_checkpoint_without_its_state_is_refused(tmp_path):
    """A checkpoint of a fit without random-LTD at step 2, resumed with random-LTD (require_steps=6): its schedule
    would start at r = ltd_value(2, 4, 16, 6, 4) = 8, not min_value. Refused at train start, naming the checkpoint;
    resumed from a checkpoint written with random-LTD the schedule goes on (test_fit_again_continues_the_schedule)."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(tmp_path, [ckpt], max_steps=2, max_epochs=-1).fit(deep_gpt2(), datamodule=tiny_lm_data())
    seen = Seen()
    trainer = make_trainer(tmp_path / "r", [ltd(max_value=16), seen], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError) as err:
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert str(err.value).startswith(
        "RandomLTDCallback: added on resume at step 2, from a checkpoint without random-LTD state (written by a fit "
        "without this callback); its schedule counts from step 0 of the run (require_steps=6, 6 optimizer steps in "
        "this fit: r = 8 tokens at step 2, not min_value=4)"
    )
    assert seen.batches == 0


def test_a_derived_max_value_resumed_on_shorter_data_is_refused(tmp_path):
    """max_value=None is derived from the data the run starts on (16 tokens) and kept in the checkpoint; resumed on
    8-token blocks the growth would end at 16 and drop nothing from r = 8 on, the case an explicit max_value above
    the data's length is refused for. Refused at the resumed fit's first forward (strict), before any update, against
    the positions the layers see (prompts peeked at train start, prompt and generated tokens trained: a valid resume
    was refused, qa114-rl 02); with strict=False it warns and goes on with the checkpoint's max_value. Resumed on the
    same data, it goes on."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    first = ltd()
    make_trainer(tmp_path, [first, ckpt], max_steps=2, max_epochs=-1).fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert first.max_value == 16
    path = str(tmp_path / "ck" / "step=2.ckpt")
    short = TinyDataModule(TokenBlocks(seq_len=8))
    seen = Seen()
    with pytest.raises(ValueError) as err:
        make_trainer(tmp_path / "r", [ltd(), seen], max_steps=4, max_epochs=-1).fit(
            deep_gpt2(), datamodule=short, ckpt_path=path
        )
    assert str(err.value).startswith(
        "RandomLTDCallback: the checkpoint's max_value (16 tokens, derived from the sequences the run started on) is "
        "larger than the sequence length the patched layers see now (8 tokens at the resumed fit's first training "
        "batch): the reserved length would reach 8 before the end of its growth and drop nothing from then on"
    )
    assert str(err.value).endswith("pass strict=False to continue with the checkpoint's max_value")
    assert seen.batches == 1  # in the first forward, before any update
    lenient = ltd(strict=False)
    with pytest.warns(UserWarning, match=r"max_value \(16 tokens.*strict=False: continue with the checkpoint's"):
        make_trainer(tmp_path / "w", [lenient], max_steps=4, max_epochs=-1).fit(
            deep_gpt2(), datamodule=short, ckpt_path=path
        )
    assert lenient.max_value == 16
    same = ltd()
    make_trainer(tmp_path / "s", [same], max_steps=4, max_epochs=-1).fit(
        deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path
    )
    assert same.max_value == 16


# ------------------------------------------------------------------------------------------------ checkpoint state


def valid_state(**kw):
    cb = ltd(max_value=16, **kw)
    state = cb.state_dict()
    state.update(current_step=5, current_value=12, consumed_layer_tokens=640, full_layer_tokens=1024)
    state.update(consumed_samples=40, saved_flops=1.5e6, full_layer_flops=4.0e6, global_batch_size=8)
    return state


def test_a_valid_state_loads_exactly():
    state = valid_state()
    cb = ltd(max_value=16)
    cb.load_state_dict(copy.deepcopy(state))
    assert cb.state_dict() == state
    old = {k: v for k, v in state.items() if k != "nonfinite_loss"}  # written before the non-finite policy
    cb = ltd(max_value=16)
    cb.load_state_dict(old)
    assert cb.nonfinite_guard.count == 0 and cb.current_value == 12


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("current_step", -5, r"RandomLTDCallback checkpoint.current_step must be an int >= -1, got -5"),
        ("current_step", 2.0, r"checkpoint.current_step must be an int >= -1, got 2.0"),
        ("current_value", 0, r"checkpoint.current_value must be an int >= 4 and <= 16, got 0"),
        ("current_value", 17, r"checkpoint.current_value must be an int >= 4 and <= 16, got 17"),
        ("saved_flops", math.nan, r"checkpoint.saved_flops must be a finite number in \[0, inf\], got nan"),
        ("full_layer_flops", -1.0, r"checkpoint.full_layer_flops must be a finite number in \[0, inf\], got -1.0"),
        ("consumed_layer_tokens", -64, r"checkpoint.consumed_layer_tokens must be an int >= 0, got -64"),
        ("full_layer_tokens", "1024", r"checkpoint.full_layer_tokens must be an int >= 0, got '1024'"),
        ("consumed_samples", True, r"checkpoint.consumed_samples must be an int >= 0, got True"),
        ("global_batch_size", -8, r"checkpoint.global_batch_size must be an int >= 0, got -8"),
        ("micro_batches", 1.5, r"checkpoint.micro_batches must be an int >= 0, got 1.5"),
        ("config", [], r"checkpoint.config must be a dict of the callback's settings, got \[\]"),
        ("nonfinite_loss", 3, r"checkpoint.nonfinite_loss must be a dict \(count, first_step\), got 3"),
        ("nonfinite_loss", {"count": -1}, r"checkpoint nonfinite count must be an int >= 0, got -1"),
        ("saved_flops", None, r"checkpoint: the state lacks saved_flops"),
    ],
)
def test_a_bad_checkpoint_field_is_refused_naming_it(field, value, match):
    state = valid_state()
    if value is None:
        del state[field]
    else:
        state[field] = value
    cb = ltd(max_value=16)
    before = cb.state_dict()
    with pytest.raises(ValueError, match=match):
        cb.load_state_dict(state)
    assert cb.state_dict() == before  # refused before anything is restored


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (2.5, r"checkpoint.config.require_steps must be an int >= 1, got 2.5"),  # was taken as int(2.5) = 2
        (True, r"checkpoint.config.require_steps must be an int >= 1, got True"),
        ("x", r"checkpoint.config.require_steps must be an int >= 1, got 'x'"),  # a bare int() error
        (..., r"checkpoint.config lacks require_steps"),  # a bare KeyError
    ],
)
def test_a_bad_checkpoint_schedule_is_refused_naming_it(value, match):
    """The checkpoint's schedule (qa92-break 04): a fraction of a step was taken as int(), resuming at another
    reserved length in silence."""
    state = valid_state()
    state["config"] = dict(state["config"])
    if value is ...:
        del state["config"]["require_steps"]
    else:
        state["config"]["require_steps"] = value
    cb = ltd(max_value=16)
    before = cb.state_dict()
    with pytest.raises(ValueError, match=match):
        cb.load_state_dict(state)
    assert cb.state_dict() == before
    with pytest.raises(ValueError, match=r"checkpoint.config.clock must be one of \['step', 'progress'\]"):
        cb.load_state_dict(valid_state() | {"config": valid_state()["config"] | {"clock": "epoch"}})


def test_deepspeed_rounding_may_start_below_min_value():
    """rounding='deepspeed': r at step 0 is min_value rounded down to a multiple of seq_per_step (6 -> 4)."""
    assert F.ltd_value(0, 6, 16, 6, 4, "deepspeed") == 4
    state = valid_state(min_value=6, rounding="deepspeed") | {"current_value": 4}
    cb = ltd(max_value=16, min_value=6, rounding="deepspeed")
    cb.load_state_dict(state)
    assert cb.current_value == 4
    with pytest.raises(ValueError, match=r"checkpoint.current_value must be an int >= 4 and <= 16, got 3"):
        cb.load_state_dict(state | {"current_value": 3})


# ------------------------------------------------------------------------------------------------ non-finite losses


class NaNAt(GPT2CausalLM):
    """The tiny 4-layer GPT-2 whose training loss is NaN at the given steps: ``loss * nan`` (``times``: NaN
    gradients too) or ``loss + nan`` (the gradients stay those of the loss, so a run that goes on stays finite)."""

    def __init__(self, steps, times=True):
        super().__init__(**{**TINY_GPT2, "n_layer": 4, "optimizer": sgd})
        self.nan_steps, self.times = set(steps), times

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step in self.nan_steps:
            out["loss"] = out["loss"] * math.nan if self.times else out["loss"] + math.nan
        return out


class Rows(Logger):
    """A logger that keeps every ``log_metrics`` call: ``(step, metrics)``."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "rows"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class Snapshot(Callback):
    """The module's parameters at the start of the batch of ``step``."""

    def __init__(self, step):
        self.step, self.params = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_a_nan_loss_stops_the_fit_before_its_backward(tmp_path):
    torch.manual_seed(0)
    model, snap = NaNAt({2}), Snapshot(2)
    trainer = make_trainer(tmp_path, [ltd(max_value=16), snap], max_steps=5, max_epochs=-1)
    with pytest.raises(NonFiniteLossError, match=r"^RandomLTDCallback: the training loss is nan at step 2; stopped"):
        trainer.fit(model, datamodule=tiny_lm_data())
    assert trainer.global_step == 2 and snap.params is not None
    state = model.state_dict()
    assert all(torch.equal(state[k], snap.params[k]) for k in state)  # the NaN step changed nothing
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_warn_counts_each_nan_step_logs_reports_and_resumes_exactly(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    def fit(root, ckpt_path=None):
        torch.manual_seed(0)
        cb, rows = ltd(max_value=16, nonfinite_loss="warn"), Rows()
        every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, monitor=None)
        callbacks = [cb] if ckpt_path else [cb, every]
        trainer = make_trainer(root, callbacks, max_steps=5, max_epochs=-1, logger=rows)
        trainer.fit(NaNAt({1, 3}, times=False), datamodule=tiny_lm_data(), ckpt_path=ckpt_path)
        key = "effi/nonfinite_losses"
        return trainer, cb, [(step, m[key]) for step, m in rows.rows if key in m]

    with pytest.warns(UserWarning, match=r"RandomLTDCallback: the training loss is nan at step 1 \(nonfinite_loss="):
        trainer, cb, logged = fit(tmp_path / "full")
    assert trainer.global_step == 5 and (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (2, 1)
    # logged in each batch's row (Lightning's logging step: the steps taken before it): NaN losses at steps 1 and 3
    assert logged == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]
    assert "RandomLTDCallback: 2 non-finite training losses (the first at step 1)" in caplog.text
    ckpt = next((tmp_path / "ck").glob("*step=2.ckpt"))
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    assert [s["nonfinite_loss"] for k, s in saved.items() if k.startswith("RandomLTD")] == [
        {"count": 1, "first_step": 1}
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*training loss is nan.*")  # the first one was before the resume
        resumed, cb2, logged = fit(tmp_path / "resumed", ckpt_path=str(ckpt))
    assert resumed.global_step == 5 and cb2.nonfinite_guard.state_dict() == cb.nonfinite_guard.state_dict()
    assert logged == [(2, 1.0), (3, 2.0), (4, 2.0)]  # the rows of steps 3-5, as in the uninterrupted fit


def test_a_bad_nonfinite_policy_is_refused():
    with pytest.raises(ValueError, match=r"RandomLTDCallback.nonfinite_loss must be one of \('raise', 'warn'\)"):
        RandomLTDCallback(nonfinite_loss="skip")
    assert "nonfinite_loss='warn'" in repr(RandomLTDCallback(nonfinite_loss="warn"))


# ------------------------------------------------------------------------------------------------ hook order
class Lazy(pl.LightningModule):
    """Builds its GPT-2 in ``configure_model`` or ``setup`` (``hook``), after the callbacks' setup."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook, self.net = hook, None

    def _build(self) -> None:
        if self.net is None:
            self.net = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_layer=4, n_embd=32, n_head=2))

    def configure_model(self) -> None:
        if self.hook == "configure_model":
            self._build()

    def setup(self, stage: str) -> None:
        if self.hook == "setup":
            self._build()

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("hook", ["configure_model", "setup"])
def test_a_network_built_after_the_callbacks_setup_is_named_with_the_hook_order(tmp_path, hook):
    """A network built in ``configure_model`` / ``setup`` does not exist at random-LTD's setup (Lightning runs the
    callbacks' setup first): refused there naming the hooks the module overrides, the order and the remedy, with the
    adapter search's own message after it. A module overriding neither keeps the search's message alone."""
    seen = Seen()
    trainer = make_trainer(tmp_path, [ltd(), seen], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError) as err:
        trainer.fit(Lazy(hook), datamodule=tiny_lm_data())
    msg = str(err.value)
    assert msg.startswith(
        "RandomLTDCallback: no network in Lazy at the callback's setup, and Lazy overrides Lazy.setup() / "
        "Lazy.configure_model(): Lightning runs every callback's setup before LightningModule.setup and "
        "configure_model, so a network built there does not exist yet when RandomLTDCallback looks for it"
    )
    assert "Build the network in Lazy.__init__ (the search for it: adapter: no model inside Lazy matches" in msg
    assert seen.batches == 0

    class Empty(pl.LightningModule):
        pass

    trainer = make_trainer(tmp_path / "b", [ltd()], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match=r"^adapter: no model inside Empty matches any registered adapter") as err:
        ltd().setup(trainer, Empty(), "fit")
    assert "overrides" not in str(err.value)


def test_no_adapter_names_the_stack_of_blocks_a_generic_adapter_would_take():
    """A hand-written transformer matches no registered adapter: the error names the ModuleList of identical blocks
    (the user looked for the path, then met the hidden_size error next); the suggested adapter then works."""
    from lightning_effi.models.base import find_adapter

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.fc1(x).relu())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Embedding(32, 16))  # one module: not a stack
            self.blocks = nn.ModuleList(Block() for _ in range(4))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()

    with pytest.raises(ValueError) as err:
        find_adapter(Module())
    assert str(err.value).endswith(
        "or pass a lightning_effi.models.GenericAdapter(layers=...) (here, e.g. GenericAdapter(layers='model.blocks', "
        "hidden_size=<the blocks' width>): the 4 Block there; hidden_size is read from an nn.MultiheadAttention in "
        "the blocks, else it is needed)"
    )
    adapter = find_adapter(Module(), GenericAdapter(layers="model.blocks", hidden_size=16))
    assert len(adapter.layers()) == 4


def test_the_adapter_error_suggests_no_generic_adapter_over_image_convolutions():
    """A CNN's stages were suggested as GenericAdapter(layers=...), a dead end after two more refusals
    (qa51-vision 02): the error says such blocks have no tokens to drop."""
    from lightning_effi.models import find_adapter

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    class CNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.Sequential(Stage(), Stage())

    with pytest.raises(ValueError, match=r"Its stacks of blocks \('stages'\) run image convolutions, .*no") as err:
        find_adapter(CNN())
    assert "here, e.g. GenericAdapter" not in str(err.value)

    class GNN(pl.LightningModule):  # a Linear per hop on [N, H] node features: no blocks either (qa54-domains 06)
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    with pytest.raises(ValueError, match=r"\('convs'\) run .* or single layers") as err:
        find_adapter(GNN())
    assert "here, e.g. GenericAdapter" not in str(err.value)


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_a_seed_outside_the_generators_range_is_refused(seed):
    """Seeds are hashed to 64 bits: ``2**64`` drew seed 0's tokens and ``-1`` those of ``2**64 - 1``, silently."""
    with pytest.raises(ValueError, match=r"RandomLTDCallback.seed must be an int >= 0 and <= 18446744073709551615"):
        RandomLTDCallback(seed=seed)


def test_a_run_that_drops_no_token_warns_at_its_end(tmp_path, monkeypatch):
    """Under a curriculum the length checks at setup compare against the curriculum's range; when the training set is
    too large to read (here: its reading switched off), a min_value at the data's longest sample (16 tokens, padded
    per batch) passes and random-LTD drops nothing. The run's end says so, naming the longest batch seen; a run that
    drops tokens does not warn."""
    import lightning_effi.curriculum.callback as curriculum_callback
    from lightning_effi.curriculum import Curriculum, CurriculumDataModule
    from lightning_effi.reference.data.base import PaddingCollate
    from tests.helpers.tiny import Sentences

    monkeypatch.setattr(curriculum_callback, "data_longest_sequence", lambda *args: None)
    sentences = [{"input_ids": x} for x in Sentences().items]  # 3 to 16 tokens, no labels
    data = TinyDataModule(sentences, collate_fn=PaddingCollate(pad_token_id=0), batch_size=4)

    def run(root, min_value):
        cb = ltd(min_value=min_value, require_steps=2)
        trainer = make_trainer(root, [Curriculum(metrics=seqlen_truncate(max_difficulty=32)), cb], max_steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(deep_gpt2(), datamodule=CurriculumDataModule(data))
        return cb, [str(w.message) for w in caught if "no token was dropped" in str(w.message)]

    cb, warned = run(tmp_path / "none", 16)
    assert cb.consumed_layer_tokens == cb.full_layer_tokens > 0
    assert warned == [
        "RandomLTDCallback: no token was dropped in this run: the reserved length (min_value=16 growing to "
        "max_value=32) was never below a batch's sequence length (the longest this fit: 14 tokens), so random-LTD "
        "saved nothing (random_ltd/layer_token_saving = 0). Lower min_value below the batches' length, or check the "
        "data's sequence length"
    ]
    cb, warned = run(tmp_path / "some", 4)
    assert cb.consumed_layer_tokens < cb.full_layer_tokens and warned == []


@pytest.mark.parametrize("bad", ["a..b", ".a", "a.", "a b", "", 3])
def test_a_malformed_model_attr_is_refused_at_construction(bad):
    """'a..b', '.a', 'a.' and 'a b' were accepted at construction (the docstring says they raise there)."""
    with pytest.raises(ValueError, match=r"RandomLTDCallback.model_attr must be a dotted attribute path"):
        RandomLTDCallback(model_attr=bad)


@pytest.mark.parametrize("path", ["towers.0.encoder", "towers.en-de", "towers.7b"])
def test_a_model_attr_may_name_a_list_position_or_a_module_dict_key(path):
    assert RandomLTDCallback(model_attr=path).model_attr == path


def test_a_first_batch_padded_without_an_attention_mask_is_told_padded():
    """A speech batch carries its rows' lengths (the model builds its mask from them), not an attention_mask: the
    explicit max_value, the data's longest length, was refused against the shorter first batch of one shuffle seed
    (qa48-speech 04). Its lengths, or a padding mask, say it is padded; equal lengths say it is not."""
    from lightning_effi.random_ltd.callback import _padded

    features = torch.zeros(3, 26, 8)
    assert _padded({"features": features, "feature_lengths": torch.tensor([26, 20, 9])})
    assert not _padded({"features": features, "feature_lengths": torch.tensor([26, 26, 26])})
    padding = torch.zeros(3, 26, dtype=torch.bool)
    assert not _padded({"x": features, "key_padding_mask": padding})
    padding[1, 20:] = True
    assert _padded({"x": features, "key_padding_mask": padding})
    assert not _padded({"x": features, "labels": torch.tensor([1, 0, 2])})
    assert _padded(
        {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1] * 4, [1, 1, 0, 0]])}
    )


def test_an_moe_model_returning_its_router_logits_is_refused_at_setup(tmp_path):
    """transformers' load-balancing loss reads every layer's router logits against the B x T tokens and the
    attention mask; a layer random-LTD drops tokens in routes B x r: a bare size mismatch inside transformers at the
    first step (qa49-moe 04)."""
    from lightning_effi.adapters import GenericAdapter
    from lightning_effi.callbacks import RandomLTDCallback
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import HFMixtralLM

    def fit(router_logits: bool) -> None:
        adapter = GenericAdapter(layers="model.model.layers", hidden_size=16, must_be_none=["cache"],
                                 seq_args={"attention_mask": [-2, -1], "position_ids": [-1],
                                           "position_embeddings": [-2]})  # fmt: skip
        ltd = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, require_steps=2, adapter=adapter)
        data = torch.utils.data.TensorDataset(torch.randint(0, 32, (8, 16)))
        make_trainer(tmp_path, [ltd], max_steps=1, max_epochs=-1).fit(
            HFMixtralLM(num_hidden_layers=3, use_cache=False, output_router_logits=router_logits),
            torch.utils.data.DataLoader(data, batch_size=4),
        )

    with pytest.raises(
        ValueError, match=r"MixtralForCausalLM returns its router logits \(config\.output_router_logits"
    ):
        fit(True)
    fit(False)  # without the router loss it trains


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(max_value=24),
            r"^RandomLTDCallback.max_value \(24\) is larger than the longest sequence the patched layers see under the "
            r"curriculum's seqlen_truncate \(16 positions: its longest batch, 16 tokens, \+0 as at the first training "
            r"batch\).* pass max_value <= 16",
        ),
        (
            dict(seq_per_step=24),
            r"^RandomLTDCallback.seq_per_step \(24\) is larger than max_value=None's end of the schedule, the longest "
            r"sequence the patched layers see under the curriculum's seqlen_truncate \(16 positions.* pass "
            r"seq_per_step <= 16",
        ),
        (dict(max_value=16), None),
        (dict(seq_per_step=16), None),
        # seqlen_reshape: rows of 4 .. 8 tokens (difficulty 3 .. 7, + 1) (qa104-regress 02)
        (
            dict(max_value=16, reshape=True),
            r"^RandomLTDCallback.max_value \(16\) is larger than the longest sequence the patched layers see under the "
            r"curriculum's seqlen_reshape \(8 positions",
        ),
        (dict(seq_per_step=12, reshape=True), r"^RandomLTDCallback.seq_per_step \(12\) is larger than .*\(8 positions"),
        (dict(max_value=8, reshape=True), None),
    ],
)
def test_the_schedules_end_is_checked_against_the_curriculums_longest_batch(tmp_path, kwargs, match):
    """Without a curriculum an explicit max_value above the layers' length, or a seq_per_step above the derived one,
    is refused at the first batch; with one the checks were skipped (its first batches are short by design): the last
    steps dropped nothing, or the reserved length never grew, in silence (qa102-break 01). The curriculum's longest
    batch (16 of the 16-token blocks) is the length."""
    from lightning_effi.curriculum import Curriculum, CurriculumDataModule

    kwargs, metrics = dict(kwargs), seqlen_truncate(8, 16, 2, 8)
    if kwargs.pop("reshape", False):
        metrics = {"seqlen_reshape": metrics["seqlen_truncate"] | dict(min_difficulty=3, max_difficulty=7)}
        metrics["seqlen_reshape"]["schedule_config"] = dict(total_curriculum_step=2, difficulty_step=4)
    cb = ltd(**{"require_steps": 2, "min_value": 2, "seq_per_step": 2} | kwargs)
    curriculum = Curriculum(metrics=metrics)
    trainer = make_trainer(tmp_path, [curriculum, cb], max_steps=3, max_epochs=-1)
    if match is None:
        trainer.fit(deep_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
        assert trainer.global_step == 3 and cb.consumed_layer_tokens < cb.full_layer_tokens
        return
    with pytest.raises(ValueError, match=match):
        trainer.fit(deep_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
    assert trainer.global_step == 0


def test_a_reshaped_curriculums_end_moves_with_a_step_that_shifts_its_own_labels(tmp_path):
    """seqlen_reshape's rows of d + 1 tokens fed as rows[:, :-1] (Megatron's convention): the layers see 7 positions
    at the longest rows of 8. The derived max_value stayed 8, and seq_per_step=8 trained in silence (qa105-regress
    02); it now moves by the first batch's offset, as under seqlen_truncate."""
    from lightning_effi.curriculum import Curriculum, CurriculumDataModule
    from lightning_effi.reference.tasks.language_models import token_losses_per_sample

    class ShiftingGPT2(GPT2CausalLM):
        def model_inputs(self, batch):
            return {"input_ids": batch["input_ids"][:, :-1]}

        def per_sample_loss(self, batch):
            logits = self.model(input_ids=batch["input_ids"][:, :-1]).logits
            targets = batch["input_ids"][:, 1:]
            return token_losses_per_sample(logits, targets), (logits, targets)

    metrics = {"seqlen_reshape": seqlen_truncate(3, 7, 2, 4)["seqlen_truncate"]}  # rows of 4 .. 8 tokens

    def fit(**kw):
        cb = ltd(**{"min_value": 2, "require_steps": 2, "seq_per_step": 1} | kw)
        trainer = make_trainer(tmp_path, [Curriculum(metrics=metrics), cb], max_steps=3, max_epochs=-1)
        model = ShiftingGPT2(**{**TINY_GPT2, "optimizer": sgd, "n_layer": 4})
        trainer.fit(model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
        return cb

    assert fit().max_value == 7
    with pytest.raises(ValueError, match=r"seq_per_step \(8\) is larger than .*\(7 positions"):
        fit(seq_per_step=8)


def test_a_derived_max_value_with_positions_in_front_of_the_ids_resumes(tmp_path):
    """max_value=None derived from the positions the layers see (16 ids + 4 soft prompt positions = 20) was compared
    on resume with the 16 ids peeked from the data, and the resume refused as "on other data" (qa114-rl 02: prompts
    peeked, prompt and generated tokens trained). It resumes, with the checkpoint's max_value."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    first = ltd()
    make_trainer(tmp_path, [first, ckpt], max_steps=2, max_epochs=-1).fit(SoftPrompted(4), datamodule=tiny_lm_data())
    assert first.max_value == 20
    again = ltd()
    trainer = make_trainer(tmp_path / "r", [again], max_steps=4, max_epochs=-1)
    trainer.fit(SoftPrompted(4), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert trainer.global_step == 4 and again.max_value == 20


def test_a_min_value_above_a_short_first_batch_of_varying_lengths_warns(tmp_path):
    """Samples of different lengths (text padded per batch, images of changing resolution): a min_value above the
    first batch's length was refused as "would never drop a token" although longer batches drop (refused or trained
    by which batch came first, qa114-dense 03). It warns, and the longer batches drop tokens."""
    from lightning_effi.reference.data.base import PaddingCollate

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 64, (8 if i < 4 else 16,), generator=g)} for i in range(12)]

    class Rows(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(rows, batch_size=4, collate_fn=PaddingCollate(pad_token_id=0))

    cb = ltd(min_value=10, seq_per_step=1, require_steps=100)
    trainer = make_trainer(tmp_path, [cb], max_steps=3, max_epochs=-1)
    with pytest.warns(
        UserWarning, match=r"min_value \(10\) is not below the sequence length .* \(8 tokens at the first"
    ):
        trainer.fit(deep_gpt2(), datamodule=Rows())
    assert trainer.global_step == 3 and cb.max_value == 16 and cb.consumed_layer_tokens < cb.full_layer_tokens


class GrowingPrompt(SoftPrompted):
    """A prefix of 2 to 6 positions (by the batch's first id) in front of the 16 ids: the layers see 18 to 22
    positions, varying from batch to batch, as a rollout's prompt and generated tokens do."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        extra = 2 + int(ids[0, 0]) % 5
        x = torch.cat([self.prompt[:, :extra].expand(len(ids), -1, -1), self.model.transformer.wte(ids)], 1)
        return self.model(inputs_embeds=x).logits.logsumexp(-1).mean()


def test_a_derived_max_value_of_varying_layer_lengths_resumes(tmp_path):
    """The layers see lengths that vary from batch to batch beyond the ids' fixed 16 (generated tokens): the resume
    was refused when its first batch was shorter than the longest seen before (18 below 22, qa115-regress 03). The
    first batch bounds nothing then: it resumes."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    first = ltd()
    make_trainer(tmp_path, [first, ckpt], max_steps=2, max_epochs=-1).fit(GrowingPrompt(6), datamodule=tiny_lm_data())
    again = ltd()
    trainer = make_trainer(tmp_path / "r", [again], max_steps=6, max_epochs=-1)
    trainer.fit(GrowingPrompt(6), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert trainer.global_step == 6 and again.max_value >= first.max_value
