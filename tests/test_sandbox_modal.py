"""The modal sandbox through the real modal SDK (1.6.4) against the local stand-in (tests/standins/modal_server.py):
not Modal itself, whose sandboxes run off this machine; the stand-in runs them on the private Docker engine."""
from __future__ import annotations

import asyncio
import subprocess

import pytest

from trajgen.sandbox import SandboxError, read_file
from trajgen.sandbox.backends import SandboxConfig, check_images, cleanup, open_sandbox

pytest_plugins = ["tests.dockerd", "tests.standins.modal_fixture"]

MISSING = "127.0.0.1:1/trajgen-missing:latest"


@pytest.fixture
def config(tmp_path, modal_standin):
    config = SandboxConfig(backend="modal", root_dir=str(tmp_path / "sb"), command_timeout=30, memory_mb=256)
    yield config
    cleanup(config)


async def _session(sandbox, *commands: str, timeout: float = 30):
    """Several commands and a close in one event loop, as a worker would do them."""
    results = [await sandbox.run(command, timeout) for command in commands]
    await sandbox.close()
    return results


def test_runs_in_the_image_at_the_cwd_with_the_limits_asked_and_none_of_our_env(config, busybox_image, modal_standin, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    sandbox = open_sandbox(config, "p1", busybox_image, "/srv/app")

    async def session():
        result = await sandbox.run("pwd; command -v bash || echo no-bash; env; echo err >&2", 30)
        [container] = modal_standin.containers(f"modal-standin.tag.trajgen.session={config.label}",
                                               "modal-standin.tag.trajgen.key=p1")
        asked = subprocess.run(["docker", "inspect", "-f", '{{index .Config.Labels "modal-standin.network"}} '
                                "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}}", container],
                               capture_output=True, text=True).stdout.split()
        await sandbox.close()
        return result, asked

    result, asked = asyncio.run(session())
    assert asked == ["blocked", str(256 << 20), str(10**9)]  # what the backend asked the stand-in for
    assert result.exit_code == 0, result
    lines = result.output.splitlines()
    assert lines[:2] == ["/srv/app", "no-bash"]
    assert "sk-secret" not in result.output and "OPENAI_API_KEY" not in result.output
    assert lines[-1] == "err"  # stderr comes back in the same stream
    assert modal_standin.containers(f"modal-standin.tag.trajgen.session={config.label}") == []  # closed: terminated


def test_timeout_kills_the_command_and_its_children(config, busybox_image):
    sandbox = open_sandbox(config, "p1", busybox_image, None)

    async def session():
        timed_out = await sandbox.run("setsid sleep 4251 & (sleep 4252 &); echo begun; sleep 4253", 2)
        return timed_out, *await _session(sandbox, "ps")

    timed_out, after = asyncio.run(session())
    assert timed_out.exit_code is None and timed_out.error.startswith("timed out after 2 s")
    assert "begun" in timed_out.output
    assert "sleep 425" not in after.output and after.exit_code == 0  # nothing survived; the sandbox still works


def test_files_go_through_exec_in_chunks(config, busybox_image):
    sandbox = open_sandbox(config, "p1", busybox_image, None)
    big = bytes(range(256)) * (3 * 4096 + 7)  # 3 MB and change: several stdin chunks, bytes of every value

    async def session():
        await sandbox.write_file("sub/dir/x.txt", b"line\n")
        shown = await sandbox.run("cat /workspace/sub/dir/x.txt; echo more >> sub/dir/x.txt", 30)
        content = await read_file(sandbox, "/workspace/sub/dir/x.txt", 1 << 20)
        await sandbox.write_file("big.bin", big)
        back = await read_file(sandbox, "big.bin", 1 << 23)
        with pytest.raises(SandboxError, match="No such file"):
            await read_file(sandbox, "absent.txt", 1 << 20)
        await sandbox.close()
        return shown, content, back

    shown, content, back = asyncio.run(session())
    assert shown.output == "line\n"
    assert content == b"line\nmore\n"
    assert back == big


def test_missing_image_fails_clearly_and_check_images_says_why(config, busybox_image):
    with pytest.raises(SandboxError, match=f"cannot start a Modal sandbox from image {MISSING}"):
        asyncio.run(_session(open_sandbox(config, "p1", MISSING, None), "true"))
    report = asyncio.run(check_images([busybox_image, MISSING, busybox_image], config))
    assert list(report) == [busybox_image, MISSING]
    assert report[busybox_image] is None
    assert report[MISSING].startswith(f"Modal cannot build image {MISSING}: ") and "\n" not in report[MISSING]


def test_cleanup_terminates_only_this_sessions_sandboxes(config, busybox_image, tmp_path, modal_standin):
    other = SandboxConfig(backend="modal", root_dir=str(tmp_path / "other"), network=True)  # --sandbox_network

    def session(label: str) -> list[str]:
        return modal_standin.containers(f"modal-standin.tag.trajgen.session={label}")

    async def leave(sandbox_config: SandboxConfig, key: str) -> None:  # never closed, like after a crash
        await open_sandbox(sandbox_config, key, busybox_image, None).run("true", 30)

    for key in ("a", "b"):
        asyncio.run(leave(config, key))
    asyncio.run(leave(other, "c"))
    assert len(session(config.label)) == 2
    cleanup(config)
    cleanup(config)
    assert session(config.label) == []
    assert len(session(other.label)) == 1
    assert modal_standin.containers(f"modal-standin.tag.trajgen.session={other.label}", "modal-standin.network=open")
    cleanup(other)
    assert session(other.label) == []
