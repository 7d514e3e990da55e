"""The optimizer side of the update (``grpo.training.updater``) on a tiny linear layer: backward and step equal a
hand-run ``clip_grad_norm_`` + ``torch.optim.AdamW``, the norm is reported before clipping, gradients are
cleared, the state round-trips; which updater ``make_updater`` picks and which one masks rows."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.training.updater import AdamWUpdater, make_updater

CFG = TrainConfig(optimizer={"lr": 0.1, "weight_decay": 0.01, "max_grad_norm": 0.5})
X = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])  # (2, 3)


def _layer(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _losses(layer: torch.nn.Linear) -> list[torch.Tensor]:
    """Two micro-batches' losses, a forward each (their gradients add up)."""
    return [(layer(X[0]) ** 2).sum(), (layer(X[1]) * torch.tensor([1.0, -3.0])).sum()]


def test_backward_and_step_are_a_clipped_adamw_step():
    """Two micro-batch backwards, then ``step``: the parameters and AdamW's state are those of the
    same backwards, ``clip_grad_norm_`` and ``torch.optim.AdamW`` run by hand; the norm reported is
    the one before clipping (above ``max_grad_norm`` here, so clipping acts: AdamW's first moment is
    0.1 x the clipped gradient); the gradients are cleared; no time waiting for other ranks."""
    layer, ref = _layer(), _layer()
    params, ref_params = list(layer.parameters()), list(ref.parameters())
    updater = AdamWUpdater(params, CFG, Dist())
    ref_opt = torch.optim.AdamW(ref_params, lr=CFG.optimizer.lr, weight_decay=CFG.optimizer.weight_decay)
    for step in range(2):
        for loss in _losses(layer):
            updater.backward(loss)
        for loss in _losses(ref):
            loss.backward()
        grads = [p.grad.clone() for p in ref_params]
        norm = torch.sqrt(sum((g**2).sum() for g in grads))  # by hand, before clipping
        assert float(torch.nn.utils.clip_grad_norm_(ref_params, CFG.optimizer.max_grad_norm)) == pytest.approx(float(norm))
        ref_opt.step()
        ref_opt.zero_grad()
        result = updater.step()
        assert result.grad_norm == pytest.approx(float(norm), rel=1e-6) and result.grad_norm > CFG.optimizer.max_grad_norm
        assert result.wait_s == result.allreduce_s == 0.0 and result.optimizer_s >= 0
        assert all(p.grad is None for p in params)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        if step == 0:
            for p, g in zip(params, grads):
                clipped = g * CFG.optimizer.max_grad_norm / (norm + 1e-6)
                torch.testing.assert_close(updater.optimizer.state[p]["exp_avg"], 0.1 * clipped)
    assert not torch.equal(layer.weight, _layer().weight)


def test_a_loss_without_grad_back_propagates_nothing():
    """A micro-batch whose tokens were all masked out has a loss without grad: ``backward`` skips it."""
    layer = _layer()
    updater = AdamWUpdater(list(layer.parameters()), CFG, Dist())
    updater.backward(torch.tensor(0.0))
    assert all(p.grad is None for p in layer.parameters())
    updater.backward(_losses(layer)[0])
    assert all(p.grad is not None for p in layer.parameters())


def test_the_state_dict_resumes_the_optimizer():
    """After a step, an updater loaded with the first's ``state_dict`` (a checkpoint) takes the same
    next step as the first; one without it (AdamW's moments restarted) takes another."""
    a = _layer()
    first = AdamWUpdater(list(a.parameters()), CFG, Dist())
    for loss in _losses(a):
        first.backward(loss)
    first.step()
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    resumed = AdamWUpdater(list(b.parameters()), CFG, Dist())
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # as a checkpoint holds it (loaded as is, it would share first's tensors)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    restarted = AdamWUpdater(list(c.parameters()), CFG, Dist())
    for layer, updater in ((a, first), (b, resumed), (c, restarted)):
        for loss in _losses(layer):
            updater.backward(loss)
        updater.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert not torch.equal(c.weight, a.weight)


def test_make_updater_is_adamw_without_a_deepspeed_config():
    """Without ``train.distribution.deepspeed_config``: ``AdamWUpdater`` over the given parameters with the
    params' lr and weight decay. It drops the rows without signal (``masks_rows`` false); DeepSpeed's
    ZeRO updater keeps them masked (true: every rank must run the same backward passes)."""
    from grpo.training.zero import ZeroUpdater  # imports without deepspeed; only building one needs it

    layer = _layer()
    params = [layer.weight]  # the trainable subset only
    updater = make_updater(layer, params, CFG, Dist())
    assert type(updater) is AdamWUpdater and updater.params == params
    group = updater.optimizer.param_groups[0]
    assert group["params"] == params and (group["lr"], group["weight_decay"]) == (CFG.optimizer.lr, CFG.optimizer.weight_decay)
    assert AdamWUpdater.masks_rows is False and updater.masks_rows is False
    assert ZeroUpdater.masks_rows is True
