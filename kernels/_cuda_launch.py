"""Hand-written CUDA kernels: compiled at first use with NVRTC (which ships with PyTorch's CUDA
wheels) and launched through the driver's cuLaunchKernelEx, so they can join the decode step's
chain of programmatic dependent launches (kernels._pdl) and be captured in CUDA graphs.

Why not torch.cuda._compile_kernel: its launcher calls cuLaunchKernel, which takes no launch
attributes, so a kernel it launches cannot start before the kernel ahead of it finishes; and its
compile step adds the CUDA toolkit's include path, which a machine with only the wheels lacks.

Nothing here runs on a machine without CUDA; the kernels' PyTorch reference twins do.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

# cuda.h: CUlaunchAttributeID, CUfunction_attribute
_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER_SIZE = 8


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int),
                ("cluster_dim", ctypes.c_uint * 3)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    from torch.cuda._utils import _get_gpu_runtime_library

    lib = _get_gpu_runtime_library()
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(message.value or b'?').decode()})")


class CudaKernel:
    """One compiled kernel on one device; `launch` enqueues it on the current stream."""

    def __init__(self, function: ctypes.c_void_p, name: str, max_shared_mem: int, shared_carveout: int | None = None):
        self.function, self.name = function, name
        if max_shared_mem > 48 * 1024:
            _check(_driver().cuFuncSetAttribute(function, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                max_shared_mem), f"{name}: setting {max_shared_mem} B of shared memory")
        if shared_carveout is not None:   # percent of the L1/shared split given to shared memory
            _check(_driver().cuFuncSetAttribute(function, _FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                                shared_carveout), f"{name}: setting a {shared_carveout}% carveout")
        self.max_shared_mem = max_shared_mem
        self.non_portable_clusters = False

    def launch(self, grid: int, threads: int, shared_mem: int, args: ctypes.Structure, *, pdl: bool,
               cluster: int = 1) -> None:
        """Launch with a single by-value parameter `args` (a ctypes.Structure matching the kernel's
        struct). pdl: allow the launch to start before the kernel ahead of it in the stream ends
        (the kernel must griddepcontrol.wait before it reads that kernel's output). cluster: CTAs a
        thread-block cluster (consecutive blockIdx.x; grid a multiple of it)."""
        if shared_mem > self.max_shared_mem:
            raise ValueError(f"{self.name}: {shared_mem} B of shared memory, over the {self.max_shared_mem} B set")
        if grid % cluster:
            raise ValueError(f"{self.name}: a grid of {grid} CTAs is not whole clusters of {cluster}")
        if cluster > PORTABLE_CLUSTER_SIZE and not self.non_portable_clusters:
            _check(_driver().cuFuncSetAttribute(self.function, _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                   f"{self.name}: allowing clusters of {cluster}")
            self.non_portable_clusters = True
        attrs = (_LaunchAttribute * 2)()
        count = 0
        if pdl:
            attrs[count].id = _LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[count].value.programmatic_stream_serialization_allowed = 1
            count += 1
        if cluster > 1:
            attrs[count].id = _LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attrs[count].value.cluster_dim[:] = (cluster, 1, 1)
            count += 1
        config = _LaunchConfig(grid, 1, 1, threads, 1, 1, shared_mem,
                               ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                               ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)) if count else None, count)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
        _check(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None), f"launching {self.name}")


_lock = threading.Lock()


def compile_kernels(source: str, names: tuple[str, ...], device: torch.device, options: tuple[str, ...] = (),
                    max_shared_mem: int = 0, shared_carveout: int | None = None) -> dict[str, CudaKernel]:
    """NVRTC-compile `source` for `device`'s architecture and load `names` from it (cached per
    (source, names, device, options, attributes)). shared_carveout: the kernels' preferred share of
    the L1/shared split in percent (None: the driver's choice)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compile_cached(source, names, index, options, max_shared_mem, shared_carveout)


@functools.cache
def _compile_cached(source: str, names: tuple[str, ...], index: int, options: tuple[str, ...],
                    max_shared_mem: int, shared_carveout: int | None) -> dict[str, CudaKernel]:
    with _lock, torch.cuda.device(index):
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"   # 90a: griddepcontrol, bulk copies
        cubin = nvrtc_compile(source, (f"--gpu-architecture={arch}", *options))
        torch.cuda.current_stream(index)   # the device's primary context is current from here on
        module = ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), cubin), "loading the compiled module")
        kernels = {}
        for name in names:
            function = ctypes.c_void_p()
            _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"finding {name}")
            kernels[name] = CudaKernel(function, name, max_shared_mem, shared_carveout)
        return kernels


def nvrtc_compile(source: str, options: tuple[str, ...]) -> bytes:
    """Source -> a cubin for the architecture in `options`. The kernels include no headers, so no
    CUDA toolkit is needed: only libnvrtc, which PyTorch's CUDA wheels bring."""
    from torch.cuda._utils import _get_gpu_rtc_library

    lib = _get_gpu_rtc_library()
    program = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None))
    try:
        encoded = [o.encode() for o in options]
        result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile the kernel:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(program, cubin))
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _check_nvrtc(lib, result: int) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {result}: {lib.nvrtcGetErrorString(result).decode()}")
