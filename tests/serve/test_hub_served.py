"""`ds4jax serve --model org/name` serves a checkpoint from the Hugging Face cache, offline,
at the revision asked for (the cache has no `main` ref: the revision must reach the hub)."""

from __future__ import annotations

from pathlib import Path

import anthropic

from tests.fake_hub import cache_release, write_release
from tests.serve.conftest import NO_MIXED, ServeProcess

REPO_ID = "tiny-org/tiny-v4"
REVISION = "release-1"


def test_serve_a_cached_repo_by_its_id_offline(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache_release(cache, REPO_ID, write_release(tmp_path / "release"), ref=REVISION)
    server = ServeProcess(
        "--revision", REVISION, "--chunk-sizes", "16", "--max-batch", "1", "--sessions", "1",
        *NO_MIXED, model=("--model", REPO_ID),
        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        server.wait_ready()
        assert f"ds4jax: model {REPO_ID};" in server.stderr
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        raw = client.messages.with_raw_response.create(
            model="deepseek-v4-flash", max_tokens=4,
            messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        )  # fmt: skip
        assert raw.status_code == 200
        message = raw.parse()
        assert message.usage.output_tokens >= 1 and message.stop_reason in (
            "max_tokens",
            "end_turn",
        )
    finally:
        server.stop()
