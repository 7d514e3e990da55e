"""One builder of a trainer: ``build_trainer(params, device, problems=...)`` makes what the train
stage runs, and every bench that trains goes through the same builder (``TrainerBuilder``), so a
bench measures exactly what the stage runs.

The order is the stage's, and so is every use of the RNG: the tokenizer, the prompts that fit the
engine (``grpo.data.sources.prompts_that_fit``), the seed (``train.seed``) and the policy
(``grpo.model.lora_policy.load_policy``: LoRA's initial weights are drawn here), the step loggers, the
engine's bounds (``grpo.rollout.engine.bounds.train_bounds``), the rollout backend
(``grpo.rollout.engine.policy_engine.policy_rollouts``), the token-entropy rule and the loss
(``grpo.algorithm.entropy.build_token_rule``, ``grpo.algorithm.loss.build_loss``: each built once, here) and
``grpo.training.trainer.GRPOTrainer``, which receives them (``grpo.training.trainer.TrainerParts``).

A bench's departures from the params (a token rule, ``mu``, sizes) are params too: ``depart(params,
{"train.optimizer.mu": 1})`` returns validated params with those keys replaced, and ``departure_line`` words
them for the bench to print. What a bench changes beyond params (a model already built, fixed
prompt or completion lengths, a rollout phase of its own) is a part of ``TrainerBuilder``: the bench
subclasses it and overrides that part's method, and every other part is built as the stage builds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo.algorithm.entropy import TokenRule, build_token_rule
from grpo.algorithm.loss import LossSettings, build_loss
from grpo.config.overlay import overlay_params
from grpo.config.reading import Params
from grpo.config.sections.train import TrainConfig
from grpo.core.device import compute_dtype
from grpo.core.distributed import Dist
from grpo.core.errors import ParamsError
from grpo.core.types import Lengths
from grpo.data.sources import prompts_that_fit
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.bounds import Bounds, train_bounds
from grpo.rollout.engine.forms import rollouts_per_process
from grpo.rollout.engine.needs import form_here
from grpo.rollout.engine.policy_engine import PolicyEngineSpec, policy_rollouts
from grpo.rollout.rollout_backends import DecodeChoice, RolloutBackend, uses_engine
from grpo.training.trainer import GRPOTrainer, TrainerParts


@dataclass
class BuiltTrainer:
    """A trainer and what was built for it."""

    trainer: GRPOTrainer
    tokenizer: object
    model: object  # the peft policy
    backend: RolloutBackend
    problems: list[dict]  # the training rows whose prompts fit the engine
    bounds: Bounds
    weights_form: str | None  # the engine's weights form; None: the decode loop samples
    rollouts: str  # how the processes' rollouts are made (``grpo.rollout.engine.forms.rollouts_per_process``)
    backend_start_s: float  # seconds the backend took to start (an engine's start-up)
    closers: list = field(default_factory=list)  # the step loggers' closers (``grpo.training.step_loggers``)


def depart(params: Params, departures: dict[str, object]) -> Params:
    """``params`` with each dotted key of ``departures`` (``{"train.optimizer.mu": 1}``, any depth)
    replaced, each changed section built again, so validated (``ParamsError`` of one line on a bad
    value or key). A key names a section and a key in it; ``params`` is left as it was."""
    sections = {name: getattr(params, name) for name in type(params).model_fields} | dict(params.model_extra or {})
    names = {key.partition(".")[0] for key in departures}
    for key in departures:
        name, dot, rest = key.partition(".")
        if name not in sections or not dot or not rest:
            raise ParamsError(f"{name}: a departure names a section and a key of it (section.key); "
                              f"sections: {', '.join(sections)}")
    raw = overlay_params({name: sections[name].model_dump() for name in names}, departures)
    for name in names:
        sections[name] = type(sections[name])(**raw[name])
    return type(params)(**sections)


def _form(params: Params, device: str) -> str:
    """The training engine's weights form on this machine; ``dense`` where the decode loop samples."""
    return form_here(params, Path("."), device)[0] if uses_engine(params.train.rollouts.backend) else "dense"


def departure_line(departures: dict[str, object]) -> str:
    """The departures from the params, as a bench prints them: ``train.optimizer.mu=1, train.steps=3``, or
    ``none`` (the params as the stage runs them)."""
    return ", ".join(f"{k}={v}" for k, v in departures.items()) or "none"



def loss_of(cfg: TrainConfig) -> LossSettings:
    """The loss's settings for the train section ``cfg``: ``train.loss`` with the rollouts' length
    (``build_loss``'s T_max), as the builder builds them."""
    return build_loss(cfg.loss, cfg.rollouts.max_new_tokens)

class TrainerBuilder:
    """Builds the train stage's trainer for ``params`` on ``device`` part by part, in the stage's
    order (module docstring): one method per part, each called once by ``build``. ``dist``: this
    process among the data-parallel ones (one process when ``None``). A bench that replaces a part
    overrides its method (a model already built: ``tokenizer`` and ``policy``, then no seed is set for
    them; rollouts of fixed lengths: ``rollout_lengths``; a rollout phase of its own: ``backend``)."""

    def __init__(self, params: Params, device: str, dist: Dist | None = None):
        self.params, self.device, self.dist = params, device, dist or Dist()
        self.cfg = params.train

    # ------------------------------------------------------------------ the parts, in build order
    def tokenizer(self):
        return load_tokenizer(self.params.model.path)

    def rows(self, tokenizer, problems: list[dict]) -> list[dict]:
        """The rows of ``problems`` whose prompts fit the engine (``grpo.data.sources.prompts_that_fit``; its
        message names ``train.data_path``); all of them when the backend cuts every prompt to a
        length (``rollout_lengths``)."""
        if self.rollout_lengths()[0] is not None:
            return problems
        cfg = self.cfg
        return prompts_that_fit(tokenizer, problems, cfg.system_prompt, cfg.rollouts, cfg.data_path)[0]

    def policy(self):
        """The peft policy, LoRA's initial weights drawn from ``train.seed``."""
        torch.manual_seed(self.cfg.seed)
        return load_policy(self.params.model, self.params.lora, self.device)

    def rollout_lengths(self) -> tuple[int | None, int]:
        """``(max_prompt_tokens, min_new_tokens)`` of the rollouts (``policy_rollouts``'): the stage's
        ``(None, 0)``, prompts as they are and completions that may stop early."""
        return None, 0

    def engine_dir(self) -> Path:
        """The engine's folder: ``train.output_dir``/engine."""
        return Path(self.cfg.output_dir) / "engine"

    def weights_form(self) -> str:
        """The training engine's weights form on this machine (``grpo.rollout.engine.needs.form_here``);
        ``dense`` where the decode loop samples."""
        return _form(self.params, self.device)

    def backend(self, tokenizer, model, bounds: Bounds) -> RolloutBackend:
        """The rollout backend of ``train.rollouts.backend`` for ``model`` (an engine starts here)."""
        cfg, (max_prompt_tokens, min_new_tokens) = self.cfg, self.rollout_lengths()
        engine = PolicyEngineSpec(self.engine_dir(), cfg.rollouts, self.params.model, self.weights_form(), bounds,
                                  cfg.seed, self.params.model.dtype)
        return policy_rollouts(cfg.rollouts.backend, tokenizer, model, engine=engine, dist=self.dist,
                               limits=Lengths(max_prompt_tokens, min_new_tokens),
                               decode=DecodeChoice(self.params.decode, cfg.steps * cfg.rollouts.max_new_tokens))

    def token_rule(self) -> TokenRule:
        return build_token_rule(self.cfg.loss)

    def loss(self) -> LossSettings:
        return loss_of(self.cfg)

    # ------------------------------------------------------------------ the trainer
    def build(self, problems: list[dict], *, loggers: Callable[[], tuple[list, list]] | None = None,
              val_problems: list[dict] | None = None) -> BuiltTrainer:
        """The trainer over ``problems``. ``loggers``: makes the step loggers' callbacks and closers,
        called where the stage makes them (``grpo.training.step_loggers.step_loggers``; none when ``None``);
        ``val_problems``: the validation rows (``train.checkpoints.eval_every``). When the trainer
        cannot be made, the backend is closed before the error goes on."""
        cfg, dist = self.cfg, self.dist
        tokenizer = self.tokenizer()
        problems = self.rows(tokenizer, problems)
        model = self.policy()
        callbacks, closers = loggers() if loggers is not None else ([], [])
        bounds = train_bounds(cfg, model.config, self.device, compute_dtype(self.params.model.dtype, self.device).itemsize,
                              dist.world_size)
        t0 = time.perf_counter()
        backend = self.backend(tokenizer, model, bounds)
        backend_start_s = time.perf_counter() - t0
        weights_form = getattr(backend, "weights_form", None)  # None: no engine (the decode loop)
        try:
            parts = TrainerParts(backend, self.token_rule(), self.loss())
            trainer = GRPOTrainer(model, tokenizer, cfg, problems, parts=parts, callbacks=callbacks,
                                  val_problems=val_problems, dist=dist)
        except BaseException:
            backend.close()  # an engine started for a trainer that failed gives its memory back
            raise
        return BuiltTrainer(trainer, tokenizer, model, backend, problems, bounds, weights_form,
                            rollouts_per_process(weights_form is not None, dist.world_size, weights_form),
                            backend_start_s, closers)


def build_trainer(params: Params, device: str, *, problems: list[dict], dist: Dist | None = None,
                  loggers: Callable[[], tuple[list, list]] | None = None,
                  val_problems: list[dict] | None = None) -> BuiltTrainer:
    """The train stage's trainer for ``params`` on ``device`` over ``problems``:
    ``TrainerBuilder(params, device, dist).build(...)`` (its parts as the stage builds them)."""
    return TrainerBuilder(params, device, dist).build(problems, loggers=loggers, val_problems=val_problems)
