"""A local stand-in for Modal's API server and task command router, for tests only.

Modal is a cloud service and cannot run here, so the `modal` SDK is pointed at this server
(`MODAL_SERVER_URL=http://127.0.0.1:PORT`, any token). It serves the gRPC calls the modal backend
makes, with the SDK's own generated service bases (`modal_proto.api_grpc`,
`modal_proto.task_command_router_grpc`), so the wire format is exactly the SDK's. Any other call
answers UNIMPLEMENTED and is logged to stderr. Sandboxes run locally as containers on the Docker
engine DOCKER_HOST points at: an image is a registry reference that must already be in that engine
(a missing one fails its build, as on Modal; nothing is pulled), exec is `docker exec`, and every
container has `--network none` whatever was asked (nothing here may reach past loopback): the
label `modal-standin.network` records whether the sandbox asked for its network blocked or open.
The command router is served on the same port.

Run: `python -m tests.standins.modal_server`; it prints `PORT <n>` when it listens, and on SIGTERM
removes every container it started.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from google.protobuf import empty_pb2
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as router_pb2

LABEL = "modal-standin"  # docker label: the id of the stand-in that started the container; .tag.<name>: its tags
FOREVER = "2147483647"
ids = itertools.count(1)


def _id(prefix: str, suffix: str = "") -> str:
    return f"{prefix}-{next(ids):06d}{uuid.uuid4().hex[:12]}{suffix}"


def _jwt() -> str:
    """An unsigned token with a far expiry: the SDK reads only its `exp`."""
    part = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{part({'alg': 'none'})}.{part({'exp': int(time.time()) + 86400})}.standin"


async def docker(*args: str, stdin: bytes | None = None) -> tuple[int, bytes, str]:
    proc = await asyncio.create_subprocess_exec(
        "docker", *args, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate(stdin)
    return proc.returncode, out, err.decode(errors="replace").strip()


def _result(status: int, exception: str = "") -> api_pb2.GenericResult:
    return api_pb2.GenericResult(status=status, exception=exception)


@dataclass
class SandboxState:
    id: str
    task_id: str
    app_id: str
    image_id: str
    tags: dict[str, str]
    created_at: float
    container: str = ""
    result: api_pb2.GenericResult | None = None  # set once finished
    timer: asyncio.TimerHandle | None = None


@dataclass
class Exec:
    sandbox_id: str
    proc: asyncio.subprocess.Process
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the process ended and its output is read
    grew: asyncio.Condition = field(default_factory=asyncio.Condition)  # notified on new output and at the end
    stdin_written: int = 0
    stdin_closed: bool = False


class State:
    def __init__(self) -> None:
        self.server_id = uuid.uuid4().hex[:12]
        self.url = ""
        self.apps: dict[str, str] = {}
        self.images: dict[str, tuple[str, str]] = {}  # image id -> (registry ref, build error or "")
        self.sandboxes: dict[str, SandboxState] = {}
        self.by_task: dict[str, SandboxState] = {}
        self.execs: dict[str, Exec] = {}

    def sandbox(self, sandbox_id: str = "", task_id: str = "") -> SandboxState:
        found = self.sandboxes.get(sandbox_id) if sandbox_id else self.by_task.get(task_id)
        if found is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id or task_id} not found")
        return found

    async def terminate(self, sandbox: SandboxState, result: api_pb2.GenericResult) -> None:
        if sandbox.result is None:
            sandbox.result = result
            if sandbox.timer:
                sandbox.timer.cancel()
            if sandbox.container:
                await docker("rm", "-f", sandbox.container)
            for exec_id in [i for i, ex in self.execs.items() if ex.sandbox_id == sandbox.id]:
                del self.execs[exec_id]  # its output with it: the stand-in's memory follows the live sandboxes


def _unimplemented(base: type) -> type:
    """`base` with every RPC answering UNIMPLEMENTED (logged), for the stand-in to override the ones it serves."""
    def handler(name: str):
        async def unimplemented(self, stream: Stream) -> None:
            request = await stream.recv_message()
            print(f"UNIMPLEMENTED {name}: {str(request)[:200]!r}", file=sys.stderr, flush=True)
            raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not served by the local Modal stand-in")
        return unimplemented
    return type(f"Unimplemented{base.__name__}", (base,), {name: handler(name) for name in base.__abstractmethods__})


class API(_unimplemented(api_grpc.ModalClientBase)):
    def __init__(self, state: State) -> None:
        self.s = state

    async def ClientHello(self, stream: Stream) -> None:
        await stream.recv_message()
        await stream.send_message(api_pb2.ClientHelloResponse())

    async def AuthTokenGet(self, stream: Stream) -> None:
        await stream.recv_message()
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=_jwt()))

    async def EnvironmentGetOrCreate(self, stream: Stream) -> None:
        await stream.recv_message()
        settings = api_pb2.EnvironmentSettings(image_builder_version="2025.06")
        await stream.send_message(api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-standin", metadata=api_pb2.EnvironmentMetadata(name="main", settings=settings)))

    async def AppGetOrCreate(self, stream: Stream) -> None:
        request = await stream.recv_message()
        if request.app_name not in self.s.apps:
            if request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{request.app_name}' not found")
            self.s.apps[request.app_name] = _id("ap")
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=self.s.apps[request.app_name]))

    async def ImageGetOrCreate(self, stream: Stream) -> None:
        """A layer's image is its FROM reference or its base layer's; it "builds" if the engine has it."""
        request = await stream.recv_message()
        ref = next((c.split(None, 1)[1].strip() for c in request.image.dockerfile_commands if c.startswith("FROM ")), "")
        error = ""
        if request.image.base_images:
            ref, error = self.s.images[request.image.base_images[0].image_id]
        elif (await docker("image", "inspect", ref))[0] != 0:
            error = f"Failed to pull image {ref}: manifest unknown"
        image_id = _id("im")
        self.s.images[image_id] = (ref, error)
        status = api_pb2.GenericResult.GENERIC_STATUS_FAILURE if error else api_pb2.GenericResult.GENERIC_STATUS_SUCCESS
        await stream.send_message(api_pb2.ImageGetOrCreateResponse(image_id=image_id, result=_result(status, error)))

    async def SandboxCreateV2(self, stream: Stream) -> None:
        request = await stream.recv_message()
        d = request.definition
        ref, error = self.s.images[d.image_id]
        if error:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Image {d.image_id} failed to build")
        sandbox = SandboxState(_id("sb", "v2"), _id("ta", "V"), request.app_id, d.image_id,
                               {t.tag_name: t.tag_value for t in request.tags}, time.time())
        args = list(d.entrypoint_args) or ["sleep", FOREVER]
        access = d.network_access.network_access_type
        if access not in (api_pb2.NetworkAccess.BLOCKED, api_pb2.NetworkAccess.OPEN):
            raise GRPCError(Status.UNIMPLEMENTED, "only blocked or open network access is served by the stand-in")
        blocked = access == api_pb2.NetworkAccess.BLOCKED or d.block_network
        code, out, err = await docker(  # no network in any case here; the label records what was asked
            "run", "-d", "--pull", "never", "--network", "none",
            "--label", f"{LABEL}.network={'blocked' if blocked else 'open'}",
            *(["--memory", f"{d.resources.memory_mb_max or d.resources.memory_mb}m"] if d.resources.memory_mb else []),
            *(["--cpus", f"{(d.resources.milli_cpu_max or d.resources.milli_cpu) / 1000:g}"] if d.resources.milli_cpu else []),
            *(["-w", d.workdir] if d.workdir else []), "--label", f"{LABEL}={self.s.server_id}",
            "--label", f"{LABEL}.sandbox={sandbox.id}", *(f"--label={LABEL}.tag.{k}={v}" for k, v in sandbox.tags.items()),
            "--entrypoint", args[0], ref, *args[1:])
        if code != 0:
            raise GRPCError(Status.INTERNAL, f"sandbox failed to start: {err}")
        sandbox.container = out.decode().strip()
        self.s.sandboxes[sandbox.id] = self.s.by_task[sandbox.task_id] = sandbox
        if d.timeout_secs:
            timeout = _result(api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT)
            sandbox.timer = asyncio.get_running_loop().call_later(
                d.timeout_secs, lambda: asyncio.ensure_future(self.s.terminate(sandbox, timeout)))
        await stream.send_message(api_pb2.SandboxCreateV2Response(
            sandbox_id=sandbox.id, task_id=sandbox.task_id,
            metadata=api_pb2.SandboxHandleMetadata(app_id=request.app_id),
            command_router_access=api_pb2.CommandRouterAccess(url=self.s.url, jwt=_jwt())))

    async def SandboxGetTaskIdV2(self, stream: Stream) -> None:
        sandbox = self.s.sandbox((await stream.recv_message()).sandbox_id)
        await stream.send_message(api_pb2.SandboxGetTaskIdResponse(task_id=sandbox.task_id, task_result=sandbox.result))

    async def SandboxGetCommandRouterAccess(self, stream: Stream) -> None:
        request = await stream.recv_message()
        self.s.sandbox(request.sandbox_id, request.task_id)
        await stream.send_message(api_pb2.SandboxGetCommandRouterAccessResponse(url=self.s.url, jwt=_jwt()))

    async def SandboxListV2(self, stream: Stream) -> None:
        """Newest first, one page of at most 10 before `before_timestamp`, as Modal pages them."""
        request = await stream.recv_message()
        wanted = {t.tag_name: t.tag_value for t in request.tags}
        found = sorted((s for s in self.s.sandboxes.values()
                        if (not request.app_id or s.app_id == request.app_id)
                        and (request.include_finished or s.result is None)
                        and (not request.before_timestamp or s.created_at < request.before_timestamp)
                        and wanted.items() <= s.tags.items()), key=lambda s: -s.created_at)[:10]
        await stream.send_message(api_pb2.SandboxListResponse(sandboxes=[
            api_pb2.SandboxInfo(id=s.id, created_at=s.created_at, app_id=s.app_id, image_id=s.image_id,
                                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in s.tags.items()],
                                task_info=api_pb2.TaskInfo(id=s.task_id, result=s.result),
                                metadata=api_pb2.SandboxHandleMetadata(app_id=s.app_id))
            for s in found]))

    async def SandboxTerminateV2(self, stream: Stream) -> None:
        sandbox = self.s.sandbox((await stream.recv_message()).sandbox_id)
        await self.s.terminate(sandbox, _result(api_pb2.GenericResult.GENERIC_STATUS_TERMINATED))
        await stream.send_message(api_pb2.SandboxTerminateResponse())

    async def SandboxWaitV2(self, stream: Stream) -> None:
        sandbox = self.s.sandbox((await stream.recv_message()).sandbox_id)
        await stream.send_message(api_pb2.SandboxWaitResponse(result=sandbox.result))

    async def AppClientDisconnect(self, stream: Stream) -> None:
        await stream.recv_message()
        await stream.send_message(empty_pb2.Empty())


class Router(_unimplemented(task_command_router_grpc.TaskCommandRouterBase)):
    def __init__(self, state: State) -> None:
        self.s = state

    def _exec(self, exec_id: str) -> Exec:
        if exec_id not in self.s.execs:
            raise GRPCError(Status.NOT_FOUND, f"exec {exec_id} not found")
        return self.s.execs[exec_id]

    async def TaskExecStart(self, stream: Stream) -> None:
        request = await stream.recv_message()
        sandbox = self.s.sandbox(task_id=request.task_id)
        if sandbox.result is not None:
            raise GRPCError(Status.NOT_FOUND, f"task {request.task_id} has finished")
        if any(source.secret_id for source in request.secret_sources):
            raise GRPCError(Status.UNIMPLEMENTED, "named Secrets are not served by the local Modal stand-in")
        variables = {**request.env, **{k: v for source in request.secret_sources for k, v in source.env.contents.items()}}
        env = [arg for k, v in variables.items() for arg in ("-e", f"{k}={v}")]
        proc = await asyncio.create_subprocess_exec(
            "docker", "exec", "-i", *(["-w", request.workdir] if request.workdir else []), *env, sandbox.container,
            *request.command_args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ex = self.s.execs[request.exec_id] = Exec(sandbox.id, proc)
        piped = router_pb2.TaskExecStdoutConfig.TASK_EXEC_STDOUT_CONFIG_PIPE

        async def pump(source: asyncio.StreamReader, sink: bytearray, keep: bool) -> None:
            while chunk := await source.read(65536):
                if keep:
                    sink += chunk
                    async with ex.grew:
                        ex.grew.notify_all()

        async def run() -> None:
            pumps = asyncio.gather(pump(proc.stdout, ex.stdout, request.stdout_config == piped),
                                   pump(proc.stderr, ex.stderr, request.stderr_config == piped))
            try:
                await asyncio.wait_for(proc.wait(), request.timeout_secs or None)
            except TimeoutError:
                proc.kill()
            await pumps
            async with ex.grew:
                ex.done.set()
                ex.grew.notify_all()

        asyncio.ensure_future(run())
        await stream.send_message(router_pb2.TaskExecStartResponse())

    async def TaskExecStdioRead(self, stream: Stream) -> None:
        request = await stream.recv_message()
        ex = self._exec(request.exec_id)
        out = ex.stderr if request.file_descriptor == router_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDERR else ex.stdout
        offset = request.offset
        while True:
            async with ex.grew:
                await ex.grew.wait_for(lambda: offset < len(out) or ex.done.is_set())
            if offset >= len(out):
                return
            data = bytes(out[offset:offset + (1 << 20)])
            offset += len(data)
            await stream.send_message(router_pb2.TaskExecStdioReadResponse(data=data))

    async def _exit(self, ex: Exec, response: type) -> object:
        code = ex.proc.returncode
        return response(signal=-code) if code < 0 else response(code=code)

    async def TaskExecWait(self, stream: Stream) -> None:
        ex = self._exec((await stream.recv_message()).exec_id)
        await ex.done.wait()
        await stream.send_message(await self._exit(ex, router_pb2.TaskExecWaitResponse))

    async def TaskExecPoll(self, stream: Stream) -> None:
        ex = self._exec((await stream.recv_message()).exec_id)
        await stream.send_message(await self._exit(ex, router_pb2.TaskExecPollResponse) if ex.done.is_set()
                                  else router_pb2.TaskExecPollResponse())

    async def _stdin(self, ex: Exec, offset: int, data: bytes, eof: bool) -> None:
        if offset < ex.stdin_written:  # a retried write: skip what already arrived
            data = data[ex.stdin_written - offset:]
        if data and not ex.stdin_closed:
            ex.proc.stdin.write(data)
            await ex.proc.stdin.drain()
            ex.stdin_written += len(data)
        if eof and not ex.stdin_closed:
            ex.stdin_closed = True
            ex.proc.stdin.close()

    async def TaskExecStdinWrite(self, stream: Stream) -> None:
        request = await stream.recv_message()
        await self._stdin(self._exec(request.exec_id), request.offset, request.data, request.eof)
        await stream.send_message(router_pb2.TaskExecStdinWriteResponse())

    async def TaskExecStdinWriteStream(self, stream: Stream) -> None:
        ex, offset = None, 0
        async for message in stream:
            if message.HasField("start"):
                ex, offset = self._exec(message.start.exec_id), message.start.offset
            elif message.HasField("end"):
                await self._stdin(ex, offset, b"", True)
            else:
                await self._stdin(ex, offset, message.data, False)
                offset += len(message.data)
        await stream.send_message(router_pb2.TaskExecStdinWriteStreamResponse())

    async def TaskExecStdinStatus(self, stream: Stream) -> None:
        ex = self._exec((await stream.recv_message()).exec_id)
        await stream.send_message(router_pb2.TaskExecStdinStatusResponse(num_bytes_written=ex.stdin_written,
                                                                         closed=ex.stdin_closed))


async def serve() -> None:
    state = State()
    server = Server([API(state), Router(state)])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"PORT {port}", flush=True)
    await stop.wait()
    server.close()
    code, out, _ = await docker("ps", "-aq", "--filter", f"label={LABEL}={state.server_id}")
    if ids := out.decode().split():
        await docker("rm", "-f", *ids)


if __name__ == "__main__":
    asyncio.run(serve())
