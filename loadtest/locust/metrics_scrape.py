"""Scrape a quicsrv's ``/metrics`` during a load run and plot the series as a PNG.

``loadtest.locust.smoke`` runs a :class:`MetricsScraper` next to Locust and writes ``metrics.png``
(throughput, TTFT and sessions over time) into its ``--out`` directory. On its own::

    python -m loadtest.locust.metrics_scrape --port 4433 --ca certs/ca.pem --seconds 60 --out m.png

The scraper is a native client on its own thread and event loop (HTTP/3, like every other
client): it asks for ``/metrics`` every ``interval_s`` and keeps the few series it plots.
Throughput and TTFT are rates between consecutive scrapes: tokens per second from the
generated-tokens counter, the mean time to first token from the histogram's sum and count.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from quicsrv_client import Client

__all__ = ["MetricsScraper", "Scrape", "main", "parse_scrape", "rates", "write_png"]


@dataclass(frozen=True, slots=True)
class Scrape:
    """The series one scrape contributes."""

    t_s: float
    """Seconds since the scraper started."""
    generated_tokens: float
    ttft_sum_s: float
    ttft_count: float
    sessions_paused: float
    generations_active: float
    generations_queued: float


def parse_scrape(text: str, t_s: float) -> Scrape:
    """Pick the plotted series out of one ``/metrics`` page."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return Scrape(
        t_s=t_s,
        generated_tokens=values.get("quicsrv_generated_tokens_total", 0.0),
        ttft_sum_s=values.get("quicsrv_time_to_first_token_seconds_sum", 0.0),
        ttft_count=values.get("quicsrv_time_to_first_token_seconds_count", 0.0),
        sessions_paused=values.get("quicsrv_sessions_paused", 0.0),
        generations_active=values.get("quicsrv_generations_active", 0.0),
        generations_queued=values.get("quicsrv_generations_queued", 0.0),
    )


def rates(scrapes: Sequence[Scrape]) -> list[tuple[float, float, float | None]]:
    """(time, tokens/s, mean TTFT in s or None) for each interval between two scrapes."""
    out = []
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        span = after.t_s - before.t_s
        if span <= 0:
            continue
        tokens_per_s = (after.generated_tokens - before.generated_tokens) / span
        first_tokens = after.ttft_count - before.ttft_count
        ttft = (after.ttft_sum_s - before.ttft_sum_s) / first_tokens if first_tokens else None
        out.append((after.t_s, tokens_per_s, ttft))
    return out


class MetricsScraper:
    """Scrapes ``/metrics`` every ``interval_s`` on a thread of its own until :meth:`stop`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ca: str | Path,
        interval_s: float = 1.0,
        api_key: str | None = None,
    ) -> None:
        self.host, self.port, self.ca, self.api_key = host, port, Path(ca), api_key
        self.interval_s = interval_s
        self.scrapes: list[Scrape] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name="metrics-scraper", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> list[Scrape]:
        """Stop after the scrape in progress (one more is taken first) and return them all."""
        self._stop.set()
        self._thread.join(timeout_s)
        return list(self.scrapes)

    async def _run(self) -> None:
        started = time.monotonic()
        try:
            async with Client(self.host, self.port, ca=self.ca, api_key=self.api_key) as client:
                while True:
                    stopping = self._stop.is_set()  # the last scrape comes after the load
                    response = await client.get("/metrics")
                    if response.status != 200:
                        self.errors.append(f"/metrics answered {response.status}")
                        return
                    self.scrapes.append(parse_scrape(response.text, time.monotonic() - started))
                    if stopping:
                        return
                    # A sampling period, not a synchronisation; stop() cuts it short.
                    await asyncio.to_thread(self._stop.wait, self.interval_s)
        except Exception as exc:  # a scraper problem must not fail the load run
            self.errors.append(f"{type(exc).__name__}: {exc}")


def write_png(scrapes: Sequence[Scrape], path: Path, title: str = "quicsrv") -> None:
    """Three panels over time: tokens/s, mean TTFT, sessions (paused, active, queued)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_interval = rates(scrapes)
    fig, (throughput, ttft, sessions) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    throughput.plot([t for t, _, _ in per_interval], [r for _, r, _ in per_interval], "-o", ms=3)
    throughput.set_ylabel("generated tokens/s")
    ttft_points = [(t, v * 1e3) for t, _, v in per_interval if v is not None]
    ttft.plot([t for t, _ in ttft_points], [v for _, v in ttft_points], "-o", ms=3)
    ttft.set_ylabel("mean TTFT (ms)")
    times = [s.t_s for s in scrapes]
    sessions.plot(times, [s.sessions_paused for s in scrapes], label="paused sessions")
    sessions.plot(times, [s.generations_active for s in scrapes], label="active generations")
    sessions.plot(times, [s.generations_queued for s in scrapes], label="queued")
    sessions.set_ylabel("count")
    sessions.set_xlabel("seconds")
    sessions.legend(fontsize="small")
    fig.suptitle(f"{title}: /metrics every scrape ({len(scrapes)} scrapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.locust.metrics_scrape", description=__doc__
    )
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--port", type=int, default=4433)
    parser.add_argument("--ca", type=Path, default=Path("certs/ca.pem"))
    parser.add_argument("--api-key", help="default: none (use with metrics_public servers)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to scrape")
    parser.add_argument("--out", type=Path, default=Path("metrics.png"))
    args = parser.parse_args(argv)
    scraper = MetricsScraper(
        args.host, args.port, ca=args.ca, interval_s=args.interval, api_key=args.api_key
    )
    scraper.start()
    time.sleep(args.seconds)  # the run's length: scraping goes on meanwhile
    scrapes = scraper.stop()
    if scraper.errors:
        print("scrape errors:", *scraper.errors, sep="\n  ")
    if len(scrapes) < 2:
        print("fewer than two scrapes: nothing to plot")
        return 1
    write_png(scrapes, args.out)
    print(f"{len(scrapes)} scrapes plotted in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
