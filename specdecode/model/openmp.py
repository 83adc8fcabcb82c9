"""The OpenMP worker threads of the calling thread, released when another thread takes over the compute.

torch and our C kernels share one OpenMP runtime (torch's libgomp), which keeps a pool of worker threads per
thread that has run a parallel region. A server loads the model and measures its costs on the main thread, then
runs every forward on its engine thread: the main thread's idle pool still counts, the runtime sees more workers
than cores, and it stops spin-waiting between parallel regions, so each of a forward's thousands of regions
waits for its workers to wake (a 1.5B GGUF forward on 2 cores: ~52 ms instead of ~42). Releasing the main
thread's pool (OpenMP 5's `omp_pause_resource_all`) leaves one pool, the engine thread's.
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    try:  # the runtime torch loaded (a library already loaded under this name is the one returned)
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        return lib
    except (OSError, AttributeError):  # another OpenMP runtime, or one without OpenMP 5
        return None


def release_thread_workers() -> None:
    """Free the calling thread's OpenMP workers (recreated if it runs a parallel region again)."""
    lib = _runtime()
    if lib is not None:
        lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
