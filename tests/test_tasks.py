"""Reference tasks: the per-sample-loss contract, exact per-sample values, FLOPs, and clear errors."""

import pytest
import torch
import torch.nn.functional as F

from lightning_effi.core.flops import (
    attention_recompute_flops,
    count_training_flops,
    sdpa_recomputes,
    transformer_forward_flops,
    transformer_training_flops,
)
from lightning_effi.tasks import ImageClassifier
from tests.helpers.flops import flop_counter
from tests.helpers.tiny import tiny_bert_cls, tiny_bert_mlm, tiny_cnn, tiny_gpt2, tiny_vit


def lm_batch(b=3, t=12):
    return {"input_ids": torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(0))}


def mlm_batch(b=3, t=12):
    ids = lm_batch(b, t)["input_ids"]
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 3], labels[1, 5] = 7, 8, 9  # sample 2 has no masked token
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def cls_batch():
    ids = lm_batch(4, 10)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}


def img_batch():
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(4, 3, 32, 32, generator=g), "labels": torch.tensor([0, 1, 2, 3])}


CASES = {
    "gpt2": (tiny_gpt2, lm_batch),
    "bert_mlm": (tiny_bert_mlm, mlm_batch),
    "bert_cls": (tiny_bert_cls, cls_batch),
    "cnn": (tiny_cnn, img_batch),
    "vit": (tiny_vit, img_batch),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_step_follows_the_contract(name):
    torch.manual_seed(0)
    model_fn, batch_fn = CASES[name]
    model, batch = model_fn(), batch_fn()
    batch["index"] = torch.arange(len(next(iter(batch.values()))))  # unknown keys are ignored
    out = model.training_step(batch, 0)
    b = batch["index"].numel()
    assert out["per_sample_loss"].shape == (b,) and out["per_sample_loss"].dtype == torch.float32
    assert out["per_sample_loss"].requires_grad
    torch.testing.assert_close(out["loss"], out["per_sample_loss"].mean(), rtol=0, atol=0)
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gpt2_per_sample_loss_equals_hf_loss_of_each_sample_alone():
    torch.manual_seed(0)
    model, batch = tiny_gpt2(), lm_batch()
    model.eval()
    per_sample, _ = model.per_sample_loss(batch)
    for i in range(3):
        ids = batch["input_ids"][i : i + 1]
        ref = model.model(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(per_sample[i], ref, rtol=1e-5, atol=1e-6)


def test_mlm_per_sample_loss_averages_masked_tokens_and_is_zero_without_any():
    torch.manual_seed(0)
    model, batch = tiny_bert_mlm(), mlm_batch()
    model.eval()
    per_sample, _ = model.per_sample_loss(batch)
    logits = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected1 = (F.cross_entropy(logits[1, 3], torch.tensor(8)) + F.cross_entropy(logits[1, 5], torch.tensor(9))) / 2
    torch.testing.assert_close(per_sample[1], expected1, rtol=1e-5, atol=1e-6)
    assert per_sample[2].item() == 0.0


def test_padding_does_not_change_a_classifiers_per_sample_loss():
    torch.manual_seed(0)
    model = tiny_bert_cls()
    model.eval()
    batch = cls_batch()
    per_sample, _ = model.per_sample_loss(batch)
    alone = {k: v[1:2, :6] if v.dim() == 2 else v[1:2] for k, v in batch.items()}
    torch.testing.assert_close(per_sample[1], model.per_sample_loss(alone)[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "bert_mlm", "bert_cls"])
def test_analytic_flops_equal_flop_counter(name, attn):
    """The analytic figure equals the meta-device count and the real training step's (forward + backward of the
    per-sample loss), for eager attention and for the fused SDPA kernel (its backward recomputes the scores)."""
    model_fn, batch_fn = CASES[name]
    model, batch = model_fn(attn_implementation=attn, dropout=0.0), batch_fn()
    analytic = model.effi_training_flops(batch)
    assert analytic == count_training_flops(model.model, model.model_inputs(batch))
    with flop_counter() as counter:
        model.per_sample_loss(batch)[0].mean().backward()
    assert analytic == counter.get_total_flops()
    if name == "gpt2":
        b, t = batch["input_ids"].shape
        recompute = attention_recompute_flops(b, t, 2, 32) if attn == "sdpa" else 0
        assert analytic == transformer_training_flops(b, t, 2, 32, None, 64, head="lm") + recompute


def test_attention_dropout_on_the_cpu_runs_the_math_kernel():
    """PyTorch's CPU flash kernel has no dropout: with attention dropout the math path runs (no recompute)."""
    model, batch = tiny_bert_mlm(attn_implementation="sdpa", dropout=0.1), mlm_batch()
    with flop_counter() as counter:
        model.per_sample_loss(batch)[0].mean().backward()
    assert model.effi_training_flops(batch) == counter.get_total_flops()
    assert not sdpa_recomputes("cpu", 0.1) and sdpa_recomputes("cpu", 0.0) and sdpa_recomputes("cuda", 0.1)


@pytest.mark.parametrize("name", ["vit", "cnn"])
def test_measured_flops_equal_the_real_training_step(name):
    """The meta-device measurement of a timm model equals the flop counter on its real training step (a ViT's SDPA
    counted as its fused CPU kernel runs it; the first convolution has no input gradient)."""
    model_fn, batch_fn = CASES[name]
    model, batch = model_fn(), batch_fn()
    with flop_counter() as counter:
        model.per_sample_loss(batch)[0].mean().backward()
    assert model.effi_training_flops(batch) == counter.get_total_flops()


def test_transformer_flops_golden():
    # GPT-2 small geometry, one 1024-token sequence: 24*L*H^2*T + 4*L*T^2*H + 2*V*H*T (forward)
    f = transformer_forward_flops(1, 1024, 12, 768, None, 50257, head="lm")
    assert f == 24 * 12 * 768**2 * 1024 + 4 * 12 * 1024**2 * 768 + 2 * 50257 * 768 * 1024
    with pytest.raises(ValueError, match="head"):
        transformer_forward_flops(1, 1, 1, 1, head="bogus")


def test_measured_flops_of_a_cnn_scale_with_batch_and_leave_model_untouched():
    model = tiny_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b4 = model.effi_training_flops(img_batch())
    b8 = model.effi_training_flops({k: torch.cat([v, v]) for k, v in img_batch().items()})
    assert b4 > 0 and b8 == 2 * b4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_vit_token_and_layer_accounting():
    model = tiny_vit()
    assert model.effi_num_layers == 2
    assert model.effi_count_tokens(img_batch()) == 4 * (16 + 1)  # (32/8)^2 patches + CLS


def test_unknown_timm_model_names_close_matches():
    with pytest.raises(ValueError, match=r"model.model_name: unknown timm model 'vit_tiny_patch16_23'.*did you mean"):
        ImageClassifier("vit_tiny_patch16_23")


def test_missing_vocab_size_names_the_key():
    with pytest.raises(ValueError, match="model.vocab_size"):
        tiny_gpt2(vocab_size=None)
    with pytest.raises(ValueError, match="model.n_head"):
        tiny_gpt2(n_head=3)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "0.1", True])
def test_a_bad_weight_decay_is_refused_when_built(value):
    """NaN / inf stopped the fit at step 1, blamed on the learning rate, and -1 trained in silence: torch checks a
    default weight_decay, not one set in a parameter group (qa58-args 05)."""
    with pytest.raises(ValueError, match=r"^model\.weight_decay: expected None or a finite number >= 0, got "):
        tiny_gpt2(weight_decay=value)
    assert tiny_gpt2(weight_decay=0).weight_decay == 0


def test_a_weight_decay_the_optimizer_has_no_setting_for_is_refused():
    """Rprop keeps a group's weight_decay key and never reads it: weight_decay=0.1 trained with none, in silence
    (qa59-break 05)."""
    import functools

    module = tiny_gpt2(weight_decay=0.1, optimizer=functools.partial(torch.optim.Rprop, lr=1e-3))
    for build in (module.check_optimization, module.configure_optimizers):
        with pytest.raises(ValueError, match=r"^model\.weight_decay: Rprop has no weight decay, so weight_decay=0\.1"):
            build()
    for weight_decay in (None, 0.0):
        plain = tiny_gpt2(weight_decay=weight_decay, optimizer=functools.partial(torch.optim.Rprop, lr=1e-3))
        assert isinstance(plain.configure_optimizers(), torch.optim.Rprop)
    decayed = tiny_gpt2(weight_decay=0.1, optimizer=functools.partial(torch.optim.SGD, lr=1e-3))
    assert decayed.configure_optimizers().param_groups[0]["weight_decay"] == 0.1
    # LBFGS takes one parameter group: it could not be built at all (qa61-break 05)
    lbfgs = functools.partial(torch.optim.LBFGS, lr=0.1)
    built = tiny_gpt2(weight_decay=None, optimizer=lbfgs)
    built.check_optimization()
    optimizer = built.configure_optimizers()
    assert isinstance(optimizer, torch.optim.LBFGS) and len(optimizer.param_groups) == 1
    assert len(optimizer.param_groups[0]["params"]) == len([p for p in built.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match=r"^model\.weight_decay: LBFGS has no weight decay"):
        tiny_gpt2(weight_decay=0.1, optimizer=lbfgs).check_optimization()


def test_the_training_module_runs_as_the_app(tmp_path):
    """``python -m lightning_effi.train <overrides>`` did nothing and exited 0 (qa58-args 01): it is the app."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lightning_effi.train", "trainer.max_steps=ten", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "trainer.max_steps must be an int >= -1, got 'ten'" in done.stderr


def test_the_monitor_says_it_counts_one_closure_evaluation_of_lbfgs(tmp_path):
    """LBFGS runs training_step up to max_iter times an optimizer step; the monitor counts one: 10 calls read as 2,
    with no word (qa62-break 06)."""
    import functools
    import warnings

    from lightning_effi import EfficiencyMonitor
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import tiny_lm_data

    module = tiny_gpt2(weight_decay=None, optimizer=functools.partial(torch.optim.LBFGS, lr=0.1, max_iter=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [EfficiencyMonitor(print_summary=False)], max_steps=1).fit(
            module, datamodule=tiny_lm_data()
        )
    told = [str(w.message) for w in caught if "evaluates its closure" in str(w.message)]
    assert (
        len(told) == 1
        and "LBFGS evaluates its closure (training_step, forward and backward) up to max_iter=3" in (told[0])
    )
