"""``bench/gpu.py`` imports everywhere and, on a host without CUDA, skips cleanly."""

from __future__ import annotations

import pytest


class TestGpuBench:
    """The GPU benchmark's entry point on this host."""

    def test_skips_without_cuda(self, capsys: pytest.CaptureFixture[str]) -> None:
        import torch

        from bench import gpu

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is here: run `python -m bench.gpu` itself")
        assert gpu.main(["--saves", "1"]) == 0
        assert capsys.readouterr().out.strip() == gpu.SKIP
