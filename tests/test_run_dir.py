"""grpo.training.run_dir: what a run writes."""

import hashlib
import os
import subprocess
import sys

import pytest

from .conftest import REPO

SHIP = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo.training.run_dir import RunDir
model_dir, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(
    r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
RunDir(out + "/run", keep_best=False).ship(out + "/adapter", model, AutoTokenizer.from_pretrained(model_dir), [])
"""


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow  # two Python processes that load torch and peft: about 12 s
def test_the_same_adapter_is_the_same_bytes_under_any_hash_seed(tiny_model_dir, tmp_path):
    """Two processes with different string-hash seeds ship the same weights: every file of the
    adapter directory (the one DVC hashes) is byte-identical, adapter_config.json included."""
    shipped = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO / "src")}
        subprocess.run([sys.executable, "-c", SHIP, str(tiny_model_dir), str(out)], check=True, env=env,
                       cwd=REPO, capture_output=True)
        shipped.append(_digests(out / "adapter"))
    assert "adapter_config.json" in shipped[0]
    assert shipped[0] == shipped[1]
