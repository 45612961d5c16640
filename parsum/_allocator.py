"""glibc's heap top, kept between training steps instead of returned and faulted in again.

# NOTE [ glibc's heap top ]
# On Linux with glibc, PyTorch's CPU tensors come from malloc. glibc serves blocks below its mmap
# threshold (128 KB at start) from its heap, and gives the heap's free top back to the system
# once it exceeds the trim threshold (twice the mmap threshold); both rise, up to 32 and 64 MB,
# each time a larger block that was mmapped is freed, and never fall. A training step frees its
# gradients (``zero_grad()``): where they lay at the heap's top and the thresholds are still low,
# glibc returns those pages and the next backward faults every one of them in again. Whether it
# does depends on the process's history: 16 MLPs of widths 128-512 at batch 64 on 2 cores, in
# fresh processes, took 0-820 minor faults a step in the plain loop and 1000-1740 through parsum
# (6.1-6.7 and 7.9-8.3 ms), and none once one block of 31 MB had been allocated and freed at the
# start (5.5-5.7 and 6.3-6.4 ms): the state glibc reaches by itself once any tensor of that size
# is freed, which many training processes do early (a dataset, a checkpoint). parsum takes the
# process there when it is imported. The cost: up to 64 MB of freed heap stay with the process,
# and blocks under 32 MB come from the heap rather than fresh mappings. Where the user set
# glibc's thresholds (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``), glibc no longer adjusts them
# and parsum leaves them alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# Below glibc's ceiling for its dynamic mmap threshold (32 MB with 64-bit longs): a freed block
# larger than that leaves the thresholds where they were.
_BLOCK = 31 * 2**20
_USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def keep_heap_top() -> bool:
    """Raise glibc's dynamic mmap and trim thresholds as freeing a 31 MB tensor would (NOTE
    [ glibc's heap top ]). Whether it did: only under glibc, where the user set nothing."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return False
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    block = malloc(_BLOCK)  # mmapped, never touched: no page of it is resident
    if not block:
        return False
    free(block)
    return True
