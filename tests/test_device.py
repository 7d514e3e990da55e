"""Device and dtype policy."""

import torch

import grpo.device as device


def test_compute_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpus():
    assert device.compute_dtype("auto", "cuda") == torch.bfloat16
    assert device.compute_dtype("auto", "cpu") == torch.float32
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
