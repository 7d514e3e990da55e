"""``grpo doctor`` (``grpo.rollout.engine.preflight``): one line per check of a GPU machine, exit 2 with one
line naming the blocker. This machine has no GPU: the probes are patched to a good CUDA machine, then
each is made to fail in turn."""

from __future__ import annotations

import pytest

from grpo.core.errors import DeviceError
from grpo.rollout.engine import preflight
from grpo.rollout.engine.preflight import BLOCKER, OK, SKIP, WARN

from .conftest import REPO
from .helpers import run

pytestmark = pytest.mark.usefixtures("quiet_cli_env")  # grpo.tools.cli.main sets TQDM_DISABLE and friends

GIB = 2**30
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.fixture
def gpu_machine(monkeypatch, tmp_path):
    """A machine the CUDA path should run on: torch 2.13 for CUDA 13.0, driver 580, an RTX 4090
    with 20 of 24 GiB free, gcc, Python.h, no nvcc, VLLM_USE_FLASHINFER_SAMPLER unset."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").write_text("/* the headers */\n")
    probes = dict(
        probe_torch=lambda: ("2.13.0+cu130", "13.0"),
        probe_driver=lambda: "580.65.06",
        probe_cuda_usable=lambda: True,
        probe_device=lambda: ("NVIDIA GeForce RTX 4090", (8, 9)),
        probe_arch_list=lambda: list(ARCHS),
        probe_compiler=lambda environ: "/usr/bin/gcc",
        probe_python_include=lambda: include,
        probe_free_memory=lambda: (20 * GIB, 24 * GIB),
        probe_nvcc=lambda environ: None,
        probe_flashinfer_jit_cache=lambda: False,
    )
    for name, probe in probes.items():
        monkeypatch.setattr(preflight, name, probe)
    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "CC", "GRPO_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _check(report, name):
    (found,) = [c for c in report.checks if c.name == name]
    return found


def test_this_cpu_machine_says_there_is_no_cuda_device_and_what_it_would_check(monkeypatch, capsys):
    monkeypatch.delenv("GRPO_DEVICE", raising=False)
    code, out, err = run(capsys, "doctor")
    assert (code, err) == (0, "")
    header, line = out.strip().splitlines()
    assert header.startswith("grpo doctor: torch ") and "CUDA none (a CPU build)" in header
    assert line.startswith("skip    cuda") and "no CUDA device" in line
    for what in ("NVIDIA driver", "get_arch_list", "7.5", "C compiler", "Python.h", "free GPU memory",
                 "VLLM_USE_FLASHINFER_SAMPLER"):
        assert what in line


def test_a_good_gpu_machine_passes_every_check(gpu_machine, capsys):
    report = preflight.run_preflight(18 * GIB)
    assert [(c.name, c.level) for c in report.checks] == [
        ("driver", OK), ("cuda", OK), ("capability", OK), ("compiler", OK), ("python headers", OK),
        ("gpu memory", OK), ("flashinfer sampler", OK)]
    assert report.error_line() is None
    report.raise_for_blockers()
    assert "the project sets it to 0" in _check(report, "flashinfer sampler").message
    code, out, err = run(capsys, "doctor", "--estimate-gib", "18")
    assert (code, err) == (0, "") and len(out.strip().splitlines()) == 8
    assert "ok      gpu memory         20.00 GiB free of 24.00 GiB >= the estimate 18.00 GiB" in out


# (what fails, the probes that make it fail, env, the check's level, text of its line)
FAILURES = [
    ("old driver", {"probe_driver": lambda: "550.54.15"}, {}, BLOCKER,
     "driver             550.54.15 is older than torch 2.13.0+cu130's CUDA 13.0 needs (branch 580 or newer): "
     "update the NVIDIA driver to 580 or newer"),
    ("no driver", {"probe_driver": lambda: None}, {}, BLOCKER,
     "driver             no NVIDIA driver found (no /proc/driver/nvidia/version, no nvidia-smi)"),
    ("no usable GPU", {"probe_cuda_usable": lambda: False}, {}, BLOCKER,
     "cuda               torch 2.13.0+cu130 (CUDA 13.0) sees no usable GPU (torch.cuda.is_available() is False)"),
    ("a GTX 1080", {"probe_device": lambda: ("NVIDIA GeForce GTX 1080", (6, 1))}, {}, BLOCKER,
     "capability         NVIDIA GeForce GTX 1080 is compute capability 6.1, below 7.5: bitsandbytes' CUDA 13 "
     "library and vLLM's 4-bit kernels start at 7.5 (T4 / RTX 20xx); use a newer card"),
    ("a card torch was not built for", {"probe_arch_list": lambda: ["sm_80", "sm_90"],
                                        "probe_device": lambda: ("Tesla T4", (7, 5))}, {}, BLOCKER,
     "capability         Tesla T4 (compute capability 7.5) is not in this torch build's architectures (sm_80, "
     "sm_90): install a torch build for sm_75"),
    ("a T4 (fp16)", {"probe_device": lambda: ("Tesla T4", (7, 5))}, {}, WARN,
     "capability         Tesla T4 (compute capability 7.5, torch has sm_75): fp16 compute (bf16 needs 8.0)"),
    ("no C compiler", {"probe_compiler": lambda environ: None}, {}, BLOCKER,
     "compiler           no C compiler (Triton builds its kernel launchers with $CC, gcc or clang at the first "
     "kernel launch, and vLLM compiles two sampler helpers with Inductor in the training process even with "
     "enforce_eager): install gcc (apt-get install gcc) or set CC"),
    ("CC names nothing", {"probe_compiler": lambda environ: None}, {"CC": "/opt/none/cc"}, BLOCKER,
     "compiler           CC=/opt/none/cc is not an executable"),
    ("no Python.h", {"probe_python_include": lambda: REPO / "no-such-include"}, {}, BLOCKER,
     f"python headers     no Python.h in {REPO / 'no-such-include'} (Triton compiles its launchers against it, "
     "and Inductor vLLM's sampler helpers): install the headers of Python"),
    ("too little free memory", {"probe_free_memory": lambda: (5 * GIB, 24 * GIB)}, {}, BLOCKER,
     "gpu memory         5.00 GiB free of 24.00 GiB < the estimate 18.00 GiB: stop what else holds the card "
     "(nvidia-smi lists it)"),
    ("barely enough free memory", {"probe_free_memory": lambda: (19 * GIB, 24 * GIB)}, {}, WARN,
     "gpu memory         19.00 GiB free of 24.00 GiB, within 10% of the estimate 18.00 GiB"),
    ("FlashInfer on, no nvcc", {}, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, BLOCKER,
     "flashinfer sampler VLLM_USE_FLASHINFER_SAMPLER=1 (set by you) but no nvcc (CUDA_HOME, PATH, /usr/local/cuda) "
     "and no flashinfer-jit-cache: FlashInfer cannot compile its sampler and every vLLM engine dies at start; unset "
     "VLLM_USE_FLASHINFER_SAMPLER (the project then sets 0)"),
    ("FlashInfer on, nvcc there", {"probe_nvcc": lambda environ: "/usr/local/cuda/bin/nvcc"},
     {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, WARN,
     "flashinfer sampler VLLM_USE_FLASHINFER_SAMPLER=1 (set by you): FlashInfer compiles its sampler with "
     "/usr/local/cuda/bin/nvcc at the first engine start"),
    ("FlashInfer switch not a number", {}, {"VLLM_USE_FLASHINFER_SAMPLER": "yes"}, BLOCKER,
     "flashinfer sampler VLLM_USE_FLASHINFER_SAMPLER='yes': vLLM reads it with int(); set 0 or 1"),
    ("FlashInfer switch empty", {}, {"VLLM_USE_FLASHINFER_SAMPLER": ""}, BLOCKER,
     "flashinfer sampler VLLM_USE_FLASHINFER_SAMPLER='': vLLM reads it with int(); set 0 or 1"),
]


@pytest.mark.parametrize(("what", "probes", "env", "level", "text"), FAILURES, ids=[f[0] for f in FAILURES])
def test_each_probe_that_fails_gives_its_line_and_a_blocker_exits_2(what, probes, env, level, text, gpu_machine,
                                                                   capsys):
    for name, probe in probes.items():
        gpu_machine.setattr(preflight, name, probe)
    for var, value in env.items():
        gpu_machine.setenv(var, value)
    code, out, err = run(capsys, "doctor", "--estimate-gib", "18")
    lines = out.strip().splitlines()
    line = next((x for x in lines if text in x), None)
    assert line is not None, out
    assert line.startswith(f"{level:<7} ")
    assert sum(x.startswith(("BLOCKER", "warn")) for x in lines) == 1, out  # the others stay ok (or skip)
    if level == BLOCKER:
        (stderr_line,) = err.strip().splitlines()
        name = line[8:26].strip()
        assert code == 2 and stderr_line == f"grpo doctor: error: {name}: {line[27:]}"
    else:
        assert (code, err) == (0, "")


def test_without_a_usable_gpu_the_device_checks_are_skipped_and_several_blockers_are_counted(gpu_machine):
    gpu_machine.setattr(preflight, "probe_cuda_usable", lambda: False)
    gpu_machine.setattr(preflight, "probe_driver", lambda: "535.104.05")
    report = preflight.run_preflight()
    assert [(c.name, c.level) for c in report.checks if c.level != OK] == [
        ("driver", BLOCKER), ("cuda", BLOCKER), ("capability", SKIP), ("gpu memory", SKIP)]
    assert report.error_line().startswith("2 blockers (driver, cuda); first: driver: 535.104.05 is older than")
    with pytest.raises(Exception, match="GPU preflight: 2 blockers"):
        report.raise_for_blockers()


def test_grpo_device_cpu_checks_nothing(gpu_machine):
    gpu_machine.setenv("GRPO_DEVICE", "cpu")
    (check,) = preflight.run_preflight().checks
    assert check.level == SKIP and check.message.startswith("GRPO_DEVICE=cpu: the pipeline runs on the CPU on purpose")


def test_the_flashinfer_line_says_who_set_the_sampler_off(gpu_machine):
    """Unset: the project's engines set it to 0 (``grpo.rollout.engine.args.start_environment``); 0: the
    user did."""
    check = _check(preflight.run_preflight(), "flashinfer sampler")
    assert check.level == OK and "unset: the project sets it to 0" in check.message
    gpu_machine.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    check = _check(preflight.run_preflight(), "flashinfer sampler")
    assert check.level == OK and "=0 (set by you)" in check.message


@pytest.mark.parametrize(("capability", "archs", "entry"), [
    ((8, 6), ["sm_75", "sm_80", "sm_90"], "sm_80"),  # a cubin runs on later minors of its major
    ((8, 9), ["sm_80", "sm_86", "sm_90", "compute_90"], "sm_86"),  # the nearest one
    ((9, 0), ["sm_80", "sm_90", "sm_90a"], "sm_90"),
    ((8, 0), ["sm_86"], None),  # not on earlier ones
    ((9, 0), ["sm_90a"], "sm_90a"),
    ((10, 0), ["sm_90a"], None),  # arch-specific code runs on that card only
    ((12, 1), ["sm_100", "compute_120"], "compute_120"),  # PTX is compiled for newer cards
    ((12, 0), ["sm_100"], None),  # another major: no cubin runs
    ((7, 5), [], None),
])
def test_which_of_torchs_architectures_runs_on_a_card(capability, archs, entry):
    assert preflight.covered(capability, archs) == entry


def test_the_driver_is_read_from_the_kernel_module_without_cuda(monkeypatch, tmp_path):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                       "(dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 2025\nGCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(preflight, "DRIVER_VERSION_FILE", version)
    assert preflight.probe_driver() == "580.65.06"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert preflight.probe_driver() == "550.54.15"


def test_the_compiler_is_the_one_triton_would_use(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert preflight.probe_compiler({}) is None
    for name in ("clang", "gcc"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert preflight.probe_compiler({}) == str(tmp_path / "gcc")  # gcc before clang, as Triton
    assert preflight.probe_compiler({"CC": "clang"}) == str(tmp_path / "clang")
    assert preflight.probe_compiler({"CC": str(tmp_path / "missing")}) is None


def test_the_pipeline_runs_the_doctor_before_dvc_repro_where_nvidia_smi_exists():
    script = (REPO / "scripts" / "pipeline.sh").read_text()
    doctor = script.index("python -m grpo.tools.cli doctor")
    assert "command -v nvidia-smi" in script[:doctor] and doctor < script.index("\ndvc repro")


@pytest.mark.parametrize(("free_gib", "level"), [(5.0, BLOCKER), (7.2, WARN)])
def test_with_params_free_memory_is_held_to_the_largest_stage_need_on_this_card(free_gib, level, gpu_machine,
                                                                                 capsys):
    """``grpo doctor --params`` (what scripts/pipeline.sh runs): on a card reporting 7.6 GiB, seed
    003's largest need is the evaluations' engine share at its start, 0.78 x 7.6 = 5.93 GiB, beside
    the stage's own CUDA context (``grpo.tools.memory.CUDA_CONTEXT``; the needs of each stage:
    tests/test_check_report.py); free memory within 10% of it warns."""
    from grpo.tools.memory import CUDA_CONTEXT

    card = int(7.6 * GIB)
    gpu_machine.setattr(preflight, "probe_free_memory", lambda: (int(free_gib * GIB), int(7.6 * GIB)))
    code, out, err = run(capsys, "doctor", "--params", str(REPO / "presets/seed003.yaml"))
    (line,) = [x for x in out.splitlines() if "gpu memory" in x]
    assert line.startswith(f"{level:<7} gpu memory         {free_gib:.2f} GiB free of 7.60 GiB")
    assert f"the estimate {(int(0.78 * card) + CUDA_CONTEXT) / GIB:.2f} GiB" in line
    assert code == (2 if level == BLOCKER else 0)


def test_the_flows_gpu_check_stops_on_a_blocker_in_one_line_and_checks_once(gpu_machine):
    """``require_ready_gpu`` (the Prefect flow's first call): a CUDA machine without a C compiler
    stops with one ``DeviceError`` line naming the check; once a machine passed, it is not probed again."""
    gpu_machine.setattr(preflight, "_READY", False)
    gpu_machine.setattr(preflight, "probe_compiler", lambda environ: None)
    with pytest.raises(DeviceError) as err:
        preflight.require_ready_gpu()
    assert str(err.value).startswith("GPU preflight: compiler: no C compiler") and "\n" not in str(err.value)
    gpu_machine.setattr(preflight, "probe_compiler", lambda environ: "/usr/bin/gcc")
    preflight.require_ready_gpu()
    gpu_machine.setattr(preflight, "probe_compiler", lambda environ: None)
    preflight.require_ready_gpu()  # passed once in this process: not probed again
