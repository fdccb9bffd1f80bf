"""Process memory: what a long-lived l4m process hands back to the kernel once its start-up is done.

Shared by the controller runner (after its session is up) and the executor (after it loads a model):
both free more during start-up than they keep, and glibc holds freed heap pages resident until asked.
"""

from __future__ import annotations


def release_free_memory() -> bool:
    """Hands the C heap's free pages back to the kernel (glibc's `malloc_trim`); False where the C library
    has none (musl). In a controller the imports and the session's start leave ~0.5 MiB freed but
    resident, which an idle controller would hold for as long as it waits (docs/benchmarks.md, "Controller
    memory"); in the executor, the loader's float32 tensors the engine did not keep (~680 MiB for
    SmolLM2). ~0.3 ms in a controller.

    It calls through `_ctypes`, ctypes' C core, not `ctypes`: that module's C types (~0.2 MiB of type
    objects) would stay with the controller for its whole life, for one call."""
    try:
        import _ctypes

        address = _ctypes.dlsym(_ctypes.dlopen(None, _ctypes.RTLD_LOCAL), "malloc_trim")
    except (ImportError, OSError):  # an interpreter without ctypes, or a C library without the call
        return False

    class Trim(_ctypes.CFuncPtr):  # ctypes.CFUNCTYPE(None, c_int): a cdecl function, its result ignored
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = None

    Trim(address)(0)
    return True
