"""One full GRPO step, measured: time per phase and peak memory; ours against TRL's GRPOTrainer.

A step is generation -> rewards -> the reference pass (with a KL term) -> training forward
and backward -> optimizer step, through the project's ``GRPOTrainer.train_step`` on a 4-bit NF4
base with LoRA on q/k/v/o (``grpo.model.lora_policy.load_policy``). Each configuration runs in a fresh
process, so no run inherits another's memory high-water mark, threads or caches.

CPU speed against TRL (needs ``pip install trl==1.16.0``; the default model is ``models/base``,
SmolLM2-135M-Instruct from ``dvc repro``; prompts from ``data/raw/train.jsonl``):

    python bench/grpo_step.py --trl [--trl-tuned]

  4 prompts x G = 8, at most 64 new tokens, temperature 1, top_entropy_quantile 0.2 (ours: the ``high``
  rule at that quantile, the same work; our params' default rule runs beside it as ``ours-default-rule``), beta 0,
  LoRA r16 / alpha 32; the median step time of each, split into phases, and the mean reward.
  ``--rollout both`` (the default where vLLM is installed) runs our step twice in the same run:
  rollouts from a vLLM engine holding the policy (``ours``, synced every step) and from our decode
  loop (``ours-transformers``), and prints the generation phase of one over the other.
  ``--trl-tuned`` adds TRL without gradient checkpointing and with fp32 LoRA weights (its
  defaults for a 4-bit base are checkpointing on and bf16 LoRA, slow on this CPU).

GPU memory at seed 003's shape (a random model with DeepSeek-R1-Distill-Qwen-1.5B's exact
architecture, 128 prompt + 512 completion tokens, EOS suppressed so every completion is full length):

    python bench/grpo_step.py --arch qwen2-1.5b --prompts 1 --group 8 --prompt-tokens 128 \\
        --new-tokens 512 --fixed-length --gradient-checkpointing --micro-batches 4 \\
        --generation-batch 4 --ablate [--trl]

  prints the peak allocated / reserved CUDA memory with every saving on, then with each saving
  switched off in turn, then all off.

Smoke run at toy size on the CPU (what CI runs): ``--arch toy --steps 1 --ablate``.

Phases. Ours: ``generate`` (sampling), ``logprob`` (rewards + the no-grad reference pass, with a KL
term; ``mu > 1`` takes its old log-probs from the first update: no pass), ``fwd_bwd`` (training
forward and backward), ``optimizer`` (clip + AdamW).
TRL: its ``_generate_single_turn`` is ``generate``; the rest of its input preparation (decoding,
rewards, old/ref log-probs) is ``logprob``; ``compute_loss`` + ``accelerator.backward`` is
``fwd_bwd``; the remainder of the step (optimizer, scheduler, logging) is ``optimizer``.
``updated``: the share of the step's completions our update back-propagates (at ``beta`` 0 the
groups whose rewards are all equal are left out: their gradient is zero; TRL computes it: 1.00).
Peak memory: CUDA ``max_memory_allocated`` / ``max_memory_reserved`` over the step; on the CPU the
process's peak resident set (``ru_maxrss``: whole process, model included, since its start).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "logprob", "fwd_bwd", "optimizer")

# saving -> the overrides that switch it off (everything else as configured)
SAVINGS: dict[str, dict] = {
    "entropy mask: LM-head grad at kept tokens only": {"loss.entropy_rule": "high",
                                                       "loss.entropy_rule_options.high.top_quantile": 1.0},
    "chunked fused entropy/log-prob (no full-vocab fp32 logits)": {"passes.kernel": "torch", "passes.logprob_chunk": 1 << 30},
    "gradient checkpointing": {"gradient_checkpointing": False},
    "micro-batched generation and training forward": {"rollouts.generation_batch_size": 0, "passes.micro_batches": 1},
    "release generation memory before training": {"rollouts.release_generation_memory": False},
    "shared prompt in the training forward": {"passes.shared_prompt_forward": False},
    "packed groups (no compute on padding; auto: off CUDA)": {"passes.forward_layout": "padded"},
}


# ---------------------------------------------------------------------------- shared set-up
def _problems(args) -> list[dict]:
    """Training problems: ``--data`` when it exists, else seeded arithmetic (offline)."""
    if args.data and Path(args.data).exists():
        rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    else:
        from grpo.data.sources import generate_arithmetic

        rows = generate_arithmetic(64, 0, prefix="bench", min_digits=1, max_digits=2, operators=["+", "-"])
    if args.prompt_tokens:  # pad questions so that every prompt is cut to exactly --prompt-tokens
        filler = "Context: a long preamble that fills the prompt to its fixed length. " * 40
        rows = [{**r, "question": filler + r["question"]} for r in rows]
    return rows


def _model_dir(args, workdir: Path) -> str:
    """``--model``, or a random model of ``--arch`` saved under ``workdir``."""
    if not args.arch:
        return args.model
    import torch

    from grpo.core.device import default_device
    from grpo.tools.synthetic import architecture_config, random_model_dir

    device = default_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return str(random_model_dir(workdir / args.arch, architecture_config(args.arch), dtype=dtype, device=device))


def departures(args, overrides: dict, workdir: Path, model_dir: str, rollout: str) -> dict:
    """Our step's departures from the embedded default params (``grpo.config.params.AllParams``), as dotted
    keys for ``grpo.training.trainer_builder.depart``: the bench's sizes, and TRL's rule (the top entropy
    quantile's tokens get gradient, no KL, one update per batch: ``mu`` 1 as TRL's
    ``num_iterations``), then ``overrides`` (a saving switched off, or the params' default rule)."""
    out = {
        "model.path": model_dir, "model.gradient_checkpointing": args.gradient_checkpointing,
        "train.output_dir": str(workdir / "out"), "train.checkpoints.every": 0, "train.wandb.mode": "disabled",
        "train.order": "shuffled", "train.steps": args.steps + 1, "train.rollouts.prompts_per_step": args.prompts,
        "train.rollouts.group_size": args.group, "train.rollouts.max_new_tokens": args.new_tokens, "train.rollouts.temperature": 1.0,
        "train.rollouts.top_p": 1.0, "train.loss.entropy_rule_options.high.top_quantile": args.quantile, "train.loss.beta": args.beta, "train.optimizer.lr": args.lr,
        "train.optimizer.warmup_steps": 0, "train.passes.micro_batches": args.micro_batches,
        "train.rollouts.generation_batch_size": args.generation_batch, "train.rewards": {"correctness": 1.0, "format_strict": 0.1},
        "train.truncated": "score",  # TRL's default (mask_truncated_completions off): the same rewards, the same work
        "train.loss.entropy_rule": "high",  # TRL's top_entropy_quantile: only the top quantile's tokens get gradient, no KL
        "train.optimizer.mu": 1,  # TRL's num_iterations: one update per batch
        "train.rollouts.backend": rollout, "train.rollouts.gpu_memory_utilization": args.gpu_memory_utilization,
        "train.rollouts.max_model_len": 2048,
    }
    for key, value in overrides.items():
        out[f"model.{key}" if key == "gradient_checkpointing" else f"train.{key}"] = value
    return out


def default_rule_overrides(quantile: float) -> dict:
    """The token-entropy rule of the params' defaults (``grpo.config.sections.train.TrainConfig``) with
    its options, ``mu`` and ``equal_reward_groups``, as departures, when it is not the work the bench
    runs at TRL's rule (``high`` at ``quantile``, ``mu`` 1); ``{}`` when it is."""
    from grpo.config.sections.train import TrainConfig

    d = TrainConfig()
    options = d.loss.rule_options()
    if (d.loss.entropy_rule, getattr(options, "top_quantile", None), d.optimizer.mu) == ("high", quantile, 1):
        return {}
    out = {"loss.entropy_rule": d.loss.entropy_rule, "optimizer.mu": d.optimizer.mu,
           "optimizer.equal_reward_groups": d.optimizer.equal_reward_groups}
    for key, value in (options.model_dump() if options else {}).items():
        out[f"loss.entropy_rule_options.{d.loss.entropy_rule}.{key}"] = value
    return out


def _memory_fields(device: str) -> dict:
    """Peak memory since the last reset: CUDA allocator counters, or on the CPU the process's peak
    resident set so far (ru_maxrss; no sampler thread, which would steal time from the step)."""
    import resource

    import torch

    if device == "cuda":
        return {"peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ---------------------------------------------------------------------------- our step
def run_ours(args, overrides: dict, rollout: str = "transformers", form: str = "dense") -> dict:
    """Our ``train_step`` as the train stage builds it (``grpo.training.trainer_builder.TrainerBuilder``) with
    this bench's ``departures``, rollouts from ``rollout``: ``vllm`` (an engine holding the policy,
    synced every step, in the weights ``form``) or ``transformers`` (the project's decode loop). The
    bench's own parts: the tokenizer (cutting prompts on the left), the engine's folder and form, and
    the rollouts' fixed lengths."""
    import torch

    from grpo.config.params import AllParams
    from grpo.core.device import default_device
    from grpo.model.base_model import load_tokenizer
    from grpo.training.trainer_builder import TrainerBuilder, depart

    device = default_device()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = _model_dir(args, workdir)
        changes = departures(args, overrides, workdir, model_dir, rollout)
        params = depart(AllParams(), changes)
        tok = load_tokenizer(model_dir)
        tok.truncation_side = "left"  # a cut prompt keeps its end (the assistant turn)

        class BenchBuilder(TrainerBuilder):
            def tokenizer(self):
                return tok

            def engine_dir(self) -> Path:
                return workdir / "engine"

            def weights_form(self) -> str:
                return form

            def rollout_lengths(self) -> tuple[int | None, int]:
                return args.prompt_tokens or None, args.new_tokens if args.fixed_length else 0

        built = BenchBuilder(params, device).build(_problems(args))
        trainer, backend = built.trainer, built.backend
        steps = []
        for i in range(args.steps + 1):  # step 0 warms up (lazy inits, allocator) and is not counted
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            row = trainer.train_step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i == 0:
                continue
            steps.append({
                "step_s": row["step_time_s"],
                "generate": row["time_generate_s"],
                "logprob": row["time_logprob_s"],
                "fwd_bwd": row["time_update_s"] - row["time_optimizer_s"],
                "optimizer": row["time_optimizer_s"],
                "reward": row["reward_mean"],
                "rollout_accuracy": row["rollout_accuracy"],
                "completion_len": row["completion_len"],
                "updated": row["update_frac"],  # completions in groups with signal: the update's rows
                **_memory_fields(device),
            })
        backend.close()
    return {"impl": f"ours-{rollout}", "form": form if rollout == "vllm" else None, "device": device, "steps": steps,
            "departures": {k: v for k, v in changes.items() if not k.endswith(("_dir", ".path"))}}


# ---------------------------------------------------------------------------- TRL's step
def run_trl(args, tuned: bool = False) -> dict:
    """TRL's GRPOTrainer at the same configuration. ``tuned``: gradient checkpointing off and the
    LoRA weights kept in fp32 (TRL casts them to bf16 for a 4-bit base, slow on CPUs without
    AVX512-BF16); otherwise TRL's defaults (checkpointing on, bf16 LoRA)."""
    import datasets
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.algorithm.rewards import REWARDS
    from grpo.config.sections.model import ModelConfig
    from grpo.core.device import default_device
    from grpo.data.sources import build_prompt
    from grpo.model.base_model import load_tokenizer
    from grpo.model.lora_policy import load_training_base

    device = default_device()
    reward_weights = {"correctness": 1.0, "format_strict": 0.1}

    def reward_fn(name):
        def fn(completions, answer, **_):
            return REWARDS[name](completions, [str(a) for a in answer])

        fn.__name__ = name
        return fn

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = _model_dir(args, workdir)
        tok = load_tokenizer(model_dir)
        torch.manual_seed(0)
        model = load_training_base(ModelConfig(path=model_dir), device)
        system = "Solve the math problem. Think briefly, then give the final answer on its own line as '#### <number>'."
        rows = [{"prompt": build_prompt(tok, r["question"], system), "answer": str(r["answer"])} for r in _problems(args)]
        gen_kwargs = {"min_new_tokens": args.new_tokens} if args.fixed_length else None
        config = GRPOConfig(
            output_dir=str(workdir / "trl"), per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group, max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0,
            top_entropy_quantile=args.quantile, beta=args.beta, learning_rate=args.lr, loss_type="dapo",
            max_steps=args.steps + 1, logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=device == "cpu", bf16=device == "cuda", gradient_checkpointing=not tuned,
            reward_weights=list(reward_weights.values()), lr_scheduler_type="constant", seed=0,
            dataloader_num_workers=0, generation_kwargs=gen_kwargs, disable_tqdm=True,
        )
        peft_config = PeftLoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn(n) for n in reward_weights], args=config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
                              peft_config=peft_config)
        if tuned:
            for param in trainer.model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
        timers = {"generate": 0.0, "prepare": 0.0, "loss": 0.0, "backward": 0.0}

        def timed(name, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    timers[name] += time.perf_counter() - t0

            return wrapper

        trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
        trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
        trainer.compute_loss = timed("loss", trainer.compute_loss)
        trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
        steps: list[dict] = []

        class StepClock(TrainerCallback):
            def on_step_begin(self, *_, **__):
                for k in timers:
                    timers[k] = 0.0
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                self.t0 = time.perf_counter()

            def on_step_end(self, *_, **__):
                total = time.perf_counter() - self.t0
                steps.append({
                    "step_s": total,
                    "generate": timers["generate"],
                    "logprob": timers["prepare"] - timers["generate"],
                    "fwd_bwd": timers["loss"] + timers["backward"],
                    "optimizer": total - timers["prepare"] - timers["loss"] - timers["backward"],
                    **_memory_fields(device),
                })

            def on_log(self, _args, _state, _control, logs=None, **__):
                if logs and "reward" in logs and steps:
                    steps[-1]["reward"] = logs["reward"]
                    steps[-1]["completion_len"] = logs.get("completions/mean_length")

        trainer.add_callback(StepClock())
        trainer.train()
    return {"impl": "trl-tuned" if tuned else "trl", "device": device, "steps": steps[1:]}  # step 0 is the warm-up, as for ours


# ---------------------------------------------------------------------------- driver
def _worker(args, spec: dict) -> dict:
    """Run one measurement in a fresh process; ``spec``: {"impl": ..., "overrides": {...}}.
    A failed run stops the benchmark with its error (after the results so far are printed)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", json.dumps(spec)]
    env = {**os.environ, "WANDB_MODE": "disabled"}  # no MALLOC_MMAP_THRESHOLD_: it ~halves CPU speed
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{spec['impl']} run {spec.get('label', '')} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(steps: list[dict], key: str) -> float:
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def _peak_key(result: dict) -> str:
    return "peak_allocated_mb" if result["device"] == "cuda" else "peak_rss_mb"


def summarise(result: dict) -> dict:
    steps = result["steps"]
    out = {k: _median(steps, k) for k in ("step_s", *PHASES)}
    out["reward_mean"] = statistics.fmean(s["reward"] for s in steps if s.get("reward") is not None)
    out["completion_len"] = _median(steps, "completion_len")  # the update's cost follows it
    out["updated"] = statistics.fmean(s.get("updated", 1.0) for s in steps)  # TRL back-propagates every row
    out["step_times"] = [round(s["step_s"], 2) for s in steps]
    out["peak_mb"] = max(s[_peak_key(result)] for s in steps)
    out["departures"] = result.get("departures", {})
    if result["device"] == "cuda":
        out["peak_reserved_mb"] = max(s["peak_reserved_mb"] for s in steps)
    return out


def print_speed(rows: dict[str, dict]) -> None:
    print(f"\n{'impl':<17} {'median step s':>13} " + " ".join(f"{p:>9}" for p in PHASES)
          + f" {'reward':>7} {'length':>7} {'updated':>7} {'peak MB':>8}  steps (s)")
    for name, s in rows.items():
        length = s.get("completion_len", float("nan"))  # mean completion tokens: the update follows it
        print(f"{name:<17} {s['step_s']:13.2f} " + " ".join(f"{s[p]:9.2f}" for p in PHASES)
              + f" {s['reward_mean']:7.3f} {length:7.1f} {s.get('updated', 1.0):7.2f} {s['peak_mb']:8.0f}"
              + f"  {s['step_times']}")
    for other in ("trl", "trl-tuned", "ours-transformers", "ours-dense", "ours-nf4"):
        if "ours" in rows and other in rows:
            print(f"ours / {other} median step time: {rows['ours']['step_s'] / rows[other]['step_s']:.2f}"
                  + (" (the same rule: top entropy quantile, no KL, mu 1)" if other.startswith("trl") else ""))
    if "ours-default-rule" in rows and "trl" in rows:
        mu = rows["ours-default-rule"]["departures"].get("train.optimizer.mu")
        print(f"ours under the params' default rule (mu {mu}) / trl median step time: "
              f"{rows['ours-default-rule']['step_s'] / rows['trl']['step_s']:.2f} (not the same work)")
    from grpo.training.trainer_builder import departure_line

    for name, s in rows.items():  # what each of our lines ran: the default params but for these keys
        if s.get("departures"):
            print(f"{name}: the default params but {departure_line(s['departures'])}")
    if "ours" in rows and "ours-transformers" in rows:
        print(f"generation phase, decode loop / engine: "
              f"{rows['ours-transformers']['generate'] / rows['ours']['generate']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/base", help="model directory (ignored with --arch)")
    ap.add_argument("--arch", choices=["qwen2-1.5b", "toy"], help="random model of this architecture instead")
    ap.add_argument("--data", default="data/raw/train.jsonl", help="problems JSONL (else generated arithmetic)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps, after one warm-up step")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="cut/pad every prompt to this many tokens")
    ap.add_argument("--fixed-length", action="store_true", help="suppress EOS: every completion is full length")
    ap.add_argument("--quantile", type=float, default=0.2, help="top_entropy_quantile")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--generation-batch", type=int, default=0, help="completions per generate call (0: all)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="ours: recompute activations")
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer at the same configuration")
    ap.add_argument("--trl-tuned", action="store_true",
                    help="with --trl, also TRL without gradient checkpointing and with fp32 LoRA weights")
    ap.add_argument("--no-ours", action="store_true", help="skip our step (with --trl: TRL only)")
    ap.add_argument("--ablate", action="store_true", help="peak memory with each saving switched off in turn")
    ap.add_argument("--rollout", choices=["vllm", "transformers", "both"],
                    default="both" if importlib.util.find_spec("vllm") else "transformers",
                    help="who samples our rollouts: a vLLM engine holding the policy, our decode loop, or both "
                         "in one run (default: both where vLLM is installed)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the engine's share of GPU memory / RAM")
    ap.add_argument("--engine-weights", nargs="+", choices=["dense", "nf4"], default=["dense"],
                    help="the vLLM engine's forms (train.rollouts.engine_weights), each measured in the same run: "
                         "merged dense weights, or the trainer's own 4-bit weights + the policy's LoRA adapter")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))

    if args.worker:
        spec = json.loads(args.worker)
        if spec["impl"].startswith("trl"):
            result = run_trl(args, tuned=spec["impl"] == "trl-tuned")
        else:
            result = run_ours(args, spec.get("overrides", {}), spec.get("rollout", "transformers"),
                              spec.get("form", args.engine_weights[0]))
        print(json.dumps(result))
        return

    shape = (f"{args.arch or args.model}: {args.prompts} prompts x G={args.group}, "
             f"{args.prompt_tokens or 'natural'} prompt + {args.new_tokens} new tokens"
             f"{' (fixed length)' if args.fixed_length else ''}, quantile {args.quantile}, beta {args.beta}")
    print(shape, flush=True)
    results = {"config": vars(args)}
    t0 = time.perf_counter()
    speed = {}
    rollouts = ["vllm", "transformers"] if args.rollout == "both" else [args.rollout]
    runs = [(r, f) for r in rollouts for f in (args.engine_weights if r == "vllm" else [None])]
    for i, (rollout, form) in enumerate([] if args.no_ours else runs):
        # "ours": the first, the one ablated; then ours-<form> (other engine forms), ours-transformers
        name = "ours" if i == 0 else f"ours-{form or rollout}"
        results[name] = _worker(args, {"impl": "ours", "rollout": rollout, "form": form})
        speed[name] = summarise(results[name])
    default_rule = default_rule_overrides(args.quantile)
    if not args.no_ours and default_rule:  # the params' default rule, beside the rule TRL runs
        spec = {"impl": "ours", "overrides": default_rule, "rollout": runs[0][0], "form": runs[0][1]}
        results["ours-default-rule"] = _worker(args, spec)
        speed["ours-default-rule"] = summarise(results["ours-default-rule"])
    for impl in ("trl", "trl-tuned") if args.trl and args.trl_tuned else ("trl",) if args.trl else ():
        try:
            results[impl] = _worker(args, {"impl": impl})
        except RuntimeError as err:  # keep what was measured; say what failed
            print(err, file=sys.stderr)
            results[impl] = {"error": str(err)[-2000:]}
            continue
        speed[impl] = summarise(results[impl])
    print_speed(speed)
    if args.ablate:
        table = [("all savings on", speed["ours"])]
        variants = [(f"off: {name}", overrides) for name, overrides in SAVINGS.items()]
        variants.append(("all savings off", {k: v for o in SAVINGS.values() for k, v in o.items()}))
        for label, overrides in variants:
            print(f"  running {label} ...", flush=True)
            spec = {"impl": "ours", "overrides": overrides, "label": label, "rollout": runs[0][0], "form": runs[0][1]}
            table.append((label, summarise(_worker(args, spec))))
        unit = "peak allocated MB" if results["ours"]["device"] == "cuda" else "peak RSS MB"
        print(f"\n{'configuration':<68} {unit:>18} {'reserved MB':>12} {'step s':>8}")
        for label, s in table:
            print(f"{label:<68} {s['peak_mb']:18.0f} {s.get('peak_reserved_mb', float('nan')):12.0f} {s['step_s']:8.2f}")
        results["ablation"] = [{"configuration": label, **s} for label, s in table]
        if "trl" in speed:
            print(f"step time ours (all on) / TRL: {speed['ours']['step_s'] / speed['trl']['step_s']:.2f}; "
                  f"ours (all off) / TRL: {table[-1][1]['step_s'] / speed['trl']['step_s']:.2f}")
    print(f"bench wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in speed.items()}))


if __name__ == "__main__":
    main()
