#!/usr/bin/env python
"""The two well-kept Docker clients side by side: the Docker SDK for Python (each call in a
thread) and aiodocker (asyncio), for the calls the docker backend makes.

Per operation, N times in a row: wall time and this process's CPU, medians in ms.
  create   create and start a container
  exec     one exec of `true` to its end, exit code included
  inspect  inspect the image
  list     list containers by label
  remove   force-remove a container
  pull     a pull from a registry that refuses the connection (127.0.0.1:1): the call's own cost

    python -m pip install aiodocker  # the runner itself needs only the SDK
    DOCKER_HOST=unix:///tmp/trajgen-ci-dockerd/docker.sock python bench/docker_clients.py
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time

import aiodocker
import docker

LABEL = "trajgen.bench-clients"
MISSING = "127.0.0.1:1/trajgen-missing:latest"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def timed(results: dict, name: str, call) -> object:
    c0, t0 = cpu(), time.perf_counter()
    out = await call()
    results.setdefault(name, []).append((1000 * (time.perf_counter() - t0), 1000 * (cpu() - c0)))
    return out


def spec(image: str) -> dict:
    return {"Image": image, "Cmd": ["sleep", "3600"], "Labels": {LABEL: "1"}, "HostConfig": {"NetworkMode": "none"}}


async def sdk(image: str, n: int) -> dict:
    api = docker.APIClient(version="auto", **docker.utils.kwargs_from_env())
    run = asyncio.to_thread
    results: dict = {}
    for _ in range(n):
        async def create():
            cid = (await run(api.create_container, image, ["sleep", "3600"], labels={LABEL: "1"},
                             host_config=api.create_host_config(network_mode="none")))["Id"]
            await run(api.start, cid)
            return cid
        cid = await timed(results, "create", create)

        async def exec_true():
            exec_id = (await run(api.exec_create, cid, ["true"]))["Id"]
            await run(api.exec_start, exec_id)
            return (await run(api.exec_inspect, exec_id))["ExitCode"]
        assert await timed(results, "exec", exec_true) == 0
        await timed(results, "inspect", lambda: run(api.inspect_image, image))
        await timed(results, "list", lambda: run(api.containers, all=True, filters={"label": f"{LABEL}=1"}))
        await timed(results, "remove", lambda: run(api.remove_container, cid, force=True))

        async def pull():
            try:
                await run(api.pull, MISSING)
            except docker.errors.APIError:
                pass
        await timed(results, "pull", pull)
    api.close()
    return results


async def aio(image: str, n: int) -> dict:
    client = aiodocker.Docker()
    results: dict = {}
    for _ in range(n):
        async def create():
            container = await client.containers.create(spec(image))
            await container.start()
            return container
        container = await timed(results, "create", create)

        async def exec_true():
            ex = await container.exec(["true"])
            async with ex.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass
            return (await ex.inspect())["ExitCode"]
        assert await timed(results, "exec", exec_true) == 0
        await timed(results, "inspect", lambda: client.images.inspect(image))
        await timed(results, "list", lambda: client.containers.list(all=True, filters={"label": [f"{LABEL}=1"]}))
        await timed(results, "remove", lambda: container.delete(force=True))

        async def pull():
            try:
                await client.images.pull(MISSING)
            except aiodocker.DockerError:
                pass
        await timed(results, "pull", pull)
    await client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="trajgen-test-busybox:latest")
    parser.add_argument("-n", type=int, default=20)
    args = parser.parse_args()
    table = {name: asyncio.run(client(args.image, args.n)) for name, client in (("docker SDK", sdk), ("aiodocker", aio))}
    print(f"medians of {args.n}, ms per call: wall / this process's CPU")
    ops = list(next(iter(table.values())))
    print("client      " + "".join(f"{op:>14}" for op in ops))
    for name, results in table.items():
        cells = (f"{statistics.median(w for w, _ in results[op]):6.1f} /{statistics.median(c for _, c in results[op]):5.1f}"
                 for op in ops)
        print(f"{name:12}" + "".join(f"{cell:>14}" for cell in cells))


if __name__ == "__main__":
    main()
