"""The `vision` toolset: `vision_analyze` asks an OpenAI-compatible vision model about an image.

The image is an http(s) or data: URL, passed on as it is, or a file in the prompt's sandbox,
read through the sandbox (at most MAX_IMAGE_BYTES of it) and sent as a data URL. An http(s) URL
must pass the same public-address check as web_extract's (netguard) unless --allow_private_urls:
a vision server that fetches image URLs must not become a way into the user's private network. The model and endpoint are the run's unless
`vision_model` / `vision_base_url` / `vision_api_key` are set.
"""
from __future__ import annotations

import asyncio
import base64
import mimetypes
from typing import TYPE_CHECKING

from trajgen.sandbox import SandboxError, read_file
from trajgen.tools import ToolContext, ToolSettings, ToolSpec
from trajgen.tools.netguard import check_url

if TYPE_CHECKING:  # the SDK only when a vision or image tool runs: importing it costs a second of CPU
    import openai

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_ANSWER_CHARS = 20_000
REQUEST_TIMEOUT = 120.0
_MAGIC = [(b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"), (b"BM", "image/bmp")]

_clients: dict[tuple[str, str], tuple[asyncio.AbstractEventLoop, openai.AsyncOpenAI]] = {}


def cached_client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """One client per worker process and endpoint, so its connections are reused across prompts.
    A client belongs to the event loop it first ran on, so a new loop gets a new client."""
    import openai

    loop = asyncio.get_running_loop()
    cached = _clients.get((base_url, api_key))
    if cached is None or cached[0] is not loop:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=REQUEST_TIMEOUT, max_retries=2)
        _clients[(base_url, api_key)] = cached = (loop, client)
    return cached[1]


def vision_endpoint(settings: ToolSettings) -> tuple[str, str, str]:
    """(base_url, api_key, model). The run's key is sent only to the run's own endpoint."""
    base_url = settings.vision_base_url or settings.base_url
    api_key = settings.vision_api_key or (settings.api_key if base_url == settings.base_url else "none")
    return base_url, api_key, settings.vision_model or settings.model


def image_mime(data: bytes, path: str) -> str | None:
    """The image's type from its first bytes, else from its file name."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    guessed = mimetypes.guess_type(path)[0]
    return guessed if guessed and guessed.startswith("image/") else None


def _fail(error: str) -> dict:
    return {"success": False, "error": error}


async def vision_analyze(ctx: ToolContext, image_url: object = None, question: object = None) -> dict:
    import openai

    if not isinstance(image_url, str) or not image_url.strip():
        return _fail("`image_url` must be an http(s) URL, a data: URL or a file path in your sandbox")
    if not isinstance(question, str) or not question.strip():
        return _fail("`question` must be a non-empty string")
    url = image_url.strip()
    if url.lower().startswith(("http://", "https://")):
        if reason := await check_url(url, ctx.settings.allow_private_urls):
            return _fail(reason)
    elif not url.lower().startswith("data:"):
        try:
            data = await read_file(await ctx.sandbox(), url, MAX_IMAGE_BYTES)
        except SandboxError as e:
            return _fail(str(e))
        mime = image_mime(data, url)
        if mime is None:
            return _fail(f"{url} is not a recognised image (png, jpeg, gif, webp, bmp...)")
        url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    base_url, api_key, model = vision_endpoint(ctx.settings)
    content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}]
    try:
        response = await cached_client(base_url, api_key).chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}]
        )
    except openai.APIError as e:
        return _fail(f"vision model error: {e}")
    answer = (response.choices[0].message.content or "") if response.choices else ""
    if not answer:
        return _fail("the vision model returned no answer")
    return {"success": True, "error": None, "analysis": answer[:MAX_ANSWER_CHARS]}


TOOLS = [
    ToolSpec(
        name="vision_analyze",
        toolset="vision",
        description=(
            "Ask a vision model a question about an image: an http(s) URL, a data: URL, or the path of an "
            "image file in your sandbox."
        ),
        parameters={
            "type": "object",
            "properties": {
                "image_url": {"type": "string", "description": "http(s) or data: URL of the image, or a file path in your sandbox."},
                "question": {"type": "string", "description": "What to ask or describe about the image."},
            },
            "required": ["image_url", "question"],
            "additionalProperties": False,
        },
        fn=vision_analyze,
    )
]
