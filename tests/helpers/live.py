"""A live server for the tests that talk to it through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
from openai import OpenAI

from infer.server.launch import LiveServer


def serving(live: LiveServer) -> Iterator[LiveServer]:
    """A module fixture's body: yield the started server, then wait until it is idle, check
    it gave every resource back, and stop it."""
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def openai_api(live: LiveServer) -> OpenAI:
    """The official client, pointed at the live server (no retries: a failure shows as is)."""
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(live: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    """POST `body` as JSON to the live server."""
    return httpx.post(live.url + path, json=body, timeout=120, **kwargs)
