"""``grpo.algorithm.logprobs``: the shared-prompt forward of a group equals the full forward, and so does
the group packed into one sequence; the chunked LM
head with grad (``selected_logprobs``) equals ``log_softmax`` of the full logits in value and
gradients (hidden rows, a trained head, tied embeddings, bf16) and saves no (K, V) tensor; the
update's LoRA gradients are those of the plain log-softmax head."""

from __future__ import annotations

import pytest
import torch

from grpo.algorithm.logprobs import selected_logprobs
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.model.lora_policy import load_policy

from .helpers import LORA, give_adapter_a_say, make_trainer

PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]).repeat_interleave(3, 0)  # (6, 5): G = 3, left padding


def adapter_policy(model_dir, checkpointing: bool, dtype: str = "float32", device: str = "cpu"):
    """An NF4 + LoRA policy whose adapter changes the output, in train mode, and its body."""
    from grpo.model.lora_policy import lm_parts

    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(model_dir), dtype=dtype, gradient_checkpointing=checkpointing),
                        LoraConfig(**LORA), device)
    give_adapter_a_say(model, std=0.3)
    model.train()
    return model, lm_parts(model)[0]


def states_and_grads(model, body, c_mask: torch.Tensor, **layout) -> tuple[torch.Tensor, dict]:
    """``completion_hidden``'s (6, C, 64) states of PROMPTS + random completions under ``c_mask``,
    and the LoRA gradients of a fixed random weighting of the states at valid positions."""
    from grpo.algorithm.logprobs import completion_hidden

    torch.manual_seed(1)
    completions = torch.randint(3, 90, c_mask.shape) * c_mask  # padding holds token 0
    device = next(model.parameters()).device
    ids = torch.cat([PROMPTS, completions], 1).to(device)
    mask = torch.cat([(PROMPTS != 0).long(), c_mask], 1).to(device)
    weights = torch.randn(*c_mask.shape, 64).to(device)
    c_mask = c_mask.to(device)
    model.zero_grad()
    hidden = completion_hidden(body, ids, mask, 5, **layout)  # (6, C, 64)
    (hidden * weights * c_mask.unsqueeze(-1)).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_states(got, want, c_mask: torch.Tensor, loose: float = 1.0) -> None:
    """The same states at valid positions and the same LoRA gradients, up to float reassociation
    (tolerances times ``loose``: 16-bit compute rounds more)."""
    valid = c_mask.to(got[0].device).unsqueeze(-1)
    torch.testing.assert_close(got[0] * valid, want[0] * valid, rtol=1e-4 * loose, atol=1e-5 * loose)
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-3 * loose, atol=1e-4 * loose)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_forward_equals_full_forward_values_and_lora_grads(tiny_model_dir, checkpointing):
    """Two groups of G = 3 rows, prompts of different lengths (left padding), completions with
    padding: the shared-prompt forward gives the full forward's hidden states and LoRA gradients
    (with gradient checkpointing it falls back to the full forward, so they match trivially)."""
    model, body = adapter_policy(tiny_model_dir, checkpointing)
    c_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]] * 2)
    full = states_and_grads(model, body, c_mask, group_size=1)
    assert_same_states(states_and_grads(model, body, c_mask, group_size=3), full, c_mask)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_groups_equal_padded_rows_values_and_lora_grads(tiny_model_dir, checkpointing):
    """Two groups of G = 3 rows, prompts of different lengths (left padding), completions of 6, 1,
    3 / 2, 6, 4 valid tokens out of 6: each group packed into one sequence gives the padded rows'
    hidden states at every valid position and their LoRA gradients (with and without gradient
    checkpointing, which the padded shared-prompt forward cannot use)."""
    model, body = adapter_policy(tiny_model_dir, checkpointing)
    c_mask = (torch.arange(6) < torch.tensor([6, 1, 3, 2, 6, 4]).unsqueeze(1)).long()  # (6, 6)
    rows = states_and_grads(model, body, c_mask, group_size=3)
    assert_same_states(states_and_grads(model, body, c_mask, group_size=3, packed=True), rows, c_mask)


@pytest.mark.cuda
def test_packed_groups_equal_padded_rows_on_the_default_device(tiny_model_dir, model_dtype):
    """The packed layout against padded rows where ``pytest -m cuda`` runs it: on a card in its
    16-bit dtype (SDPA with the block mask; tolerances for 16-bit rounding), on a CPU in fp32."""
    from grpo.core.device import default_device

    model, body = adapter_policy(tiny_model_dir, False, model_dtype, default_device())
    c_mask = (torch.arange(6) < torch.tensor([6, 1, 3, 2, 6, 4]).unsqueeze(1)).long()  # (6, 6)
    rows = states_and_grads(model, body, c_mask, group_size=3)
    loose = 1.0 if model_dtype == "float32" else 300.0  # bf16: 8 bits of mantissa, fp16: 11
    assert_same_states(states_and_grads(model, body, c_mask, group_size=3, packed=True), rows, c_mask, loose)


def log_softmax_head(hidden_rows, lm_head, targets, *_):
    """The head as autograd computes it from the full fp32 logits (the code before the chunked head)."""
    logits = lm_head(hidden_rows).float()  # (K, V)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def values_and_grads(fn, head, hidden, targets, weights, *extra):
    """``fn``'s (K,) log-probs, and the gradients of ``sum(weights * logp)`` with respect to the
    hidden rows and every trainable parameter of ``head``."""
    head.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_(True)
    logp = fn(h, head, targets, *extra)
    (logp * weights).sum().backward()
    return logp.detach(), h.grad, {n: p.grad for n, p in head.named_parameters() if p.requires_grad}


def assert_same(head, hidden, targets, chunk, tol, backend="auto"):
    torch.manual_seed(1)
    weights = torch.randn(hidden.shape[0])  # an upstream gradient per row
    ref = values_and_grads(log_softmax_head, head, hidden, targets, weights)
    new = values_and_grads(selected_logprobs, head, hidden, targets, weights, chunk, backend)
    assert new[0].dtype == torch.float32 and new[0].shape == (hidden.shape[0],)
    torch.testing.assert_close(new[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(new[1], ref[1], rtol=tol, atol=tol)
    assert new[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(new[2][name], ref[2][name], rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trained_head", [False, True])
@pytest.mark.parametrize(("k", "chunk"), [(13, 5), (12, 4), (7, 1024), (1, 3), (0, 4)])
def test_selected_logprobs_equal_log_softmax_fp32(bias, trained_head, k, chunk):
    """Within 1e-5 of the full log-softmax in value and every gradient, for K a multiple of the
    chunk or not, one chunk, K = 0; with a frozen or a trained head, with or without a bias."""
    torch.manual_seed(k + chunk)
    head = torch.nn.Linear(24, 97, bias=bias).requires_grad_(trained_head)
    hidden, targets = torch.randn(k, 24) * 2, torch.randint(0, 97, (k,))
    assert_same(head, hidden, targets, chunk, 1e-5)


@pytest.mark.parametrize("trained", [False, True])
def test_selected_logprobs_with_tied_embeddings(trained):
    """The head's weight is the input embedding's (tie_word_embeddings): the gradient of the shared
    weight sums its lookup's and the head's, as with the full log-softmax."""
    torch.manual_seed(2)
    emb = torch.nn.Embedding(61, 16)
    head = torch.nn.Linear(16, 61, bias=False)
    head.weight = emb.weight
    emb.requires_grad_(trained)
    ids, targets = torch.randint(0, 61, (9,)), torch.randint(0, 61, (9,))
    results = []
    for fn, extra in ((log_softmax_head, ()), (selected_logprobs, (4,))):
        emb.zero_grad(set_to_none=True)
        x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
        logp = fn(emb(ids) + x, head, targets, *extra)
        (logp * torch.linspace(-1, 1, 9)).sum().backward()
        results.append((logp.detach(), x.grad, emb.weight.grad))
    (v0, x0, w0), (v1, x1, w1) = results
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1, x0, rtol=1e-5, atol=1e-5)
    assert (w0 is None) == (w1 is None) == (not trained)
    if trained:
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trained_head", [False, True])
def test_selected_logprobs_bf16(trained_head):
    """A bf16 head (the compute dtype on CUDA): the same values and gradients up to bf16 rounding
    (the full path rounds ``g * (onehot - softmax)`` to bf16, the chunked one ``onehot - softmax``)."""
    torch.manual_seed(4)
    head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16).requires_grad_(trained_head)
    hidden, targets = (torch.randn(11, 32) * 2).to(torch.bfloat16), torch.randint(0, 300, (11,))
    assert_same(head, hidden, targets, 4, 2e-2)


def test_selected_logprobs_save_no_vocabulary_sized_tensor():
    """What autograd keeps between forward and backward: no tensor with a vocabulary dimension
    other than the head's weight (the full path saves the fp32 (K, V) logits and their softmax)."""
    torch.manual_seed(5)
    vocab, k = 211, 10
    head = torch.nn.Linear(16, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(k, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (k,))
    for fn, has_vocab in ((log_softmax_head, True), (selected_logprobs, False)):
        saved = []

        def pack(t, saved=saved):
            if t.untyped_storage().data_ptr() != head.weight.untyped_storage().data_ptr():
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp = fn(hidden, head, targets)
        assert any(vocab in s for s in saved) == has_vocab, saved
        logp.sum().backward()


def test_update_gradients_equal_the_log_softmax_heads(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    """The real update (``PolicyPasses.accumulate_gradients``, entropy mask at 0.3, two
    micro-batches, tied embeddings, chunks of 3 kept rows) gives the loss, kept tokens and LoRA
    gradients that the full log-softmax head gives."""
    from grpo.algorithm.loss import LossSettings
    from grpo.core.types import TrainBatch
    from grpo.data.sources import build_prompt
    from grpo.model.base_model import load_tokenizer
    from grpo.rollout.rollout_backends import TransformersBackend
    from grpo.training import passes

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.3)  # non-zero adapter: gradients reach A and B
    cfg = TrainConfig(output_dir=str(tmp_path), rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 10}, checkpoints={"every": 0}, loss={"entropy_rule_options": {"high": {"top_quantile": 0.3}}, "entropy_rule": "high"}, passes={"micro_batches": 2, "logprob_chunk": 3})
    trainer = make_trainer(model, tok, cfg, tiny_problems)
    prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:2]]
    rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=10)
    batch = TrainBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 1.2, -1.2]),
                                    torch.device("cpu"))
    normalizer = LossSettings().normalizer(batch.mask)  # dapo's
    results = []
    for head_fn in (log_softmax_head, selected_logprobs):
        monkeypatch.setattr(passes, "selected_logprobs", head_fn)
        model.train()
        model.zero_grad(set_to_none=True)
        sums, keep, _logp = trainer.passes.accumulate_gradients(batch, normalizer)
        results.append((sums, keep, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (s0, keep0, g0), (s1, keep1, g1) = results
    assert torch.equal(keep0, keep1) and 0 < keep1.sum() < batch.mask.sum()
    assert s1["loss"] == pytest.approx(s0["loss"], abs=1e-6)
    assert any(g.abs().max() > 1e-4 for g in g0.values())
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-5)
