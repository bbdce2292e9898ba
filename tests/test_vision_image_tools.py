"""vision_analyze against the scripted OpenAI server, image_generate against fake images APIs; all on 127.0.0.1."""
from __future__ import annotations

import asyncio
import base64

import pytest

import model_tools
from tests.test_web_tools import PNG, fake_api, local_site, no_provider_env  # noqa: F401  (fixtures)
from trajgen.sandbox.backends import SandboxConfig, cleanup, open_sandbox
from trajgen.tools import ToolContext, ToolSettings
from trajgen.tools.images import image_generate
from trajgen.tools.vision import vision_analyze

QUESTION = "What animal is in this picture?"


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def sandbox(tmp_path):
    """A real per-prompt sandbox; vision only reads files through it."""
    config = SandboxConfig(root_dir=str(tmp_path / "sandboxes"), unsafe_local=True)
    box = open_sandbox(config, "prompt-1")
    yield box
    cleanup(config)


def context(sandbox=None, **settings) -> ToolContext:
    async def get():
        assert sandbox is not None, "this call must not open the sandbox"
        return sandbox

    return ToolContext(sandbox=get, settings=ToolSettings(**settings))


def image_part(request: dict) -> dict:
    (message,) = request["body"]["messages"]
    text, image = message["content"]
    assert text == {"type": "text", "text": QUESTION}
    assert image["type"] == "image_url"
    return image["image_url"]


# --- vision ---


def test_vision_sends_an_image_url_part_to_the_runs_model(scripted_server, local_site):
    server = scripted_server({"match": [{"contains": QUESTION, "replies": [{"content": "A tiny cat."}]}]})
    ctx = context(base_url=server.url, api_key="run-key", model="run-model", allow_private_urls=True)
    result = run(vision_analyze(ctx, image_url=local_site.url + "/cat.png", question=QUESTION))
    assert result == {"success": True, "error": None, "analysis": "A tiny cat."}
    (request,) = server.requests()
    assert request["body"]["model"] == "run-model" and request["auth"] == "Bearer run-key"
    assert image_part(request) == {"url": local_site.url + "/cat.png"}
    assert local_site.requests == []  # the URL goes to the model as it is; the runner does not fetch it


def test_vision_refuses_private_urls_without_the_flag(scripted_server):
    """A vision server that fetches image URLs must not become a proxy into the user's network."""
    server = scripted_server({"default": [{"content": "should not be asked"}]})
    ctx = context(base_url=server.url, api_key="run-key", model="run-model")
    for url in ("http://127.0.0.1/x.png", "http://169.254.169.254/latest/meta-data/", "https://10.0.0.1/a.png",
                "http://[::1]/a.png", "http://localhost/a.png"):
        result = run(vision_analyze(ctx, image_url=url, question=QUESTION))
        assert result["success"] is False and "refused" in result["error"], url
    assert server.requests() == []


def test_vision_sends_a_sandbox_file_as_a_data_url(scripted_server, sandbox):
    server = scripted_server({"default": [{"content": "A single pixel."}]})
    run(sandbox.write_file("pictures/pixel.img", PNG))  # no extension: the type comes from the bytes
    run(sandbox.write_file("notes.txt", b"not an image"))
    ctx = context(sandbox, base_url=server.url, api_key="run-key", model="run-model")
    result = run(vision_analyze(ctx, image_url="pictures/pixel.img", question=QUESTION))
    assert result["success"] is True and result["analysis"] == "A single pixel."
    url = image_part(server.requests()[0])["url"]
    assert url.startswith("data:image/png;base64,") and base64.b64decode(url.partition(",")[2]) == PNG
    assert "No such file" in run(vision_analyze(ctx, image_url="absent.png", question=QUESTION))["error"]
    assert "not a recognised image" in run(vision_analyze(ctx, image_url="notes.txt", question=QUESTION))["error"]
    assert run(vision_analyze(ctx, image_url="../../etc/passwd", question=QUESTION))["success"] is False
    assert len(server.requests()) == 1


def test_vision_model_and_endpoint_can_be_set_apart(scripted_server):
    run_server = scripted_server({"default": [{"content": "from the run's endpoint"}]})
    vision_server = scripted_server({"default": [{"content": "from the vision endpoint"}]})
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    settings = dict(base_url=run_server.url, api_key="run-key", model="run-model",
                    vision_base_url=vision_server.url, vision_model="vision-model")
    result = run(vision_analyze(context(**settings), image_url=data_url, question=QUESTION))
    assert result["analysis"] == "from the vision endpoint" and run_server.requests() == []
    (request,) = vision_server.requests()
    assert request["body"]["model"] == "vision-model" and image_part(request) == {"url": data_url}
    assert request["auth"] == "Bearer none"  # the run's key never goes to another endpoint
    run(vision_analyze(context(**settings, vision_api_key="vision-key"), image_url=data_url, question=QUESTION))
    assert vision_server.requests()[-1]["auth"] == "Bearer vision-key"


def test_vision_reports_model_errors_and_bad_arguments(scripted_server):
    server = scripted_server({"default": [{"status": 400, "error": "image too large"}]})
    ctx = context(base_url=server.url, api_key="k", model="m", allow_private_urls=True)
    failed = run(vision_analyze(ctx, image_url="https://127.0.0.1/x.png", question=QUESTION))
    assert failed["success"] is False and "image too large" in failed["error"]
    for bad in ({"image_url": "", "question": QUESTION}, {"image_url": 3, "question": QUESTION},
                {"image_url": "https://127.0.0.1/x.png"}, {"image_url": "https://127.0.0.1/x.png", "question": " "}):
        assert run(vision_analyze(ctx, **bad))["success"] is False
    assert "vision_analyze" not in model_tools.unavailable_tools(ToolSettings())  # always offered: the run's model


# --- image generation ---


def test_image_generate_uses_the_endpoints_images_api(fake_api, tmp_path):
    api = fake_api({"/v1/images/generations": (200, {"created": 1, "data": [
        {"b64_json": base64.b64encode(PNG).decode(), "revised_prompt": "a tiny red cat"}]})})
    ctx = context(base_url=api.url + "/v1", api_key="run-key", model="chat-model", image_model="image-model")
    assert "image_generate" not in model_tools.unavailable_tools(ctx.settings)
    result = run(image_generate(ctx, prompt="a tiny cat", size="512x512"))
    assert result["success"] is True and result["revised_prompt"] == "a tiny red cat"
    # the bytes go home with the outcome, for the parent to write at this path under the run directory
    assert result["image_path"].startswith("files/image-") and result["image_path"].endswith(".png")
    assert ctx.files == {result["image_path"]: PNG}
    (request,) = api.requests
    assert request["headers"]["authorization"] == "Bearer run-key"
    assert request["json"] == {"model": "image-model", "prompt": "a tiny cat", "n": 1, "size": "512x512"}

    api.routes["/v1/images/generations"] = (200, {"created": 2, "data": [{"url": "http://127.0.0.1/generated.png"}]})
    hosted = run(image_generate(ctx, prompt="another cat"))
    assert hosted == {"success": True, "error": None, "image_url": "http://127.0.0.1/generated.png"}
    assert "size" not in api.requests[-1]["json"]

    api.routes["/v1/images/generations"] = (400, {"error": {"message": "prompt rejected", "type": "invalid_request_error"}})
    rejected = run(image_generate(ctx, prompt="a cat"))
    assert rejected["success"] is False and "prompt rejected" in rejected["error"]


def test_image_generate_falls_back_to_fal(fake_api, monkeypatch, tmp_path):
    api = fake_api({"/fal-ai/flux/schnell": (200, {"images": [{"url": "http://127.0.0.1/fal.png", "width": 512,
                                                               "height": 256, "content_type": "image/png"}],
                                                   "seed": 7, "prompt": "a cat"})})
    ctx = context()
    assert "FAL_KEY" in model_tools.unavailable_tools(ctx.settings)["image_generate"]
    assert run(image_generate(ctx, prompt="a cat"))["success"] is False
    monkeypatch.setenv("FAL_KEY", "fal-key")
    monkeypatch.setenv("FAL_BASE_URL", api.url)
    assert "image_generate" not in model_tools.unavailable_tools(ctx.settings)
    result = run(image_generate(ctx, prompt="a cat", size="512x256"))
    assert result == {"success": True, "error": None, "image_url": "http://127.0.0.1/fal.png"}
    (request,) = api.requests
    assert request["headers"]["authorization"] == "Key fal-key"
    assert request["json"] == {"prompt": "a cat", "num_images": 1, "image_size": {"width": 512, "height": 256}}

    monkeypatch.setenv("FAL_MODEL", "fal-ai/other-model")
    api.routes["/fal-ai/other-model"] = (200, {"images": [{"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}]})
    inline = run(image_generate(ctx, prompt="a cat"))
    assert inline["success"] is True and ctx.files[inline["image_path"]] == PNG

    api.routes["/fal-ai/other-model"] = (401, {"detail": "Unauthorized key fal-key"})
    failed = run(image_generate(ctx, prompt="a cat"))
    assert failed["success"] is False and "HTTP 401" in failed["error"] and "fal-key" not in failed["error"]
    for bad in ({"prompt": ""}, {"prompt": 1}, {"prompt": "a cat", "size": "big"},
                {"prompt": "a cat", "size": "10x10"}, {"prompt": "a cat", "size": 512}):
        assert run(image_generate(ctx, **bad))["success"] is False
