"""Every GPU preset's training switches, run together for two optimizer steps on the CPU.

A preset (``presets/*.yaml``) is put over ``params.yaml`` as ``scripts/apply_preset.py`` does
(``grpo.config.overlay.overlay_params``); then only size knobs are shrunk (steps, prompts per step, new
tokens, output directories, and the model: the tiny random Llama of ``conftest.py`` stands in for
the preset's hub id, keeping its quantization, dtype and gradient checkpointing). Every other key the
preset sets in ``train``, ``lora`` and ``model`` is asserted to be in the run's config, and the
switches are checked to be in effect: the 4-bit base, LoRA rank/alpha/dropout/targets, gradient
checkpointing (the layers' recompute function runs), the micro-batch slices, the reference pass
with the adapter disabled when beta > 0, the old-policy pass and mu updates when mu > 1, the loss
type and clip range handed to the loss, the gradient clip, the entropy mask's kept fraction, the
learning-rate warm-up and schedule, the group size, the reward functions and the system prompt.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

import grpo.training.passes as passes_mod
import grpo.training.trainer as trainer_mod
from grpo.algorithm.loss import AGGREGATIONS, POLICY_LOSSES
from grpo.algorithm.rewards import REWARDS
from grpo.config.overlay import overlay_params
from grpo.config.params import params_from_dict
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.training.trainer import lr_lambda

from .conftest import REPO
from .helpers import make_trainer

PRESETS = sorted((REPO / "presets").glob("*.yaml"))
# train keys that are sizes or paths: shrunk or redirected for a CPU test; every other key a preset
# sets is kept and must reach the run's config
TRAIN_SIZES = {"steps", "prompts_per_step", "max_new_tokens", "data_path", "output_dir", "adapter_dir",
               "metrics_dir", "rewards"}
MAX_GROUP = 12


def preset_params(preset: Path, model_dir: Path, tmp: Path) -> tuple[dict, dict]:
    """(the preset as written, the run's params mapping: params.yaml + preset + shrunk sizes)."""
    raw = yaml.safe_load(preset.read_text())
    full = overlay_params(yaml.safe_load((REPO / "params.yaml").read_text()), raw)
    full["model"].update(name=str(model_dir), path=str(model_dir))
    train = full["train"]
    rollouts = train["rollouts"]
    train.update(steps=2, output_dir=str(tmp / "out"), adapter_dir=str(tmp / "adapter"), metrics_dir=str(tmp / "metrics"),
                 data_path=str(tmp / "train.jsonl"))
    rollouts.update(prompts_per_step=2, max_new_tokens=min(8, rollouts["max_new_tokens"]),
                    group_size=min(MAX_GROUP, rollouts["group_size"]))
    # the preset's rewards, plus a small reward that differs within every group (completion length),
    # so that a random model's advantages are non-zero and the update moves the LoRA weights
    train["rewards"] = {**train["rewards"], "chars": 1e-3}
    return raw, full


@pytest.fixture
def chars_reward(monkeypatch):
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])


@pytest.fixture
def one_thread():
    """The tiny model's matmuls are too small for two threads; on a shared 2-core machine OpenMP's
    waiting threads made the same two steps ~10x slower (15 s vs 1.5 s a step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_switches_run_two_steps_on_the_cpu(preset, tiny_model_dir, tiny_problems, tmp_path, monkeypatch,
                                                  chars_reward, one_thread):
    import bitsandbytes as bnb

    raw, full = preset_params(preset, tiny_model_dir, tmp_path)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(full, sort_keys=False))
    params = params_from_dict(yaml.safe_load(params_file.read_text()))
    cfg, mcfg, lcfg = params.train, params.model, params.lora

    # every key the preset sets in model / lora / train reaches the run, sizes excepted
    for key, value in raw.get("model", {}).items():
        if key not in ("name", "path"):
            assert getattr(mcfg, key) == value, f"model.{key}"
    for key, value in raw.get("lora", {}).items():
        assert getattr(lcfg, key) == value, f"lora.{key}"
    from grpo.tools.dvcstatus import flat_keys
    from grpo.tools.memory import _get

    for key, value in flat_keys({"train": raw.get("train", {})}).items():  # every leaf, parts included
        leaf = key.rsplit(".", 1)[-1]
        if key.startswith("train.rewards.") or leaf in TRAIN_SIZES or (leaf == "group_size" and value > MAX_GROUP):
            continue
        assert _get(params, key) == value, key
    assert {k: cfg.rewards[k] for k in raw["train"].get("rewards", {})} == raw["train"].get("rewards", {})

    torch.manual_seed(0)
    tok = load_tokenizer(mcfg.path)
    model = load_policy(mcfg, lcfg, "cpu")
    base = model.get_base_model()

    # model + lora switches
    if mcfg.quantization == "nf4":
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    peft_cfg = model.peft_config["default"]
    assert (peft_cfg.r, peft_cfg.lora_alpha, peft_cfg.lora_dropout) == (lcfg.rank, lcfg.alpha, lcfg.dropout)
    assert set(peft_cfg.target_modules) == set(lcfg.target_modules)
    lora_layers = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert lora_layers == set(lcfg.target_modules)
    dropouts = [m.lora_dropout["default"] for m in model.modules() if hasattr(m, "lora_dropout")]
    assert dropouts and all(
        (isinstance(d, torch.nn.Dropout) and d.p == lcfg.dropout) if lcfg.dropout else isinstance(d, torch.nn.Identity)
        for d in dropouts)
    assert base.is_gradient_checkpointing == mcfg.gradient_checkpointing
    recomputes = Counter()
    if mcfg.gradient_checkpointing:
        for layer in base.model.layers:
            fn = layer._gradient_checkpointing_func

            def counted(*a, _fn=fn, **kw):
                recomputes["layer"] += 1
                return _fn(*a, **kw)

            layer._gradient_checkpointing_func = counted

    # spies on the trainer's parts: what each step really did
    calls = Counter()
    loss_kwargs, clip_norms, system_prompts, gen_kwargs = [], [], set(), []
    real_loss, real_no_grad, real_backward = passes_mod.grpo_loss, passes_mod.PolicyPasses.no_grad_pass, \
        passes_mod.PolicyPasses.loss_backward
    real_clip, real_prompt = torch.nn.utils.clip_grad_norm_, trainer_mod.build_prompt

    def spy_loss(*args, **kw):
        settings = args[5] if len(args) > 5 else kw["settings"]  # grpo.algorithm.loss.LossSettings, built once
        epsilon, epsilon_high = settings.bounds(kw.get("terms", passes_mod.NO_TERMS))
        loss_kwargs.append({"ref_logp": args[2] is not None, "beta": settings.beta, "policy": settings.policy,
                            "aggregation": settings.aggregation, "max_length": settings.max_length,
                            "epsilon": epsilon, "epsilon_high": epsilon_high})
        return real_loss(*args, **kw)

    def spy_no_grad(self, batch, *, adapter):
        calls["policy_pass" if adapter else "reference_pass"] += 1
        return real_no_grad(self, batch, adapter=adapter)

    def spy_backward(self, batch, normalizer, threshold=None):
        calls["micro_batch"] += 1
        return real_backward(self, batch, normalizer, threshold)

    def spy_clip(parameters, max_norm, *a, **kw):
        clip_norms.append(max_norm)
        return real_clip(parameters, max_norm, *a, **kw)

    def spy_prompt(tokenizer, question, system_prompt):
        system_prompts.add(system_prompt)
        return real_prompt(tokenizer, question, system_prompt)

    monkeypatch.setattr(passes_mod, "grpo_loss", spy_loss)
    monkeypatch.setattr(trainer_mod, "build_prompt", spy_prompt)
    monkeypatch.setattr(passes_mod.PolicyPasses, "no_grad_pass", spy_no_grad)
    monkeypatch.setattr(passes_mod.PolicyPasses, "loss_backward", spy_backward)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
    disabled = Counter()
    real_disable = model.disable_adapter

    def spy_disable():
        disabled["n"] += 1
        return real_disable()

    model.disable_adapter = spy_disable

    trainer = make_trainer(model, tok, cfg, tiny_problems)
    real_generate = trainer.backend.generate

    def spy_generate(prompts, n, **kw):
        gen_kwargs.append({"completions": len(prompts) * n, **kw})
        return real_generate(prompts, n, **kw)

    trainer.backend.generate = spy_generate
    steps = []
    trainer.callbacks.append(lambda row: steps.append((row, list(trainer.last_samples))))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = trainer.train(progress=False)

    # both steps ran and moved the LoRA weights
    assert [r["step"] for r in rows] == [1, 2]
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
    n_rows = cfg.rollouts.prompts_per_step * cfg.rollouts.group_size
    for row, samples in steps:
        assert len(samples) == n_rows  # G completions per prompt
        assert row["completion_len"] > 0 and row["step_time_s"] > 0
        for name in cfg.rewards:  # every reward function ran, the preset's format rewards included
            assert f"reward_{name}_mean" in row
    assert sum(g["completions"] for g in gen_kwargs) == 2 * n_rows
    assert {(g["temperature"], g["top_p"], g["max_new_tokens"]) for g in gen_kwargs} == {
        (cfg.rollouts.temperature, cfg.rollouts.top_p, cfg.rollouts.max_new_tokens)}
    if cfg.rollouts.generation_batch_size:
        assert all(g["completions"] <= max(cfg.rollouts.generation_batch_size, cfg.rollouts.group_size) for g in gen_kwargs)
    else:
        assert len(gen_kwargs) == 2
    assert system_prompts == {cfg.system_prompt}

    # micro-batches: each update ran as several slices, and the step's threshold came from a no-grad pass
    slices = len(trainer.passes.slices(n_rows))
    assert calls["micro_batch"] == 2 * cfg.optimizer.mu * slices
    if cfg.passes.micro_batches > 1:
        assert slices > 1
    # beta > 0 or the rule's KL (sent_kl): a reference pass with the adapter disabled each step, and the KL term
    if trainer.passes.needs_reference():
        assert calls["reference_pass"] == 2 and disabled["n"] >= 2 * slices
        assert all(kw["ref_logp"] and kw["beta"] == cfg.loss.beta for kw in loss_kwargs)
        assert all(r["kl"] >= 0 for r in rows)
    else:
        assert calls["reference_pass"] == 0 and disabled["n"] == 0
        assert all(not kw["ref_logp"] and kw["beta"] == 0 for kw in loss_kwargs)
    # mu optimizer updates per step; the old policy's log-probs need no pass (the first update gives them):
    # a no-grad policy pass runs only for the threshold of a rule with a statistic over several slices, once an update
    statistic = slices > 1 and trainer.passes.rule.needs_statistic()
    assert calls["policy_pass"] == (2 * cfg.optimizer.mu if statistic else 0)
    assert clip_norms == [cfg.optimizer.max_grad_norm] * (2 * cfg.optimizer.mu)
    # the loss got the preset's loss type, policy loss and clip range (a rule with per-token bounds, archer:
    # the params' clip on its low-entropy tokens, its own clip_high on the others)
    assert {(kw["aggregation"], kw["policy"], kw["max_length"]) for kw in loss_kwargs} == {
        (AGGREGATIONS[cfg.loss.loss_type], POLICY_LOSSES[cfg.loss.policy_loss], cfg.rollouts.max_new_tokens)}
    wide = {round(o.clip_high, 6) for o in cfg.loss.entropy_rule_options.values() if hasattr(o, "clip_high")}
    for kw in loss_kwargs:
        for got, own in zip((kw["epsilon"], kw["epsilon_high"]), cfg.loss.clip()):
            if torch.is_tensor(got):
                assert {round(x, 6) for x in got.unique().tolist()} <= {round(own, 6), *wide}
            else:
                assert got == own
    # entropy mask: about the top quantile of tokens kept (all of them at 1.0)
    for r in rows:
        if cfg.loss.rule_options().top_quantile >= 1.0:
            assert r["kept_frac"] == pytest.approx(1.0)
        else:
            assert 0 < r["kept_frac"] <= trainer.passes.rule.grad_fraction() + 0.15  # the rule's share of tokens with gradient
    # learning rate: warm-up and schedule as configured (the steps were shrunk, the shape kept)
    schedule = lr_lambda(cfg)
    assert [r["lr"] for r in rows] == pytest.approx([cfg.optimizer.lr * schedule(s) for s in range(2)])
    if cfg.optimizer.warmup_steps:
        assert rows[0]["lr"] < rows[1]["lr"] <= cfg.optimizer.lr
    # gradient checkpointing: the decoder layers recomputed through the checkpoint function
    if mcfg.gradient_checkpointing:
        assert recomputes["layer"] >= 2 * cfg.optimizer.mu * slices * len(base.model.layers)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_with_an_unknown_key_fails_with_one_line(preset, tmp_path):
    """A copy of the preset naming a key the code does not know: apply_preset stops with one line
    naming it, exit code 2, and leaves params.yaml as it was."""
    raw = yaml.safe_load(preset.read_text())
    raw["train"]["learning_rate"] = 1.0e-4  # the key is `lr`
    bad = tmp_path / preset.name
    bad.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "apply_preset.py"), str(bad), str(params)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0] == f"apply_preset: error: {bad}: train.learning_rate: unknown key; did you mean train.optimizer.lr?"
    assert params.read_text() == (REPO / "params.yaml").read_text()


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_splits_exist_at_the_sources_real_sizes(preset):
    """Each preset passes the split check (grpo.data.split_check) at its source's real sizes, with a
    validation split of the asked size wherever training evaluates."""
    from grpo.data.split_check import check_params
    from grpo.data.split_sizes import expected_rows, supply
    from grpo.tools.cli import resolve_params

    params = resolve_params(preset).params
    check_params(params, REPO)
    rows = expected_rows(params.data, supply(params.data, REPO))
    assert rows == {"train": params.data.train_size, "test": params.data.test_size, "val": params.data.val_size}
    assert not params.train.checkpoints.eval_every or rows["val"] > 0
