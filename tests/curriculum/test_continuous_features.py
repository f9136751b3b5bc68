"""The curriculum's seqlen truncation and the EfficiencyMonitor on a series of continuous features ``[B, T, D]``
(no token ids): a time-series / audio classifier over ``nn.TransformerEncoder``, dict batches with
``truncate_keys``. The tokens of such a batch are its positions; the untruncated batch's are counted for the
baseline, the curriculum's token clock moves, and a padding mask the monitor cannot read is said."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_effi import EfficiencyMonitor
from lightning_effi.callbacks import Curriculum
from lightning_effi.curriculum import CurriculumConfigError
from lightning_effi.data import CurriculumDataModule
from tests.helpers.harness import make_trainer

T, B, STEPS = 24, 16, 8


class Series(Dataset):
    """128 series of 24 steps x 4 features; ``pad`` trailing steps of each are padding (``padding_mask`` True)."""

    def __init__(self, pad: int = 0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.pad = torch.randn(128, T, 4, generator=g), torch.randint(0, 3, (128,), generator=g), pad

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        padding = torch.zeros(T, dtype=torch.bool)
        padding[T - self.pad :] = True
        return {"series": self.x[i], "padding_mask": padding, "label": self.y[i]}


def label(batch) -> torch.Tensor:
    """A per-sample difficulty: the label of ``(image, label)`` batches."""
    return batch[1]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 16), nn.Linear(16, 3)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.positions = 0  # the time steps trained

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.positions += batch["series"].shape[0] * batch["series"].shape[1]
        hidden = self.enc(self.inp(batch["series"]), src_key_padding_mask=batch["padding_mask"])
        return F.cross_entropy(self.head(hidden.mean(1)), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), 1e-3)


class Data(pl.LightningDataModule):
    def __init__(self, pad: int = 0) -> None:
        super().__init__()
        self.pad = pad

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Series(self.pad), batch_size=B, shuffle=True)


def truncation(**kw) -> Curriculum:
    schedule = dict(total_curriculum_step=8, difficulty_step=4)
    metric = dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8, max_difficulty=T,
                  schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
    return Curriculum(metrics={"seqlen_truncate": metric}, truncate_keys=["series", "padding_mask"], seed=3, **kw)


def test_a_truncated_series_counts_its_positions_and_the_untruncated_ones_for_the_baseline(tmp_path):
    """The monitor's baseline took the untruncated batch's tokens as equal to the trained ones (a 0 token saving
    next to a 0.388 FLOPs saving), and the curriculum counted 0 consumed tokens, so Curriculum(total_tokens=...)'s
    progress stayed at 0 (the helper's run)."""
    pl.seed_everything(0)
    monitor, curriculum, module = EfficiencyMonitor(print_summary=False), truncation(total_tokens=STEPS * B * T), None
    module = Classifier()
    trainer = make_trainer(tmp_path, [monitor, curriculum], max_steps=STEPS, max_epochs=-1)
    trainer.fit(module, datamodule=CurriculumDataModule(Data()))
    s, full = monitor.summary, STEPS * B * T
    assert module.positions < full and s["tokens"] == module.positions and s["baseline_tokens"] == full
    assert s["tokens_saved_frac"] == pytest.approx(1 - module.positions / full), s
    assert curriculum.consumed_tokens == module.positions
    assert curriculum.effi_progress() == pytest.approx(module.positions / full)


class WithTargets(Dataset):
    """:class:`Series` with a transcript: ``targets [5]`` integer labels (CTC targets), no input of the blocks."""

    def __init__(self) -> None:
        self.series = Series()

    def __len__(self) -> int:
        return len(self.series)

    def __getitem__(self, i: int) -> dict:
        item = self.series[i]
        return {"series": item["series"], "targets": torch.full((5,), int(item["label"])), "label": item["label"]}


def test_a_range_refused_against_ctc_targets_says_where_the_length_was_read(tmp_path):
    """With truncate_keys=None a CTC batch's sequence length is read from its integer targets: a range in frames
    (8 to 24) was refused as above "5 tokens", advising max_difficulty=5, the transcript's length, before the refusal
    naming truncate_keys (qa111-audio 03). The refusal says where the length was read and names truncate_keys."""

    class Targets(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(WithTargets(), batch_size=B)

    schedule = dict(total_curriculum_step=8, difficulty_step=4)
    metric = dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8, max_difficulty=T,
                  schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": metric})], max_steps=2)
    with pytest.raises(
        CurriculumConfigError,
        match=r"max_difficulty \(24\) is above the training data's sequence length: its batches hold 5 tokens.* "
        r"\(the data's sequence "
        r"length was read from 'targets', the batch's first integer \[B, T\] tensor, as truncate_keys=None reads it: "
        r"if the sequence to cut is another tensor, .* name it: truncate_keys=\[its name\]\)$",
    ):
        trainer.fit(Classifier(), datamodule=CurriculumDataModule(Targets()))


def test_cut_features_beside_integer_targets_count_the_uncut_frames_for_the_baseline(tmp_path):
    """A feature-level CTC batch: the blocks see the frames, the only integer [B, U] tensor is the targets. The
    monitor counts the blocks' positions, but its baseline took the uncut targets plus the same extra positions,
    so the token saving read 0 (qa53-asr 02). The baseline counts the uncut frames."""

    class Targets(Data):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(WithTargets(), batch_size=B, shuffle=True)

    class CTCLike(Classifier):
        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            self.positions += batch["series"].shape[0] * batch["series"].shape[1]
            return F.cross_entropy(self.head(self.enc(self.inp(batch["series"])).mean(1)), batch["targets"][:, 0])

    pl.seed_everything(0)
    monitor, module = EfficiencyMonitor(print_summary=False), CTCLike()
    schedule = dict(total_curriculum_step=8, difficulty_step=4)
    metric = dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8, max_difficulty=T,
                  schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
    curriculum = Curriculum(metrics={"seqlen_truncate": metric}, truncate_keys=["series"], seed=3)
    trainer = make_trainer(tmp_path, [monitor, curriculum], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layout's warnings (a transcript beside cut frames), tested elsewhere
        trainer.fit(module, datamodule=CurriculumDataModule(Targets()))
    s, full = monitor.summary, STEPS * B * T
    assert module.positions < full and s["tokens"] == module.positions and s["baseline_tokens"] == full, s
    assert s["layer_tokens"] == 2 * module.positions and s["baseline_layer_tokens"] == 2 * full
    assert s["tokens_saved_frac"] == pytest.approx(1 - module.positions / full), s


def test_a_padding_mask_the_monitor_cannot_read_is_said_and_total_tokens_without_tokens_is_refused(tmp_path):
    pl.seed_everything(0)
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path / "pad", [monitor], max_steps=2, max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Classifier(), datamodule=Data(pad=6))
    said = [str(w.message) for w in caught if "looks like a padding mask" in str(w.message)]
    assert len(said) == 1 and "'padding_mask'" in said[0] and "attention_mask" in said[0]
    assert monitor.summary["tokens"] == 2 * B * T  # the positions, padding included (as said)

    class Images(pl.LightningDataModule):  # no sequence: the token clock has nothing to count
        def train_dataloader(self) -> DataLoader:
            return DataLoader([(torch.randn(3, 4, 4), 0)] * 32, batch_size=8)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(48, 2)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.lin(batch[0].flatten(1)), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    schedule = dict(total_curriculum_step=4, difficulty_step=1)
    metric = dict(difficulty_type="value", clustering_type="schedule_based", min_difficulty=0, max_difficulty=1,
                  schedule_type="fixed_linear", schedule_config=schedule, analysis=label)  # fmt: skip
    curriculum = Curriculum(metrics={"label": metric}, total_tokens=10)
    trainer = make_trainer(tmp_path / "images", [curriculum], max_steps=2, max_epochs=-1)
    with pytest.raises(CurriculumConfigError, match=r"total_tokens=10\): the training batch has no tokens to count"):
        trainer.fit(Net(), datamodule=CurriculumDataModule(Images()))


def _speech_batch(lengths: list[int], tuple_batch: bool = False):
    """A speech batch as its collate pads it: log-mel features [B, T, 80], their lengths, CTC targets [B, L] and
    their lengths."""
    torch.manual_seed(0)
    t = max(lengths)
    features = torch.zeros(len(lengths), t, 80)
    for i, n in enumerate(lengths):
        features[i, :n] = torch.randn(n, 80)
    targets = torch.randint(1, 20, (len(lengths), 12))
    fields = (features, torch.tensor(lengths), targets, torch.full((len(lengths),), 12))
    if tuple_batch:
        return fields
    return dict(zip(("features", "feature_lengths", "targets", "target_lengths"), fields))


def test_the_rows_lengths_are_clamped_to_the_cut_and_given_back_when_lengthened():
    """seqlen_truncate cut the features to 48 frames and left feature_lengths saying up to 117 (qa48-speech 01), also
    when it was named in truncate_keys (02); HF names (input_features with feature_lengths, a `length` column) and
    stems that name no tensor (token_lengths, seq_len) too. The lengths now say what each cut row holds, and
    lengthen_batch gives back the originals. Class labels, named or in a tuple, are left as they are."""
    from lightning_effi.curriculum import functional as CF

    features = _speech_batch([117, 60, 90, 30])["features"]
    lengths = torch.tensor([117, 60, 90, 30])
    for keys in (["features"], ["features", "feature_lengths"]):
        cut = CF.truncate({"features": features, "feature_lengths": lengths}, 48, keys=keys)
        assert cut.batch["features"].shape == (4, 48, 80)
        assert cut.batch["feature_lengths"].tolist() == [48, 48, 48, 30]
        long = CF.lengthen_batch(cut.batch, keys, 117, axes=dict(zip(cut.cut, cut.axes)), values=cut.cut_values)
        assert long["feature_lengths"].tolist() == [117, 60, 90, 30] and long["features"].shape == (4, 117, 80)
    ids = torch.randint(1, 9, (4, 117))
    mask = (torch.arange(117) < lengths[:, None]).long()
    for name in ("length", "token_lengths", "seq_len", "input_ids_lengths"):
        cut = CF.truncate({"input_ids": ids, "attention_mask": mask, name: lengths}, 48)
        assert cut.batch[name].tolist() == [48, 48, 48, 30], name
    hf = CF.truncate({"input_features": features, "attention_mask": mask, "feature_lengths": lengths}, 48)
    assert hf.batch["feature_lengths"].tolist() == [48, 48, 48, 30]
    # not lengths: class labels named in truncate_keys, a tuple's labels that reach T, another tensor's lengths
    labels = torch.tensor([3, 117, 7, 1])
    named = CF.truncate({"input_ids": ids, "labels": labels}, 48, keys=["input_ids", "labels"])
    assert named.batch["labels"].tolist() == [3, 117, 7, 1] and named.batch["input_ids"].shape == (4, 48)
    assert CF.truncate((ids, labels), 48).batch[1].tolist() == [3, 117, 7, 1]
    other = CF.truncate({"input_ids": ids, "image_lengths": lengths}, 48)
    assert other.batch["image_lengths"].tolist() == [117, 60, 90, 30]
    # a NamedTuple's field names are read (qa50-break 03)
    from typing import NamedTuple

    class Batch(NamedTuple):
        input_ids: torch.Tensor
        lengths: torch.Tensor

    named_tuple = CF.truncate(Batch(ids, lengths), 48)
    assert isinstance(named_tuple.batch, Batch) and named_tuple.batch.lengths.tolist() == [48, 48, 48, 30]
    # ... and its fields can be named in truncate_keys, as a dataclass's: nothing was cut, and without keys the
    # transcript was cut beside the whole frames, warned as a plain tuple's "entry '2'" (qa51-break 05)

    class Speech(NamedTuple):
        features: torch.Tensor
        feature_lengths: torch.Tensor
        targets: torch.Tensor
        target_lengths: torch.Tensor

    speech = Speech(*_speech_batch([117, 60, 90, 30], True))
    keys = ["features", "feature_lengths"]
    with pytest.warns(UserWarning, match=r"leaves 'targets'"):
        cut = CF.truncate(speech, 48, keys=keys)
    assert isinstance(cut.batch, Speech) and cut.batch.features.shape == (4, 48, 80)
    assert cut.batch.feature_lengths.tolist() == [48, 48, 48, 30] and cut.batch.targets.shape == (4, 12)
    long = CF.lengthen_batch(cut.batch, keys, 117, axes=dict(zip(cut.cut, cut.axes)), values=cut.cut_values)
    assert isinstance(long, Speech) and long.features.shape == (4, 117, 80)
    assert long.feature_lengths.tolist() == [117, 60, 90, 30]
    with pytest.raises(ValueError, match=r"length 12 was read from 'targets', .* beside 'features' \[4, 117, 80\]"):
        CF.truncate(speech, 6)


def test_integer_targets_beside_features_of_another_length_are_refused_or_warned():
    """The first integer [B, T] tensor (token ids by default) was a speech batch's CTC targets: they were cut, the
    audio features left whole, and CTC failed later naming neither (qa48-speech 03). A dict batch is refused
    (truncate_keys names the features); a tuple batch, whose entries cannot be named, is warned (image features
    beside token ids are right, qa49-break 09). Features cut beside targets kept whole (their transcript) are
    refused, with an attention_mask too (qa49-break 01)."""
    from lightning_effi.curriculum import functional as CF

    batch = _speech_batch([117, 60, 90, 30])
    message = r"length 12 was read from 'targets', .* beside 'features' \[4, 117, 80\]"
    with pytest.raises(ValueError, match=message):
        CF.truncate(batch, 6)
    tuple_batch = _speech_batch([117, 60], True)
    with pytest.warns(UserWarning, match=r"read from its entry '2'.* return a dict batch and name it in truncate_keys"):
        cut = CF.truncate(tuple_batch, 6)
    assert cut.batch[2].shape == (2, 6) and cut.batch[0].shape == (2, 117, 80)
    # named in truncate_keys, what is cut is the user's choice: the targets stay whole (clip-level class indices
    # beside cut frames, qa50-break 07)
    with pytest.warns(UserWarning, match=r"leaves 'targets', targets .*\(Warned, not refused"):
        chosen = CF.truncate(batch, 48, keys=["features", "feature_lengths"])
    assert chosen.batch["targets"].shape == (4, 12) and chosen.batch["feature_lengths"].tolist() == [48, 48, 48, 30]
    # ESPnet's names: `text` is the transcript (refused without keys), `text_lengths` its lengths, not the speech's
    # (qa50-break 08)
    espnet = {"speech": batch["features"], "speech_lengths": batch["feature_lengths"], "text": batch["targets"],
              "text_lengths": torch.tensor([12, 10, 9, 11])}  # fmt: skip
    with pytest.raises(ValueError, match=r"length 12 was read from 'text'"):
        CF.truncate(espnet, 6)
    with pytest.warns(UserWarning, match=r"leaves 'text', targets of the whole sample"):
        cut = CF.truncate(espnet, 48, keys=["speech"])
    assert cut.batch["speech_lengths"].tolist() == [48, 48, 48, 30]
    assert cut.batch["text_lengths"].tolist() == [12, 10, 9, 11] and cut.batch["text"].shape == (4, 12)
    mask = (torch.arange(117) < batch["feature_lengths"][:, None]).long()
    hf = {"input_features": batch["features"], "attention_mask": mask, "labels": batch["targets"]}
    with pytest.raises(ValueError, match=r"leaves 'labels' \[4, 12\], targets of the whole sample"):
        CF.truncate(hf, 48)
    # token ids cut beside labels of another length (a classifier's multi-hot labels): no transcript
    text = {"input_ids": torch.randint(1, 9, (4, 117)), "labels": torch.randint(0, 2, (4, 12))}
    assert CF.truncate(text, 48).batch["labels"].shape == (4, 12)
    # frames beside multi-hot clip labels (audio tagging), or beside a caption's ids (audio-text contrastive): cut
    # (qa50-break 01)
    tagging = {"input_features": batch["features"], "attention_mask": mask, "labels": torch.randint(0, 2, (4, 10))}
    assert CF.truncate(tagging, 48).batch["input_features"].shape == (4, 48, 80)
    clap = {"input_features": batch["features"], "attention_mask": mask, "text_input_ids": batch["targets"]}
    assert CF.truncate(clap, 48).batch["text_input_ids"].shape == (4, 12)
    # lhotse's batch: the transcripts as text, a list of B strings, were never looked at (qa51-break 03)
    lhotse = {"inputs": batch["features"], "supervisions": {"num_frames": batch["feature_lengths"],
              "text": ["a cat", "the dog", "hello", "yes"]}}  # fmt: skip
    with pytest.warns(UserWarning, match=r"leaves 'supervisions.text', targets of the whole sample"):
        cut = CF.truncate(lhotse, 48, keys=["inputs"])
    assert cut.batch["supervisions"]["num_frames"].tolist() == [48, 48, 48, 30]


def test_ctc_targets_beside_raw_audio_are_refused_or_warned():
    """Raw audio is [B, S] (wav2vec2's input_values, NeMo's audio signal): only [B, S, ...] features of 3 dimensions
    were seen beside the targets, so the transcripts were cut to d labels and the clips left whole, in silence
    (qa51-break 01, 02). [B, D] float tensors beside token ids (an embedding, soft labels) are left alone."""
    from lightning_effi.curriculum import functional as CF

    g = torch.Generator().manual_seed(0)
    audio, labels = torch.randn(4, 5200, generator=g), torch.randint(1, 30, (4, 15), generator=g)
    with pytest.raises(ValueError, match=r"length 15 was read from 'labels', .* beside 'input_values' \[4, 5200\]"):
        CF.truncate({"input_values": audio, "labels": labels}, 8)
    nemo = (audio, torch.tensor([5200, 4000, 3000, 5200]), labels, torch.tensor([15, 12, 9, 15]))
    with pytest.warns(UserWarning, match=r"read from its entry '2'.* beside entry '0'"):
        cut = CF.truncate(nemo, 8)
    assert cut.batch[0].shape == (4, 5200)  # a tuple's entries cannot be named: warned, cut as before
    # a plain key, told by its lengths (the padded longest) (qa52-break 02)
    plain = {"x": audio, "x_lens": torch.tensor([5200, 4000, 3000, 5200]), "y": labels}
    with pytest.raises(ValueError, match=r"length 15 was read from 'y', .* beside 'x' \[4, 5200\]"):
        CF.truncate(plain, 8)
    ids = torch.randint(1, 9, (4, 32), generator=g)
    embedding = {"input_ids": ids, "image_embeds": torch.randn(4, 512)}
    soft = {"input_ids": ids, "soft_labels": torch.rand(4, 100)}
    # pooled embeddings named after audio, and a word that only starts like one (qa52-break 03)
    pooled = [{"input_ids": ids, name: torch.randn(4, 512)} for name in ("audio_emb", "speech_embedding", "wavelets")]
    for batch in (embedding, soft, (ids, torch.rand(4, 100)), *pooled):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert CF.truncate(batch, 8).batch is not batch


def test_consumed_tokens_of_integer_targets_beside_features_of_another_length_are_warned_or_refused():
    """consumed_tokens counted a speech batch's padded CTC targets as its tokens (256 where the model trained 696
    frames; qa48-speech 05): warned once, and refused with total_tokens, whose progress would follow it."""
    from tests.helpers.tiny import seqlen_truncate

    batch = _speech_batch([117, 60, 90, 30])
    module = nn.Linear(1, 1)
    callback = Curriculum(metrics=seqlen_truncate())
    with pytest.warns(UserWarning, match=r"consumed_tokens counts the batch's integer \[4, 12\] tensor .* 'features'"):
        assert callback._batch_tokens(batch, module) == 4 * 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callback._batch_tokens(batch, module) == 4 * 12  # once
    limited = Curriculum(metrics=seqlen_truncate(), total_tokens=10_000)
    with pytest.raises(CurriculumConfigError, match=r"Curriculum\(total_tokens=10000\) would follow that count"):
        limited._batch_tokens(batch, module)
    text = {"input_ids": torch.randint(0, 9, (4, 12)), "labels": torch.randint(0, 9, (4,))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert limited._batch_tokens(text, module) == 48
        # ids named input_ids are the tokens, beside a vision-language batch's features (qa50-break 02)
        assert limited._batch_tokens(text | {"visual_embeds": torch.randn(4, 49, 16)}, module) == 48


def test_speech_toolkit_layouts_relative_lengths_token_transcripts_and_channel_first_features():
    """SpeechBrain's relative lengths were left as they were beside a cut clip (qa53-asr 01); transcripts named
    `tokens` / `token_ids` beside cut audio were not warned (03); Whisper's channel-first [B, 80, 3000] features were
    cut on their mel bins (04); batch-first features of 40, 64, 80 or 128 frames were refused as channel first
    (qa54-break 01); relative lengths whose longest row is not 1.0, and float lengths in samples, were left whole
    (qa54-break 06)."""
    from lightning_effi.curriculum import functional as CF

    g = torch.Generator().manual_seed(0)
    audio, ids = torch.randn(4, 16000, generator=g), torch.randint(2, 30, (4, 12), generator=g)
    relative = torch.tensor([1.0, 0.75, 0.5, 0.25])
    for keys in (["sig"], ["sig", "sig_lens"]):
        with pytest.warns(UserWarning, match=r"leaves 'tokens', targets of the whole sample"):
            cut = CF.truncate({"sig": audio, "sig_lens": relative, "tokens": ids}, 8000, keys=keys)
        assert cut.batch["sig"].shape == (4, 8000) and cut.batch["sig_lens"].tolist() == [1.0, 1.0, 1.0, 0.5]
        back = CF.lengthen_batch(cut.batch, keys, 16000, axes=dict(zip(cut.cut, cut.axes)), values=cut.cut_values)
        assert back["sig_lens"].tolist() == relative.tolist()
    # relative lengths of a batch padded past its longest clip, or rounded below 1; lengths in samples as floats
    # (qa54-break 06)
    for lens, cut_lens in (([0.75, 0.5, 0.5, 0.25], [1.0, 1.0, 1.0, 0.5]),
                           ([0.99999994, 0.75, 0.5, 0.25], [1.0, 1.0, 1.0, 0.5]),
                           ([16000.0, 12000.0, 8000.0, 4000.0], [8000.0, 8000.0, 8000.0, 4000.0])):  # fmt: skip
        cut = CF.truncate({"sig": audio, "sig_lens": torch.tensor(lens)}, 8000, keys=["sig"])
        assert cut.batch["sig_lens"].tolist() == pytest.approx(cut_lens)
        back = CF.lengthen_batch(cut.batch, ["sig"], 16000, axes=dict(zip(cut.cut, cut.axes)), values=cut.cut_values)
        assert back["sig_lens"].tolist() == torch.tensor(lens).tolist()
    frames = torch.randn(4, 100, 80, generator=g)
    with pytest.warns(UserWarning, match=r"leaves 'token_ids', targets"):
        CF.truncate({"inputs": frames, "num_frames": torch.tensor([100, 75, 50, 25]), "token_ids": ids}, 40,
                    keys=["inputs"])  # fmt: skip
    whisper = {"input_features": torch.randn(4, 80, 3000, generator=g), "labels": ids}
    with pytest.raises(ValueError, match=r"'input_features' \[4, 80, 3000\] looks channel first"):
        CF.truncate(whisper, 40, keys=["input_features"])
    # torchaudio's MelSpectrogram [B, n_mels, T] told by its frame lengths or its frames' mask
    torchaudio_mel = torch.randn(4, 80, 200, generator=g)
    frame_lengths = torch.tensor([200, 150, 100, 50])
    for told in ({"mel_lengths": frame_lengths}, {"mel_mask": torch.ones(4, 200)}, {"lengths": frame_lengths},
                 {"input_lengths": frame_lengths}, {"mel_lengths": frame_lengths.float()},
                 {"mel_lens": frame_lengths / 200}, {}):  # fmt: skip
        # generic length names, float and relative lengths, none: refused too (qa55-break 03)
        with pytest.raises(ValueError, match=r"'mel' \[4, 80, 200\] looks channel first"):
            CF.truncate({"mel": torchaudio_mel, **told}, 40, keys=["mel"])
    # Whisper's features beside their frames' mask: only the mask was cut (qa56-break 06); a channel-first tensor of
    # other bins or another name, told by its own lengths (qa56-break 07)
    whisper_mask = {"input_features": torch.randn(2, 80, 3000, generator=g), "attention_mask": torch.ones(2, 3000)}
    with pytest.raises(ValueError, match=r"'input_features' \[2, 80, 3000\] looks channel first.*mask alone"):
        CF.truncate(whisper_mask, 100)
    for name, bins in (("mel", 96), ("spec", 80), ("x", 80)):
        told = {name: torch.randn(4, bins, 500, generator=g), f"{name}_lens": torch.tensor([500, 400, 300, 200])}
        with pytest.raises(ValueError, match=rf"'{name}' \[4, {bins}, 500\] looks channel first"):
            CF.truncate(told, 40, keys=[name])
    # fewer frames than bins ([B, 128, 100], 1 s clips), told by its own lengths whose longest is axis 2
    # (qa57-break 04: the first 50 bins were kept and the lengths clamped to 50)
    short = {"mel": torch.randn(4, 128, 100, generator=g), "mel_lengths": torch.tensor([100, 90, 80, 70])}
    with pytest.raises(ValueError, match=r"'mel' \[4, 128, 100\] looks channel first"):
        CF.truncate(short, 50, keys=["mel"])
    # a count of frames that is a bin count itself: cut on the bins after the fix of qa58-break 06 (qa59-break 01)
    for bins, frames in ((80, 64), (128, 80), (80, 40)):
        lengths = torch.tensor([frames, frames - 5, frames - 9, frames - 20])
        clips = {"mel": torch.randn(4, bins, frames, generator=g), "mel_lengths": lengths}
        with pytest.raises(ValueError, match=rf"'mel' \[4, {bins}, {frames}\] looks channel first"):
            CF.truncate(clips, 20, keys=["mel"])
    # but batch-first features padded to a fixed length whose longest row happens to equal their width are cut
    # (qa58-break 06: refused mid-run as channel first)
    fixed = {"input_features": torch.randn(4, 200, 80, generator=g), "feature_lengths": torch.tensor([80, 60, 33, 12])}
    assert CF.truncate(fixed, 8, keys=["input_features"]).batch["input_features"].shape == (4, 8, 80)
    # also to a fixed length that is a bin count, [B, 128, 80], told by its padding: the longest clips' frames beyond
    # their length are zeros, where a channel-first clip has its upper bins (qa60-break 04: refused mid-run)
    lengths = torch.tensor([80, 50, 60, 40])
    padded = torch.randn(4, 128, 80, generator=g) * (torch.arange(128)[None, :, None] < lengths[:, None, None])
    fixed = {"input_features": padded, "feature_lengths": lengths}
    cut = CF.truncate(fixed, 64, keys=["input_features", "feature_lengths"]).batch
    assert cut["input_features"].shape == (4, 64, 80) and cut["feature_lengths"].tolist() == [64, 50, 60, 40]
    # padded by repeating the last frame (F.pad's replicate mode), or with noise beside a [B, frames] mask that says
    # so (qa61-break 04: refused)
    replicated = padded.clone()
    for i, n in enumerate(lengths.tolist()):
        replicated[i, n:] = replicated[i, n - 1]
    noisy = {"input_features": torch.randn(4, 128, 80, generator=g), "feature_lengths": lengths,
             "attention_mask": (torch.arange(128)[None] < lengths[:, None]).long()}  # fmt: skip
    for told in ({"input_features": replicated, "feature_lengths": lengths}, noisy):
        assert CF.truncate(told, 64, keys=list(told)).batch["input_features"].shape == (4, 64, 80)
    # a channel-first mel [B, 128 bins, 80 frames] whose upper bins sit at a floor (band-limited audio under
    # Whisper's clamp) shows padding beyond its shorter clips on its frames' axis only (qa61-break 02: 64 bins kept)
    floor = torch.randn(4, 128, 80, generator=g)
    floor[:, 80:] = -1.5
    floor = floor.masked_fill(torch.arange(80)[None, None] >= lengths[:, None, None], -1.5)
    with pytest.raises(ValueError, match=r"'mel' \[4, 128, 80\] looks channel first"):
        CF.truncate({"mel": floor, "mel_lengths": lengths}, 64, keys=["mel"])
    generic = {"x": torch.randn(4, 50, 16, generator=g), "lengths": torch.tensor([16, 10, 12, 5])}
    assert CF.truncate(generic, 8, keys=["x"]).batch["x"].shape == (4, 8, 16)
    # lengths of another tensor beyond axis 1 tell nothing: batch-first features beside a transcript's lengths
    text = {"features": torch.randn(4, 40, 768, generator=g), "text_lengths": torch.tensor([100, 90, 80, 70])}
    assert CF.truncate(text, 16, keys=["features"]).batch["features"].shape == (4, 16, 768)
    # batch-first features whose padded length happens to be a mel-bin count: cut (qa54-break 01)
    for name, shape, lengths in (("video_features", (4, 64, 2048), None), ("features", (4, 128, 768), [128, 90]),
                                 ("mel", (4, 40, 128), [40, 30]), ("mel", (4, 80, 200), [80, 60])):  # fmt: skip
        batch = {name: torch.randn(*shape, generator=g)}
        if lengths is not None:
            batch[f"{name}_lengths"] = torch.tensor(lengths * 2)
        assert CF.truncate(batch, 32, keys=[name]).batch[name].shape == (4, 32, shape[2])
    speech2text = {"input_features": torch.randn(4, 300, 80, generator=g), "labels": ids}  # frames first: cut
    with pytest.warns(UserWarning, match="leaves 'labels'"):
        assert CF.truncate(speech2text, 40, keys=["input_features"]).batch["input_features"].shape == (4, 40, 80)


class Forecasts(Dataset):
    """32 windows of a ramp: ``past [T, 1]`` of time steps ``t .. t + T - 1`` and ``future [4, 1]``, the 4 after."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        steps = torch.arange(T + 4, dtype=torch.float32)[:, None] + 100 * i
        return {"past": steps[:T], "future": steps[T:]}


class Forecaster(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head, self.gaps, self.lengths = nn.Linear(1, 16), nn.Linear(16, 1), [], []
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        past, future = batch["past"], batch["future"]
        self.gaps.append(float((future[:, 0, 0] - past[:, -1, 0]).max()))  # 1: the window ends at the target
        self.lengths.append(past.shape[1])
        return F.mse_loss(self.head(self.enc(self.inp(past))).mean(1, keepdim=True), future[:, :1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def label_of(batch) -> torch.Tensor:
    return batch["label"]


def test_truncation_side_left_keeps_the_most_recent_steps_of_a_look_back_window(tmp_path):
    """The cut kept the first L steps of a forecaster's look-back window, L steps away from its target in silence,
    and nothing kept the last ones of an unpadded batch (qa54-domains 02): truncation_side="left" keeps them."""
    from lightning_effi.curriculum import CurriculumConfig
    from lightning_effi.curriculum import functional as CF

    batch = {"past": torch.arange(2 * T, dtype=torch.float32).view(2, T, 1), "future": torch.zeros(2, 4, 1)}
    cut = CF.truncate(batch, 8, keys=["past"], truncation_side="left")
    assert torch.equal(cut.batch["past"], batch["past"][:, -8:]) and cut.left
    back = CF.lengthen_batch(cut.batch, ["past"], T, None, cut.left, dict(zip(cut.cut, cut.axes)))
    assert back["past"].shape == (2, T, 1)
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    with pytest.raises(ValueError, match=r"truncation_side='left' .* padded on the right"):
        CF.truncate({"input_ids": ids, "attention_mask": (ids > 0).long()}, 2, truncation_side="left")
    with pytest.raises(CurriculumConfigError, match=r"truncation_side"):
        CurriculumConfig(metrics={"seqlen_truncate": truncation().config.metrics["seqlen_truncate"]},
                         truncation_side="end")  # fmt: skip
    # right padding told by lengths or by a run of pad ids without a mask: refused too (qa56-break 03)
    padded = torch.arange(1, 41).view(4, 10)
    padded[0, 5:], padded[1, 3:], padded[2, 7:] = 0, 0, 0
    for extra in ({"lengths": torch.tensor([5, 3, 7, 10])}, {}):
        with pytest.raises(ValueError, match=r"truncation_side='left' .* padded on the right"):
            CF.truncate({"input_ids": padded, **extra}, 4, truncation_side="left")
    # a gap of missing values in an observed-values mask is no padding (qa56-ts 01, qa56-break 08)
    observed = torch.ones(2, T)
    observed[0, 5], observed[1, -1] = 0, 0
    window = {"past": batch["past"], "past_observed_mask": observed, "future": batch["future"]}
    kept = CF.truncate(window, 8, keys=["past", "past_observed_mask"], truncation_side="left").batch
    assert torch.equal(kept["past_observed_mask"], observed[:, -8:])
    # the window's own mask left out of truncate_keys, a forecast target cut without them, packed position ids
    with pytest.raises(ValueError, match=r"names 'past' but not its mask 'past_mask'"):
        CF.truncate({**batch, "past_mask": torch.ones(2, T)}, 8, keys=["past"], truncation_side="left")
    # Hugging Face's time-series batch: the window's other tensors share its first word (qa57-break)
    hf = {"past_values": torch.randn(2, T), "past_observed_mask": torch.ones(2, T),
          "past_time_features": torch.randn(2, T, 3), "future_values": torch.randn(2, 4)}  # fmt: skip
    with pytest.raises(ValueError, match=r"names 'past_values' but not 'past_observed_mask' \[2, 24\]"):
        CF.truncate(hf, 8, keys=["past_values"], truncation_side="left")
    every = ["past_values", "past_observed_mask", "past_time_features"]
    assert CF.truncate(hf, 8, keys=every, truncation_side="left").batch["past_time_features"].shape == (2, 8, 3)
    # an Informer's decoder input x_dec shares the window's first word, and is another range (qa58-break 02)
    informer = {"x_enc": torch.randn(2, T, 2), "x_mark_enc": torch.randn(2, T, 4), "x_dec": torch.randn(2, T, 2)}
    kept = CF.truncate(informer, 8, keys=["x_enc", "x_mark_enc"], truncation_side="left").batch
    assert kept["x_enc"].shape == (2, 8, 2) and kept["x_dec"] is informer["x_dec"]
    with pytest.raises(ValueError, match=r"'future' holds a forecast's target steps"):
        same_length = {"past": batch["past"], "future": batch["past"].clone(), "attention_mask": torch.ones(2, T)}
        CF.truncate(same_length, 8, truncation_side="left")
    packed = {
        "input_ids": torch.arange(1, 13)[None],
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]),
    }
    with pytest.raises(ValueError, match=r"packed rows \('position_ids' restart inside a row\)"):
        CF.truncate(packed, 4, truncation_side="left")
    # under another position name (qa61-ideas 03: kept [8, 9, 0, ...] in silence); time features may wrap
    for name in ("pos_ids", "positions", "input_pos", "pos_id"):  # torchtune's input_pos (qa62-break 08)
        with pytest.raises(ValueError, match=rf"packed rows \('{name}' restart inside a row\)"):
            CF.truncate({"input_ids": packed["input_ids"], name: packed["position_ids"]}, 4, truncation_side="left")
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    with pytest.raises(ValueError, match=r"packed rows \('document_ids' change inside a row\)"):
        CF.truncate({"input_ids": packed["input_ids"], "document_ids": documents}, 4, truncation_side="left")
    one = {"input_ids": packed["input_ids"], "document_ids": torch.zeros_like(documents)}
    assert CF.truncate(one, 4, truncation_side="left").batch["input_ids"].tolist() == [[9, 10, 11, 12]]
    # positions restarting at 1, at RoBERTa's 2, or at 0 after pads of -1 are packed rows too (qa65-break 05); a pad
    # row's document id of -1 is no document (qa65-break 06)
    for rows in ([[1, 2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3]], [[2, 3, 4, 5, 6, 2, 3, 4, 5, 2, 3, 4]],
                 [[-1, -1, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]):  # fmt: skip
        with pytest.raises(ValueError, match=r"packed rows \('position_ids' restart inside a row\)"):
            CF.truncate({"input_ids": packed["input_ids"], "position_ids": torch.tensor(rows)}, 4,
                        truncation_side="left")  # fmt: skip
    padded_docs = {"input_ids": packed["input_ids"], "document_ids": torch.tensor([[-1] * 4 + [0] * 8])}
    assert CF.truncate(padded_docs, 4, truncation_side="left").batch["document_ids"].tolist() == [[0, 0, 0, 0]]
    # part-of-speech tags named pos or pos_id do not count up from 0: no positions (qa63-break 03)
    tags = {"input_ids": packed["input_ids"], "pos": torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])}
    assert CF.truncate(tags, 4, truncation_side="left").batch["pos"].tolist() == [[5, 3, 5, 8]]
    hours = {"input_ids": packed["input_ids"], "time_ids": torch.arange(20, 32)[None] % 24}
    assert CF.truncate(hours, 4, truncation_side="left").batch["time_ids"].tolist() == [[4, 5, 6, 7]]
    # a restart after a one-token document is a restart; a left-padded row's pad positions (HF fills them with 1)
    # are none (qa57-break)
    with pytest.raises(ValueError, match=r"packed rows"):
        CF.truncate({**packed, "position_ids": torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])}, 4,
                    truncation_side="left")  # fmt: skip
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    left_padded = {
        "input_ids": 5 * mask,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).masked_fill(mask == 0, 1),
    }
    kept = CF.truncate(left_padded, 3, truncation_side="left").batch["position_ids"]
    assert kept.tolist() == [[1, 2, 3], [3, 4, 5]]
    with pytest.raises(CurriculumConfigError, match=r"truncation_side='left' .* no seqlen_truncate"):
        schedule = dict(total_curriculum_step=4, difficulty_step=1)
        label = dict(difficulty_type="value", clustering_type="schedule_based", min_difficulty=0, max_difficulty=2,
                     schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
        CurriculumConfig(metrics={"label": {**label, "analysis": label_of}}, truncation_side="left")
    # through the Trainer, with the monitor's baseline of the whole windows
    schedule = dict(total_curriculum_step=4, difficulty_step=4)
    metric = dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8, max_difficulty=T,
                  schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
    curriculum = Curriculum(metrics={"seqlen_truncate": metric}, truncate_keys=["past"], truncation_side="left")

    class Windows(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Forecasts(), batch_size=4, shuffle=True)

    module, monitor = Forecaster(), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, curriculum], max_steps=4, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=CurriculumDataModule(Windows()))
    assert module.gaps == [1.0] * 4 and module.lengths[0] < T
    assert monitor.summary["baseline_tokens"] == 4 * 4 * T and monitor.summary["tokens"] == 4 * sum(module.lengths)


def test_a_channel_first_window_is_warned_at_setup(tmp_path):
    """A look-back window held ``[B, C, T]`` with more channels than steps (Electricity: 321 channels, 96 steps) was cut
    on its channels (80 -> 24 .. 64, never back), with only the below-the-data's-length warning (qa56-ts 03). Warned,
    not refused: batch-first features as wide as max_difficulty, trained short throughout, look the same
    (qa58-break 01)."""
    from lightning_effi.curriculum import functional as CF

    C, steps = 40, T

    class ChannelFirst(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict:
            return {"past": torch.randn(C, steps), "future": torch.randn(C, 4)}

    class Windows(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(ChannelFirst(), batch_size=4)

    window = {"past": torch.randn(2, C, steps)}
    assert CF.channel_first_window(window, ["past"], steps) == "past: float32[2, 40, 24]"
    assert CF.channel_first_window(window, ["past"], C) is None  # axis 1 up to its full length
    assert CF.channel_first_window({"past": torch.randn(2, steps, C)}, ["past"], C) is None
    schedule = dict(total_curriculum_step=4, difficulty_step=4)
    metric = dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8, max_difficulty=steps,
                  schedule_type="fixed_linear", schedule_config=schedule)  # fmt: skip
    curriculum = Curriculum(metrics={"seqlen_truncate": metric}, truncate_keys=["past"], truncation_side="left")
    trainer = make_trainer(tmp_path, [curriculum], max_steps=4, max_epochs=-1)

    class PerChannel(pl.LightningModule):  # a linear forecaster of each channel's steps
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(steps, 4)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.head(batch["past"]), batch["future"][:, : batch["past"].shape[1]])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    with pytest.warns(UserWarning, match=r"past: float32\[8, 40, 24\] .* channel-first \[B, C, T\] window"):
        trainer.fit(PerChannel(), datamodule=CurriculumDataModule(Windows()))
    assert trainer.global_step == 4
