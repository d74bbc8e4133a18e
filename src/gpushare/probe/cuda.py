"""The CUDA driver API through ctypes, as much as the enforcement probe needs.

Nothing but ``libcuda.so.1`` (which the NVIDIA container runtime injects) is needed:
no CUDA toolkit, no nvcc, no Python CUDA package. Each function is declared once in
:data:`PROTOTYPES` with its C types, as ``cuda.h`` spells them; the ctypes types follow
from :data:`C_TYPES`. A test compiles these declarations against ``cuda.h`` from the
``nvidia-cuda-runtime-cu12`` wheel (function pointer types must match exactly, and every
C type's size must be its ctypes type's), so no GPU is needed to catch a wrong prototype.

Versioned names are used where ``cuda.h`` maps a name to a version by macro
(``cuMemAlloc`` -> ``cuMemAlloc_v2``): the library exports both, and the old unversioned
symbols take 32-bit sizes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class MemLocation(ctypes.Structure):
    """``CUmemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (``CUmemAllocationProp_v1``)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", MemAllocFlags),
    ]


#: Structures the probe passes, by their C name: checked against cuda.h (size, offsets).
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "CUmemLocation": MemLocation,
    "CUmemAllocationProp": MemAllocationProp,
}

#: C type (as the prototypes below write it) -> ctypes type.
C_TYPES: dict[str, Any] = {
    "CUresult": ctypes.c_int,
    "int": ctypes.c_int,
    "int *": ctypes.POINTER(ctypes.c_int),
    "unsigned int": ctypes.c_uint,
    "unsigned long long": ctypes.c_ulonglong,
    "size_t": ctypes.c_size_t,
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "CUdevice": ctypes.c_int,
    "CUdevice *": ctypes.POINTER(ctypes.c_int),
    "CUcontext": ctypes.c_void_p,
    "CUcontext *": ctypes.POINTER(ctypes.c_void_p),
    "CUdeviceptr": ctypes.c_uint64,
    "CUdeviceptr *": ctypes.POINTER(ctypes.c_uint64),
    "CUmodule": ctypes.c_void_p,
    "CUmodule *": ctypes.POINTER(ctypes.c_void_p),
    "CUfunction": ctypes.c_void_p,
    "CUfunction *": ctypes.POINTER(ctypes.c_void_p),
    "CUstream": ctypes.c_void_p,
    "CUstream *": ctypes.POINTER(ctypes.c_void_p),
    "const void *": ctypes.c_void_p,
    "const char *": ctypes.c_char_p,
    "const char **": ctypes.POINTER(ctypes.c_char_p),
    "void **": ctypes.POINTER(ctypes.c_void_p),
    "CUmemGenericAllocationHandle": ctypes.c_ulonglong,
    "CUmemGenericAllocationHandle *": ctypes.POINTER(ctypes.c_ulonglong),
    "const CUmemAllocationProp *": ctypes.POINTER(MemAllocationProp),
    "CUmemAllocationGranularity_flags": ctypes.c_int,
}

#: ``cuMemAllocManaged``'s flag: memory any stream may reach (cudaMallocManaged's default).
CU_MEM_ATTACH_GLOBAL = 1

#: Every function the probe calls: name -> (return type, argument types), in C.
PROTOTYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "cuInit": ("CUresult", ("unsigned int",)),
    "cuDriverGetVersion": ("CUresult", ("int *",)),
    "cuDeviceGet": ("CUresult", ("CUdevice *", "int")),
    "cuDeviceGetCount": ("CUresult", ("int *",)),
    "cuGetErrorName": ("CUresult", ("CUresult", "const char **")),
    "cuCtxCreate_v2": ("CUresult", ("CUcontext *", "unsigned int", "CUdevice")),
    "cuCtxDestroy_v2": ("CUresult", ("CUcontext",)),
    "cuCtxSynchronize": ("CUresult", ()),
    "cuMemGetInfo_v2": ("CUresult", ("size_t *", "size_t *")),
    "cuMemAlloc_v2": ("CUresult", ("CUdeviceptr *", "size_t")),
    "cuMemFree_v2": ("CUresult", ("CUdeviceptr",)),
    "cuStreamCreate": ("CUresult", ("CUstream *", "unsigned int")),
    "cuStreamSynchronize": ("CUresult", ("CUstream",)),
    "cuStreamDestroy_v2": ("CUresult", ("CUstream",)),
    "cuMemAllocAsync": ("CUresult", ("CUdeviceptr *", "size_t", "CUstream")),
    "cuMemFreeAsync": ("CUresult", ("CUdeviceptr", "CUstream")),
    "cuMemAllocManaged": ("CUresult", ("CUdeviceptr *", "size_t", "unsigned int")),
    "cuMemGetAllocationGranularity": (
        "CUresult",
        ("size_t *", "const CUmemAllocationProp *", "CUmemAllocationGranularity_flags"),
    ),
    "cuMemCreate": (
        "CUresult",
        (
            "CUmemGenericAllocationHandle *",
            "size_t",
            "const CUmemAllocationProp *",
            "unsigned long long",
        ),
    ),
    "cuMemRelease": ("CUresult", ("CUmemGenericAllocationHandle",)),
    "cuModuleLoadData": ("CUresult", ("CUmodule *", "const void *")),
    "cuModuleGetFunction": ("CUresult", ("CUfunction *", "CUmodule", "const char *")),
    "cuModuleUnload": ("CUresult", ("CUmodule",)),
    "cuLaunchKernel": (
        "CUresult",
        (
            "CUfunction",
            "unsigned int",
            "unsigned int",
            "unsigned int",
            "unsigned int",
            "unsigned int",
            "unsigned int",
            "unsigned int",
            "CUstream",
            "void **",
            "void **",
        ),
    ),
}


class CudaError(RuntimeError):
    def __init__(self, function: str, code: int, name: str) -> None:
        super().__init__(f"{function} failed: {name} ({code})")
        self.function = function
        self.code = code


class Driver:
    """``libcuda.so.1`` with the prototypes above bound; ``call`` raises CudaError,
    ``try_call`` returns the CUresult."""

    def __init__(self, path: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in PROTOTYPES.items():
            function = getattr(self.lib, name)
            function.restype = C_TYPES[restype]
            function.argtypes = [C_TYPES[a] for a in argtypes]

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return f"CUresult {code}"
        return text.value.decode(errors="replace")

    def try_call(self, name: str, *args: Any) -> int:
        function: Callable[..., int] = getattr(self.lib, name)
        return int(function(*args))

    def call(self, name: str, *args: Any) -> None:
        code = self.try_call(name, *args)
        if code != CUDA_SUCCESS:
            raise CudaError(name, code, self.error_name(code))


#: A kernel that keeps the SMs busy: each thread runs ``iters`` dependent multiply-adds
#: and stores the result (so nothing is optimised away). Hand-written PTX (ISA 6.0,
#: sm_50 and newer): the driver JIT-compiles it, no nvcc needed.
SPIN_PTX = b"""\
.version 6.0
.target sm_50
.address_size 64

.visible .entry spin(
    .param .u64 spin_out,
    .param .u32 spin_iters
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<7>;
    .reg .f32 %f<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [spin_out];
    ld.param.u32 %r1, [spin_iters];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mad.lo.s32 %r5, %r3, %r4, %r2;
    cvt.rn.f32.s32 %f1, %r5;
    mov.u32 %r6, 0;
SPIN_LOOP:
    fma.rn.f32 %f1, %f1, 0f3F7FFFFE, 0f3F800000;
    add.s32 %r6, %r6, 1;
    setp.lt.u32 %p1, %r6, %r1;
    @%p1 bra SPIN_LOOP;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.s32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.f32 [%rd4], %f1;
    ret;
}
\x00"""
