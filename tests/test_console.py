"""grpo.core.console: a stage's terminal shows the project's lines; other libraries' go to its log file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import logging, os, sys, warnings
from grpo.core import console
path = console.setup("demo", verbose=console.verbose_from_env())
console.route_libraries(path)
logging.getLogger("grpo.training.trainer").info("own line")
logging.getLogger("__main__").info("stage line")
logging.getLogger("vllm.engine").info("engine chatter")
logging.getLogger("bitsandbytes").warning("please pip install kernels")
logging.getLogger("vllm").error("engine failed")
warnings.warn("a library's warning")
print("vllm handler env:", os.environ.get("VLLM_CONFIGURE_LOGGING"), file=sys.stderr)
console.name_log(path)
"""


def run_demo(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("GRPO_VERBOSE", "VLLM_CONFIGURE_LOGGING", "RANK")}
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                          env={**environ, "PYTHONPATH": str(REPO / "src"), **env}, timeout=120)


def test_the_terminal_shows_own_lines_and_library_errors_the_file_everything(tmp_path):
    proc = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stderr
    term = proc.stderr
    assert "[demo] INFO own line" in term and "[demo] ERROR engine failed" in term
    assert "[demo] INFO stage line" in term  # a stage run as python -m tasks.<stage> logs as __main__
    assert "outputs/logs/demo.log" in term.splitlines()[-1]  # the last line names the file
    for quiet in ("engine chatter", "please pip install kernels", "a library's warning"):
        assert quiet not in term, quiet
    log = (tmp_path / "outputs/logs/demo.log").read_text()
    for line in ("own line", "engine chatter", "please pip install kernels", "a library's warning", "engine failed"):
        assert line in log, line
    assert "vllm handler env: 0" in term  # vLLM, imported after setup, logs through the root logger


@pytest.mark.parametrize("value", ["1", "yes"])
def test_grpo_verbose_brings_every_line_back_to_the_terminal(tmp_path, value):
    proc = run_demo(tmp_path, GRPO_VERBOSE=value)
    assert proc.returncode == 0, proc.stderr
    for line in ("own line", "engine chatter", "please pip install kernels", "engine failed"):
        assert line in proc.stderr, line
    assert not (tmp_path / "outputs/logs").exists()


def test_a_worker_rank_writes_its_own_file(tmp_path):
    assert run_demo(tmp_path, RANK="1").returncode == 0
    assert (tmp_path / "outputs/logs/demo.rank1.log").exists() and not (tmp_path / "outputs/logs/demo.log").exists()


def test_a_line_under_a_running_bar_goes_through_tqdm_write(tmp_path):
    """With a bar open, the handler's line lands on its own line above the bar (tqdm.write clears
    the bar, writes, redraws), not glued into the bar's text."""
    code = """
import io, logging
from tqdm import tqdm
from grpo.core.console import TqdmHandler
buf = io.StringIO()
h = TqdmHandler(buf); logging.getLogger().addHandler(h); logging.getLogger().setLevel(logging.INFO)
with tqdm(total=3, file=buf, desc="train", ascii=True) as bar:
    bar.update(1); logging.getLogger("grpo.x").info("validation 0.5"); bar.update(1)
text = buf.getvalue()
print("\\rvalidation 0.5\\n" in text, "]validation" in text)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}).stdout
    assert out.split() == ["True", "False"], out  # the bar cleared (\\r) before the line; never glued to it
