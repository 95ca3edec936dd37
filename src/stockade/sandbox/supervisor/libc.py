"""libc's functions, called through ``_ctypes`` directly, a buffer pinned for the kernel to
read (``pin``), and what the supervisor sets of its own process with them: ``prctl``,
malloc's arenas and scrubbing, a page forks leave out.

Apart from the process trees (``proctree.py``) and the shims (``reaper.py``) because the
supervisor's other modules call libc too (the confinement, the file operations, the
baseline), and it imports none of ours. Standard library only (C modules where it matters
for start-up time).
"""

from __future__ import annotations

import os
import resource

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, List, Tuple


PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


_libc_funcs: "dict[str, Any]" = {}
_libc_types: "list[Any]" = []


def _types() -> "tuple[Any, Any, Any]":
    """c_long, a cdecl function type and libc's handle: made once (classes cost to make)."""
    if not _libc_types:
        import _ctypes

        class c_long(_ctypes._SimpleCData):
            _type_ = "l"

        class CFunc(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = c_long

        class Lib:
            _handle = _ctypes.dlopen(None)

        _libc_types.extend((c_long, CFunc, Lib()))
    c_long, cfunc, lib = _libc_types
    return c_long, cfunc, lib


# libc's functions called here that return an int, not a long (syscall): their -1 is read
# back as 4294967295 through a long (the register's upper half is not the sign's), and a
# failed prctl raised nothing
_INT_RESULTS = frozenset({"prctl", "mallopt", "madvise"})


def libc(name: str, *args: int) -> int:
    """Call a libc function of integer arguments through _ctypes directly (the ctypes
    package costs more to import); -1 raises OSError. Prototypes are kept, so that a fork
    (a shim) finds those its parent made."""
    import _ctypes

    key = f"{name}/{len(args)}"  # a variadic function (syscall) gets one prototype per arity
    func = _libc_funcs.get(key)
    if func is None:
        c_long, cfunc, lib = _types()
        func = cfunc((name, lib))
        func.argtypes = (c_long,) * len(args)
        _libc_funcs[key] = func
    result = int(func(*args))
    if name in _INT_RESULTS:  # the low 32 bits, signed
        result = ((result & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    if result == -1:
        err = _ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


_BYTE: "List[Any]" = []  # the one-byte C type, made once (a class costs to make)


def pin(data: bytes) -> "Tuple[Any, int]":
    """A C-visible copy of ``data`` and its address: the first must be kept while the
    kernel may read the second (the buffer cannot move or be freed under it)."""
    import _ctypes

    if not _BYTE:

        class c_char(_ctypes._SimpleCData):
            _type_ = "c"

        _BYTE.append(c_char)
    buf = bytearray(data)
    view = _BYTE[0].from_buffer(buf)  # holds buf, and locks its size
    return view, _ctypes.addressof(view)


PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MADV_DONTFORK = 1, 2, 2, 0x20, 10


def private_page(size: int) -> "memoryview":
    """A writable view of ``size`` bytes on a page of their own that forks leave out
    (``MADV_DONTFORK``: a fork that touches it dies), where a secret is read straight into,
    never into a Python object a fork would copy. Made through libc, not the mmap module:
    its import took 5-12 ms of the first ``run_code``'s path on gVisor (the seal's key is
    read after the zygote's fork, right before the first request)."""
    import _ctypes

    page = resource.getpagesize()
    addr = libc("mmap", 0, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    libc("madvise", addr, page, MADV_DONTFORK)

    class Byte(_ctypes._SimpleCData):
        _type_ = "B"

    class Area(_ctypes.Array):
        _type_ = Byte
        _length_ = size

    return memoryview(Area.from_address(addr)).cast("B")


def prctl(option: int, arg: int) -> None:
    libc("prctl", option, arg, 0, 0, 0)


M_ARENA_MAX = -8


def limit_arenas(value: str) -> None:
    """``MALLOC_ARENA_MAX`` for this process and what forks from it (the zygote, the
    interpreters): glibc reads the variable at a process's first allocation, long past for
    them, so run_code's threads would get an arena each (64 MiB of address space, which
    RLIMIT_AS counts) while a command's got what the variable says. Nothing where there is
    no such glibc function."""
    if not value.isdigit() or not 0 < int(value) < 1 << 16:
        return
    try:
        libc("mallopt", M_ARENA_MAX, int(value))
    except (AttributeError, OSError):
        pass


M_PERTURB = -6
FREED_BYTE = 0x5A  # glibc fills what is freed with it (and what it allocates with its complement)


def scrub_freed(on: bool) -> None:
    """glibc's ``M_PERTURB`` for this process: every chunk freed to its heap overwritten. The
    supervisor outlives a reset in place, and its heap has held the last user's uploads and
    output: freed, the bytes stayed until reused, and a memory snapshot (which copies every
    page of the guest) gave them to the next user. What it returns to the kernel, the kernel
    zeroes (the microVM's init_on_free; gVisor's freed pages). The zygote turns it off for
    the interpreters (user code pays nothing). Small chunks (glibc's tcache, Python's own
    allocator for objects under 512 bytes) are kept as they are: see docs/architecture.md."""
    try:
        libc("mallopt", M_PERTURB, FREED_BYTE if on else 0)
    except (AttributeError, OSError):
        pass
