"""HTML to markdown for web_extract, in a child process the worker can kill.

trafilatura is quadratic on some pages (one long table row: 2 MB took five minutes), and a
thread cannot be stopped; so each page is converted here, with a memory limit, and the worker
kills this process when its time is up. Reads the page on stdin and its URL as the argument;
writes {"text": ..., "title": ...} as JSON on stdout.
"""
from __future__ import annotations

import json
import resource
import sys

MEMORY_LIMIT = 1 << 30


def convert(html: bytes, url: str) -> tuple[str, str | None]:
    """Main content as markdown (trafilatura), else all of the page's text; and the title."""
    import trafilatura

    text = trafilatura.extract(html, url=url, output_format="markdown", include_links=True, favor_recall=True)
    if not text:
        text = trafilatura.html2txt(html)
    metadata = trafilatura.extract_metadata(html)
    return text, metadata.title if metadata else None


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    text, title = convert(sys.stdin.buffer.read(), sys.argv[1])
    sys.stdout.write(json.dumps({"text": text, "title": title}))


if __name__ == "__main__":
    main()
