"""loadtest.locust.metrics_scrape: the series it derives, and a scrape of a real server."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.locust.metrics_scrape import MetricsScraper, Scrape, rates, write_png
from quicsrv_client import Client
from tests.helpers import running_server


def _scrape(t_s: float, tokens: float, ttft_sum: float, ttft_count: float) -> Scrape:
    return Scrape(
        t_s=t_s,
        generated_tokens=tokens,
        ttft_sum_s=ttft_sum,
        ttft_count=ttft_count,
        sessions_paused=0,
        generations_active=0,
        generations_queued=0,
    )


def test_rates_are_per_interval_between_scrapes():
    scrapes = [_scrape(0, 0, 0, 0), _scrape(2, 100, 0.5, 2), _scrape(4, 100, 0.5, 2)]
    assert rates(scrapes) == [(2, 50.0, 0.25), (4, 0.0, None)]


@pytest.mark.model
@pytest.mark.asyncio
async def test_a_scrape_during_a_run_counts_its_tokens_and_plots_them(engine, certs, tmp_path):
    async with running_server(engine, certs) as server:
        scraper = MetricsScraper("127.0.0.1", server.port, ca=certs.ca_cert, interval_s=0.2)
        scraper.start()
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            result = await c.generate_text("Count to ten:", max_tokens=10, ignore_eos=True)
        scrapes = await asyncio.to_thread(scraper.stop)
    assert scraper.errors == []
    assert result.end.completion_tokens == 10
    # A fresh server: the last scrape, taken after the generation ended, counts exactly it.
    assert scrapes[-1].generated_tokens == 10
    assert scrapes[-1].ttft_count == 1
    write_png(scrapes, tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG")
