"""Importing parsum raises glibc's dynamic heap thresholds (NOTE [ glibc's heap top ])."""

import os
import platform
import subprocess
import sys

import pytest

from parsum import _allocator

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc only",
)

# A 16 MB block comes from the heap (below the program break) once the mmap threshold is above
# it, and from a fresh mapping (far above the break) while it is at glibc's initial 128 KB.
PROBE = """
import ctypes
{imports}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
block = libc.malloc(16 << 20)
print("heap" if block < libc.sbrk(0) else "mapped")
libc.free(block)
"""


def probe(imports: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_keeps_the_heap_top():
    assert probe("import torch") == "mapped"  # glibc's start, torch alone
    assert probe("import torch, parsum") == "heap"


def test_thresholds_the_user_set_are_left_alone(monkeypatch):
    assert probe("import torch, parsum", MALLOC_MMAP_THRESHOLD_="131072") == "mapped"
    # Whatever this process's environment sets (a machine's image may set MALLOC_*_ itself).
    for name in (*_allocator._USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert not _allocator.keep_heap_top()
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert _allocator.keep_heap_top()
