"""Shared fixtures: a tiny random Llama with a character-level tokenizer and a chat template
(``grpo.tools.synthetic``), a real local Prefect server for the deployment tests, and the environment
the ``grpo`` command sets. Plain helpers that several test modules share are in helpers.py.

Everything here is built offline in about a second (the server starts in some seconds, once per
session, for the tests that ask for it); no test downloads anything.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run (and are tested) in Triton's CPU interpreter.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DVC_STUDIO_OFFLINE", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

REPO = Path(__file__).resolve().parents[1]


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build_tiny_model_dir(path: Path, seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                         vocab: int | None = None) -> Path:
    """A 2-layer random Llama (hidden 64 by default) saved with the character tokenizer at ``path``
    (``vocab``: its vocabulary padded with filler tokens to that size)."""
    from transformers import LlamaConfig

    from grpo.tools.synthetic import char_tokenizer, random_model_dir

    cfg = LlamaConfig(
        vocab_size=vocab or len(char_tokenizer()),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return random_model_dir(path, cfg, seed=seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with head_dim 64: vLLM's CPU attention rejects head_dim 16."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-hd64"), hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def model_dtype() -> str:
    """The dtype (its name) the cuda-marked tests load models and start engines in here:
    ``helpers.model_test_dtype`` of the default device and its card (fp32 on a CPU)."""
    from grpo.core.device import cuda_capability, default_device

    from .helpers import model_test_dtype

    return model_test_dtype(default_device(), cuda_capability())


@pytest.fixture(scope="session")
def auto_dtype() -> str:
    """``auto``: the dtype setting of the cuda-marked tests that run the product's own choice (on
    CUDA the card's 16-bit dtype); what it resolves to is ``helpers.auto_test_dtype``."""
    return "auto"


@pytest.fixture(scope="session")
def half_dtype():
    """The torch dtype of the kernel tests' 16-bit inputs here: ``helpers.half_test_dtype`` (the
    card's, bf16 on a CPU)."""
    import torch

    from grpo.core.device import cuda_capability

    from .helpers import half_test_dtype

    return getattr(torch, half_test_dtype("cuda" if torch.cuda.is_available() else "cpu", cuda_capability()))


@pytest.fixture(scope="session")
def tiny_problems() -> list[dict]:
    return [
        {"id": f"p{i}", "question": f"What is {a} + {b}?", "answer": str(a + b), "solution": ""}
        for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (0, 7), (4, 4), (8, 1)])
    ]


@pytest.fixture
def quiet_cli_env(monkeypatch):
    """``grpo.tools.cli.main`` sets these (setdefault); set them here so the test session gets them back."""
    for key, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TQDM_DISABLE", "1")):
        monkeypatch.setenv(key, value)


def make_dvc_workspace(ws: Path, params: dict) -> Path:
    """A temporary git + DVC repo holding this project's stages, code and a complete params.yaml:
    the repo's, with ``params`` put over it (as a preset is)."""
    import shutil
    import sys

    import yaml

    for name in ("tasks", "src", "flows"):
        shutil.copytree(REPO / name, ws / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "dvc.yaml", ws / "dvc.yaml")
    from grpo.evaluation.seed_headline import PATH as HEADLINE  # the report stage's one committed data dependency

    (ws / HEADLINE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / HEADLINE, ws / HEADLINE)
    from grpo.config.overlay import overlay_params

    full = overlay_params(yaml.safe_load((REPO / "params.yaml").read_text()), params)
    (ws / "params.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "tiny pipeline"]):
        subprocess.run(cmd, cwd=ws, check=True, capture_output=True)
    return ws


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_prefect(home: Path, extra_env: dict[str, str] | None = None):
    """A real ``prefect server start`` on a free loopback port with ``home`` as PREFECT_HOME (and
    ``extra_env``, e.g. the server's auth string), stopped on exit: ``{"api", "env", "home"}``, where
    ``env`` is this process's environment with PREFECT_API_URL set and the test's interpreter first
    on PATH."""
    import sys
    import time

    import httpx

    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false",
           # a run waiting for a concurrency slot asks again after at most this long (default 30 s)
           "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "2", **(extra_env or {})}
    env.pop("PREFECT_API_URL", None)
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:  # /health needs no auth
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:])
            time.sleep(1)
        else:
            raise RuntimeError("prefect server did not start in 120 s")
        yield {"api": api, "env": {**env, "PREFECT_API_URL": api}, "home": home}
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real ``prefect server start`` for the session (``serve_prefect``)."""
    with serve_prefect(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server
