"""Device and dtype policy."""

import torch

import grpo.core.device as device


def test_compute_dtype_auto_is_bf16_on_cuda_and_follows_native_bf16_on_cpus(monkeypatch):
    assert device.compute_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.compute_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.compute_dtype("auto", "cpu") == torch.bfloat16
    assert device.compute_dtype("bfloat16", "cpu") == torch.bfloat16
    assert device.compute_dtype("float32", "cuda") == torch.float32


def test_sampling_dtype_auto_follows_native_bf16(tmp_path, monkeypatch):
    with_bf16, without = tmp_path / "a", tmp_path / "b"
    with_bf16.write_text("flags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert device.cpu_has_native_bf16(with_bf16) and not device.cpu_has_native_bf16(without)
    assert not device.cpu_has_native_bf16(tmp_path / "missing")
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.sampling_dtype("auto", "cpu") == "float32"
    assert device.sampling_dtype("auto", "cuda") == "bfloat16"
    assert device.sampling_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.sampling_dtype("auto", "cpu") == "bfloat16"


def test_auto_is_bf16_from_compute_capability_8_and_fp16_below(monkeypatch):
    """vLLM refuses bf16 below compute capability 8.0 (vllm/platforms/cuda.py:636-654 in 0.32.0)."""
    for capability, dtype in (((7, 5), torch.float16), ((7, 0), torch.float16), ((6, 1), torch.float16),
                              ((8, 0), torch.bfloat16), ((8, 6), torch.bfloat16), ((9, 0), torch.bfloat16),
                              ((12, 0), torch.bfloat16), (None, torch.bfloat16)):
        assert device.compute_dtype("auto", "cuda", capability) == dtype, capability
        assert device.sampling_dtype("auto", "cuda", capability) == str(dtype).removeprefix("torch.")
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.compute_dtype("auto", "cpu", (7, 5)) == torch.float32  # CPUs: the capability is a GPU's
    assert device.compute_dtype("float16", "cpu") == torch.float16
    assert device.compute_dtype("bfloat16", "cuda", (7, 5)) == torch.bfloat16  # named: as named


def test_auto_reads_the_cards_own_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))  # a T4
    assert device.cuda_capability("cuda") == (7, 5)
    assert device.compute_dtype("auto", "cuda") == torch.float16
    assert device.sampling_dtype("auto", "cuda") == "float16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))  # an RTX 3060 Ti
    assert device.compute_dtype("auto", "cuda") == torch.bfloat16


def test_float16_is_a_dtype_param():
    import pytest

    from grpo.config.reading import ParamsError
    from grpo.config.sections.model import ModelConfig
    from grpo.config.sections.sent import SentConfig

    assert ModelConfig(dtype="float16").dtype == SentConfig(dtype="float16").dtype == "float16"
    with pytest.raises(ParamsError, match="model.dtype"):
        ModelConfig(dtype="half")


def _cuda_build_without_gpu(monkeypatch, cuda: str | None = "13.0"):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)


def test_a_cuda_build_without_a_usable_gpu_stops_with_one_line(monkeypatch):
    import pytest

    from grpo.core.errors import DeviceError

    _cuda_build_without_gpu(monkeypatch)
    with pytest.raises(DeviceError) as err:
        device.default_device()
    (line,) = str(err.value).splitlines()
    assert "built for CUDA 13.0 but sees no usable GPU" in line and "branch 580 or newer" in line
    assert line.endswith("to run on the CPU on purpose set GRPO_DEVICE=cpu")
    assert device.describe_device() == f"none usable: {line}"  # reports say so instead of failing
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.default_device() == "cpu"  # on purpose
    monkeypatch.setenv(device.DEVICE_ENV, "gpu")
    with pytest.raises(DeviceError, match="GRPO_DEVICE='gpu': must be cpu or cuda"):
        device.default_device()
    _cuda_build_without_gpu(monkeypatch, cuda=None)  # a CPU build: the CPU, as before
    assert device.default_device() == "cpu"
    monkeypatch.setenv(device.DEVICE_ENV, "cuda")
    with pytest.raises(DeviceError, match="is a CPU build"):
        device.default_device()


def test_a_stage_on_such_a_build_exits_2_with_that_line(monkeypatch, capsys):
    from grpo.config.sections.train import TrainConfig
    from tasks._common import run_stage

    from .conftest import REPO

    _cuda_build_without_gpu(monkeypatch, cuda="12.8")
    code = run_stage("train", lambda params: device.default_device(), (TrainConfig,),
                     ["--params", str(REPO / "params.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("train: error: torch ") and "branch 525 or newer" in err[0] and "GRPO_DEVICE=cpu" in err[0]


def test_free_cuda_cache_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    device.free_cuda_cache("cpu")
    assert calls == []
    device.free_cuda_cache("cuda")
    device.free_cuda_cache(torch.device("cuda", 0))
    assert calls == ["empty_cache"] * 2


def test_fp16_is_refused_for_a_family_that_overflows_in_it_before_anything_loads(tmp_path):
    """A tiny random Qwen2 in fp16 (what ``auto`` gives on a pre-Ampere card): the training base
    refuses with one line naming the param and the way out; bf16, fp32 and a Llama in fp16 load."""
    import pytest
    from transformers import LlamaConfig, Qwen2Config

    from grpo.config.sections.model import ModelConfig
    from grpo.core.errors import ModelConfigError
    from grpo.model.lora_policy import load_training_base
    from grpo.tools.synthetic import char_tokenizer, random_model_dir

    small = dict(vocab_size=len(char_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)
    qwen = random_model_dir(tmp_path / "qwen2", Qwen2Config(**small))
    llama = random_model_dir(tmp_path / "llama", LlamaConfig(**small))
    assert device.model_type(qwen) == "qwen2" and device.model_type("someone/unknown-model") is None
    # a hub id or a folder not prepared yet: the architecture known for the name
    assert device.model_type("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B") == "qwen2"
    with pytest.raises(ModelConfigError, match=r"^model.dtype: fp16 .* refused for deepseek-ai/DeepSeek-R1-Distill"):
        device.refuse_half_overflow("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", torch.float16)
    with pytest.raises(ModelConfigError, match=r"^model.dtype: fp16 .* refused .*QwenLM/Qwen3 issue 826.*float32") as err:
        load_training_base(ModelConfig(path=str(qwen), dtype="float16", quantization="none"))
    assert "\n" not in str(err.value)
    assert load_training_base(ModelConfig(path=str(qwen), dtype="float32", quantization="none")) is not None
    assert load_training_base(ModelConfig(path=str(llama), dtype="float16", quantization="none")) is not None
    device.refuse_half_overflow(qwen, torch.bfloat16)  # bf16 (Ampere and newer): no refusal


def test_the_cpu_line_names_the_model_and_whether_it_computes_in_bf16(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_bf16\n")
    assert device.cpu_model(info) == "AMD EPYC 9R14" and device.cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    assert device.cpu_model(info) == "unknown model" and not device.cpu_has_native_bf16(info)
    assert device.cpu_model(tmp_path / "missing") == "unknown model"
