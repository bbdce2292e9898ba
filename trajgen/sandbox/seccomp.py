"""The seccomp filter every local sandbox command runs under, compiled with libseccomp (via ctypes).

Denied with EPERM: the kernel keyring (add_key, keyctl, request_key: a keyring outlives a prompt
and would let prompts, even of later runs, pass data to each other), new namespaces of any kind
(unshare, setns, and clone with a CLONE_NEW* flag; clone3 answers ENOSYS so libc falls back to
clone, where the flags can be checked), and the usual container deny-list: mounts, ptrace and
other processes' memory, kernel modules, kexec, bpf, perf, swap, reboot, clocks, accounting,
handles to files outside the mount (open_by_handle_at) and userfaultfd. Denied as well: the
machine-wide kernel tables no cgroup or uid bounds (AIO contexts, `fs.aio-max-nr`; io_uring), and
`modify_ldt` and `personality` (but its query) as legacy attack surface. Sockets: with the network
off only AF_UNIX may be created (EAFNOSUPPORT for the rest, AF_INET on the private loopback
included); with it on, AF_VSOCK is refused, whose port space is shared by every sandbox and may
reach the VM's host. Syscalls of another ABI (32-bit ones on a 64-bit kernel) kill the process: the
filter only knows the native table.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import json
import os

DENIED = (
    "add_key", "keyctl", "request_key",
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "swapon", "swapoff", "reboot", "acct",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "quotactl",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "iopl", "ioperm",
    "syslog", "vhangup", "nfsservctl", "uselib",
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "modify_ldt",
)
SOCKET_CALLS = ("socket", "socketpair")
AF_UNIX, AF_VSOCK = 1, 40
PERSONALITY_QUERY = 0xFFFFFFFF
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
ACT_ALLOW = 0x7FFF0000
ACT_ERRNO = 0x00050000
CMP_NE, CMP_EQ, CMP_MASKED_EQ = 1, 4, 7


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _library() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        raise OSError("libseccomp is not installed (apt-get install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_Arg)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def program(network: bool) -> bytes:
    """The compiled BPF program, as bubblewrap's `--seccomp FD` reads it; OSError if it cannot be built."""
    lib = _library()
    ctx = lib.seccomp_init(ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        def rule(action: int, name: str, *args: _Arg) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                return  # not a syscall of this architecture
            array = (_Arg * len(args))(*args) if args else None
            if lib.seccomp_rule_add_array(ctx, action, number, len(args), array) < 0:
                raise OSError(f"libseccomp refused the rule for {name}")

        for name in DENIED:
            rule(ACT_ERRNO | errno.EPERM, name)
        rule(ACT_ERRNO | errno.ENOSYS, "clone3")
        for flag in CLONE_NEW:
            rule(ACT_ERRNO | errno.EPERM, "clone", _Arg(0, CMP_MASKED_EQ, flag, flag))
        rule(ACT_ERRNO | errno.EPERM, "personality", _Arg(0, CMP_NE, PERSONALITY_QUERY, 0))
        for name in SOCKET_CALLS:
            family = _Arg(0, CMP_EQ, AF_VSOCK, 0) if network else _Arg(0, CMP_NE, AF_UNIX, 0)
            rule(ACT_ERRNO | errno.EAFNOSUPPORT, name, family)
        fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
        try:
            if lib.seccomp_export_bpf(ctx, fd) < 0:
                raise OSError("seccomp_export_bpf failed")
            return os.pread(fd, 1 << 20, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def docker_profile(network: bool) -> str:
    """The same filter as a Docker seccomp profile (`--security-opt seccomp=<this JSON>`)."""
    def rule(names: list[str], code: int, *args: dict) -> dict:
        return {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": code, **({"args": list(args)} if args else {})}

    def arg(op: str, value: int, second: int = 0) -> dict:
        return {"index": 0, "value": value, "valueTwo": second, "op": op}

    family = arg("SCMP_CMP_EQ", AF_VSOCK) if network else arg("SCMP_CMP_NE", AF_UNIX)
    rules = [rule(list(DENIED), errno.EPERM), rule(["clone3"], errno.ENOSYS),
             *(rule(["clone"], errno.EPERM, arg("SCMP_CMP_MASKED_EQ", flag, flag)) for flag in CLONE_NEW),
             rule(["personality"], errno.EPERM, arg("SCMP_CMP_NE", PERSONALITY_QUERY)),
             rule(list(SOCKET_CALLS), errno.EAFNOSUPPORT, family)]
    return json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules})


def memfd(data: bytes, name: str) -> int:
    """An inheritable fd holding `data`, read from its start (bubblewrap's --seccomp and --args take one)."""
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
