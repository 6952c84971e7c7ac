"""bench/plan.py's timing switch: after the peak is read, a rank's glibc keeps freed blocks up
to 32 MiB in its heap, as its own thresholds settle by default (bench/_measure.py)."""

import platform

import pytest

from _measure import MMAP_THRESHOLD_MAX, keep_freed_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and its thresholds are glibc's")
def test_glibc_accepts_the_heap_thresholds():
    assert MMAP_THRESHOLD_MAX == 32 << 20  # the largest mmap threshold glibc accepts on 64-bit hosts
    assert keep_freed_heap()
