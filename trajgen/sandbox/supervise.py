"""Runs inside a prompt's sandbox (standard library only): one command at a time, read from stdin.

Started once per sandbox by supervisor.py as `python -I -S -c <this file>`; a sandbox per command
cost about 7 ms of machine CPU, a command through this loop under 2 ms. A request is one JSON line
{"command": str, "timeout": float}; the answer is the merged output as frames (4-byte big-endian
length, then the bytes), a zero-length frame, then one line "<exit code> <timed out 0|1>".
Each command is a bash in its own session. When it exits or times out, every other process of
the sandbox's PID namespace is killed (kill(-1) reaches exactly those: setsid and double-forked
children included), then /tmp is emptied: each command starts as it would in a fresh sandbox.
"""
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

CHUNK = 65536


def send(data: bytes) -> None:
    sys.stdout.buffer.write(struct.pack(">I", len(data)) + data)


def finish(code: int, timed_out: bool) -> None:
    sys.stdout.buffer.write(struct.pack(">I", 0) + f"{code} {int(timed_out)}\n".encode())


def kill_the_rest(command: subprocess.Popen) -> None:
    """SIGKILL everything in the namespace but us and its init, until nothing is left (2 s at most)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    command.wait()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # zombies count until the namespace's init reaps them
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.001)


def empty_tmp() -> None:
    for entry in os.scandir("/tmp"):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def run(command: str, timeout: float) -> None:
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=write_fd,
                                stderr=write_fd, start_new_session=True)
    except OSError as e:  # e.g. the process limit reached
        os.close(read_fd)
        os.close(write_fd)
        send(f"cannot start bash: {e.strerror}\n".encode())
        finish(126, False)
        return
    os.close(write_fd)
    exited = os.pidfd_open(proc.pid)
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    poller.register(exited, select.POLLIN)
    deadline = time.monotonic() + timeout
    timed_out, open_pipe = True, True
    while (left := deadline - time.monotonic()) > 0:
        events = dict(poller.poll(left * 1000))
        if exited in events:
            timed_out = False
            break
        if read_fd in events and open_pipe:
            chunk = os.read(read_fd, CHUNK)
            if chunk:
                send(chunk)
            else:  # the command closed its output but goes on: wait for its exit only
                poller.unregister(read_fd)
                open_pipe = False
    os.close(exited)
    kill_the_rest(proc)
    while open_pipe and (chunk := os.read(read_fd, CHUNK)):  # every writer is dead: this ends
        send(chunk)
    os.close(read_fd)
    empty_tmp()
    finish(proc.returncode if proc.returncode >= 0 else 128 - proc.returncode, timed_out)


def main() -> None:
    for line in sys.stdin.buffer:
        request = json.loads(line)
        run(request["command"], request["timeout"])
        sys.stdout.buffer.flush()


main()
