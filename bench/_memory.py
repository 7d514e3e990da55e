"""Peak memory of a block of code: CUDA's allocator counters, or resident-set growth on the CPU.

CPU: a sampler thread reads /proc/self/statm every 2 ms; run the process with
``MALLOC_MMAP_THRESHOLD_=1MiB`` (``CPU_MALLOC_ENV``) so that freed tensors go back to the OS and
RSS follows live tensor memory rather than glibc's arena high-water mark.
"""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class RssPeak:
    """Context manager: peak RSS growth (bytes) while the block runs."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base
