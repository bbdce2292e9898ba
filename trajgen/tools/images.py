"""The `image_gen` toolset: `image_generate` makes one image from a prompt.

With `image_model` set it uses the run's endpoint's OpenAI images API; otherwise FAL (FAL_KEY;
FAL_BASE_URL and FAL_MODEL override its endpoint and model). The result names the image's URL,
or, when the image comes back inline (base64 or a data: URL), its path under the run directory
(files/...). The bytes travel home in the prompt's outcome and the parent writes them, so the
path is valid where the run directory is, whichever node ran the prompt.
"""
from __future__ import annotations

import base64
import os
import re
import uuid

from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.vision import cached_client, image_mime

FAL_DEFAULT_MODEL = "fal-ai/flux/schnell"
SIZE = re.compile(r"^(\d{2,4})x(\d{2,4})$")
EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp", "image/gif": ".gif"}


def image_unavailable(settings: ToolSettings) -> str | None:
    if settings.image_model or os.environ.get("FAL_KEY"):
        return None
    return "no image backend: set --image_model (the endpoint's images API) or FAL_KEY"


def _fail(error: str) -> dict:
    return {"success": False, "error": error}


def _keep(data: bytes, files: dict[str, bytes]) -> str:
    """Hand an inline image to the parent to write; returns its path relative to the run directory."""
    path = f"files/image-{uuid.uuid4().hex[:12]}{EXTENSIONS.get(image_mime(data, '') or '', '.png')}"
    files[path] = data
    return path


def _located(url: str | None, b64: str | None, files: dict[str, bytes]) -> dict:
    """{"image_url": ...} for a hosted image, {"image_path": ...} for an inline one."""
    if url and not url.startswith("data:"):
        return {"image_url": url}
    if url:
        b64 = url.partition(",")[2]
    if not b64:
        raise ValueError("the response holds no image")
    return {"image_path": _keep(base64.b64decode(b64, validate=True), files)}


async def _openai_images(settings: ToolSettings, prompt: str, size: str | None, files: dict[str, bytes]) -> dict:
    client = cached_client(settings.base_url, settings.api_key)
    extra = {"size": size} if size else {}
    response = await client.images.generate(model=settings.image_model, prompt=prompt, n=1, **extra)
    image = response.data[0]
    located = _located(image.url, image.b64_json, files)
    return {**located, "revised_prompt": image.revised_prompt} if image.revised_prompt else located


async def _fal(settings: ToolSettings, prompt: str, size: str | None, files: dict[str, bytes]) -> dict:
    model = os.environ.get("FAL_MODEL", FAL_DEFAULT_MODEL)
    body: dict = {"prompt": prompt, "num_images": 1}
    if size:
        width, height = size.split("x")
        body["image_size"] = {"width": int(width), "height": int(height)}
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0, connect=10.0)) as client:
        response = await client.post(
            os.environ.get("FAL_BASE_URL", "https://fal.run").rstrip("/") + "/" + model,
            headers={"Authorization": f"Key {os.environ['FAL_KEY']}"}, json=body,
        )
    if response.status_code >= 400:
        detail = response.text[:300].replace(os.environ["FAL_KEY"], "***")  # never echo the key into a trajectory
        raise ValueError(f"FAL answered HTTP {response.status_code}: {detail}")
    return _located(response.json()["images"][0]["url"], None, files)


async def image_generate(ctx: ToolContext, prompt: object = None, size: object = None) -> dict:
    import httpx  # here, not at the top: importing httpx and the SDK costs a second of CPU in every worker
    import openai

    if not isinstance(prompt, str) or not prompt.strip():
        return _fail("`prompt` must be a non-empty string")
    if size is not None and (not isinstance(size, str) or not (m := SIZE.match(size))
                             or not all(64 <= int(n) <= 4096 for n in m.groups())):
        return _fail("`size` must be WIDTHxHEIGHT in pixels, e.g. 1024x1024 (64 to 4096 each)")
    reason = image_unavailable(ctx.settings)
    if reason:
        return _fail(reason)
    generate = _openai_images if ctx.settings.image_model else _fal
    try:
        located = await generate(ctx.settings, prompt, size, ctx.files)
    except openai.APIError as e:
        return _fail(f"image API error: {e}")
    except (httpx.HTTPError, OSError, ValueError, LookupError, TypeError) as e:
        return _fail(f"image generation failed: {type(e).__name__}: {e}")
    return {"success": True, "error": None, **located}


TOOLS = [
    ToolSpec(
        name="image_generate",
        toolset="image_gen",
        description="Generate an image from a text prompt; returns the image's URL, or the path of the saved file.",
        parameters={
            "type": "object",
            "properties": {
                "prompt": {"type": "string", "description": "A detailed description of the image."},
                "size": {"type": "string", "description": "WIDTHxHEIGHT in pixels, e.g. 1024x1024 (default: the backend's)."},
            },
            "required": ["prompt"],
            "additionalProperties": False,
        },
        fn=image_generate,
        unavailable=image_unavailable,
    )
]
