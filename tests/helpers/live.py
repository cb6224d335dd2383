"""A live server for the tests that talk to it through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

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
