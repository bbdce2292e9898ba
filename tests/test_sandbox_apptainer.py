"""The apptainer sandbox against a STAND-IN for the apptainer CLI (tests/standins/apptainer: bubblewrap
over the busybox image's root filesystem, exported from the private Docker engine of tests/dockerd.py).
Apptainer itself cannot be installed here; the backend does not know it talks to a stand-in."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.standins import builds, live_instances
from trajgen.sandbox import SandboxError, apptainer, read_file
from trajgen.sandbox.backends import SandboxConfig, check_images, cleanup, limit_notices, open_sandbox, reap
from trajgen.sandbox.roots import UID_BASE, UID_COUNT

pytest_plugins = ["tests.dockerd", "tests.standins.fixtures"]

MISSING = "127.0.0.1:1/trajgen-missing:latest"


@pytest.fixture
def config(tmp_path, apptainer_standin):
    config = SandboxConfig(backend="apptainer", root_dir=str(tmp_path / "sb"), command_timeout=30, run_id="run1",
                           sif_cache=str(tmp_path / "sif"))
    yield config
    cleanup(config)


def mine(config: SandboxConfig) -> list[str]:
    return [name for name in live_instances() if f"-{config.label}-" in name]


def test_images_are_built_once_each_and_a_missing_one_is_named(config, busybox_image, apptainer_standin, tmp_path):
    before = len(builds(apptainer_standin))

    def check(images):
        return asyncio.run(check_images(images, config))

    with ThreadPoolExecutor(2) as pool:  # two workers checking at once: the lock makes the second wait, then reuse
        first, second = pool.map(check, [[busybox_image, MISSING], [busybox_image]])
    assert first[busybox_image] is None and second[busybox_image] is None
    assert first[MISSING].startswith(f"cannot build image docker://{MISSING}: FATAL:")
    assert builds(apptainer_standin)[before:].count(f"docker://{busybox_image}") == 1
    cache = sorted(os.listdir(tmp_path / "sif"))
    assert [name for name in cache if not name.endswith(".lock")] == [os.path.basename(apptainer.sif_path(busybox_image, config))]
    local = apptainer.sif_path(busybox_image, config)
    report = check([local, str(tmp_path / "absent.sif")])
    assert report == {local: None, str(tmp_path / "absent.sif"): f"{tmp_path / 'absent.sif'}: no such SIF file"}


async def _session(sandbox, *commands: str, timeout: float = 30):
    results = [await sandbox.run(command, timeout) for command in commands]
    await sandbox.close()
    return results


def test_runs_in_the_image_at_the_cwd_as_a_uid_of_its_own_without_network_or_secrets(config, busybox_image, monkeypatch,
                                                                           apptainer_standin):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    assert asyncio.run(check_images([busybox_image], config)) == {busybox_image: None}
    sandbox = open_sandbox(config, "p1", busybox_image, "/srv/app")
    probe = "pwd; id -u; command -v bash || echo no-bash; env; cat /proc/net/dev; echo x > mine; touch /etc/x 2>/dev/null; echo etc=$?"

    async def session():
        result = await sandbox.run(probe, 30)
        listed = mine(config)
        host_dir = sandbox.host_dir
        state = Path(apptainer_standin["APPTAINER_STANDIN_STATE"], "instances", sandbox.name, "state.json")
        options = json.loads(state.read_text())["options"]
        await sandbox.close()
        return result, listed, host_dir, options

    result, listed, host_dir, options = asyncio.run(session())
    lines = result.output.splitlines()
    assert lines[0] == "/srv/app" and lines[2] == "no-bash", result.output
    assert UID_BASE <= int(lines[1]) < UID_BASE + UID_COUNT  # a uid of the prompt's own
    assert "sk-secret" not in result.output and "OPENAI_API_KEY" not in result.output
    assert "sk-secret" not in apptainer.runtime_env().values()  # nor does it reach the runtime's CLI
    assert "LANG=C.UTF-8" in lines and "PYTHONUNBUFFERED=1" in lines
    interfaces = [line.split(":")[0].strip() for line in lines if ":" in line and "|" not in line and "=" not in line]
    assert interfaces == ["lo"]
    assert "etc=1" in lines  # the image's system dirs belong to root
    assert listed == [apptainer.instance_name(config, "p1")] and listed[0].startswith(f"trajgen-run1-{config.label}-")
    assert mine(config) == [] and not os.path.exists(host_dir)  # close stopped it and removed its work dir


def test_timeout_kills_the_command_and_its_children(config, busybox_image):
    asyncio.run(check_images([busybox_image], config))
    sandbox = open_sandbox(config, "p1", busybox_image, None)

    async def session():
        timed_out = await sandbox.run("setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", 2)
        after = await sandbox.run("ps -o args", 30)
        await sandbox.close()
        return timed_out, after

    timed_out, after = asyncio.run(session())
    assert timed_out.exit_code is None and timed_out.error.startswith("timed out after 2 s")
    assert "begun" in timed_out.output
    assert "sleep 425" not in after.output and after.exit_code == 0  # nothing survived; the instance still works


def test_files_go_through_the_instance(config, busybox_image):
    asyncio.run(check_images([busybox_image], config))
    sandbox = open_sandbox(config, "p1", busybox_image, None)

    async def session():
        await sandbox.write_file("sub/dir/x.txt", b"line\n")
        shown = await sandbox.run("cat /workspace/sub/dir/x.txt; echo more >> sub/dir/x.txt", 30)
        content = await read_file(sandbox, "/workspace/sub/dir/x.txt", 1 << 20)
        passwd = await read_file(sandbox, "/etc/passwd", 1 << 20)  # the image's files, as with docker
        with pytest.raises(SandboxError, match="No such file"):
            await read_file(sandbox, "absent.txt", 1 << 20)
        await sandbox.close()
        return shown, content, passwd

    shown, content, passwd = asyncio.run(session())
    assert shown.output == "line\n"
    assert content == b"line\nmore\n"
    assert passwd.startswith(b"root:x:0:0")


def test_an_instance_that_cannot_start_fails_its_prompt_clearly(config, tmp_path):
    sandbox = open_sandbox(config, "p1", str(tmp_path / "never-built.sif"), None)
    with pytest.raises(SandboxError, match="cannot start an instance of image .*never-built.sif: FATAL:"):
        asyncio.run(_session(sandbox, "true"))
    with pytest.raises(SandboxError, match="cwd 'relative' cannot hold the work dir"):
        open_sandbox(config, "p2", None, "relative")


def test_cleanup_stops_this_sessions_instances_and_reap_this_runs(config, busybox_image, tmp_path):
    asyncio.run(check_images([busybox_image], config))
    other = SandboxConfig(backend="apptainer", root_dir=str(tmp_path / "other"), run_id="run2", sif_cache=config.sif_cache)
    later = SandboxConfig(backend="apptainer", root_dir=str(tmp_path / "later"), run_id="run1", sif_cache=config.sif_cache)
    for cfg, key in ((config, "a"), (config, "b"), (other, "c")):
        asyncio.run(open_sandbox(cfg, key, busybox_image, None).run("true", 30))  # never closed, like after a crash
    assert len(mine(config)) == 2 and len(mine(other)) == 1
    cleanup(config)
    cleanup(config)
    assert mine(config) == [] and len(mine(other)) == 1
    asyncio.run(open_sandbox(config, "d", busybox_image, None).run("true", 30))  # as a runner killed with -9 left it
    reap(later)  # the next invocation of run1
    assert mine(config) == [] and len(mine(other)) == 1
    cleanup(other)
    assert mine(other) == []


def test_without_a_runtime_on_path_images_are_unavailable(config, busybox_image, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    apptainer.runtime.cache_clear()
    try:
        assert subprocess.run(["sh", "-c", "command -v apptainer"]).returncode != 0
        report = asyncio.run(check_images([busybox_image], config))
    finally:
        monkeypatch.undo()
        apptainer.runtime.cache_clear()
    assert report == {busybox_image: "neither apptainer nor singularity is on PATH"}


def test_a_runner_that_is_not_root_is_told_which_limits_instances_lack(config, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    [notice] = limit_notices(config)
    assert notice.startswith("the runner is not root: apptainer instances get per-process limits only")
