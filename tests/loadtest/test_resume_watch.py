"""The soak's record of each resume (loadtest.bench.resume_watch), without a server."""

from __future__ import annotations

import pytest

from loadtest.bench.resume_watch import ResumeWatch, server_state, summary

SCRAPE = {
    "quicsrv_generations_active": 8.0,
    "quicsrv_generations_slots": 8.0,
    "quicsrv_generations_queued": 3.0,
    "quicsrv_resumes_queued": 3.0,
    "quicsrv_engine_up": 1.0,
    'quicsrv_sessions_by_state{state="starting"}': 3.0,
    'quicsrv_sessions_by_state{state="parked"}': 0.0,
    "quicsrv_requests_total": 99.0,
}


def test_a_scrape_keeps_the_slots_the_lines_the_engine_and_the_states():
    assert server_state(SCRAPE) == {
        "generations_active": 8.0,
        "generations_slots": 8.0,
        "generations_queued": 3.0,
        "resumes_queued": 3.0,
        "engine_up": 1.0,
        "state:starting": 3.0,
    }


@pytest.mark.asyncio
async def test_a_resume_is_recorded_with_the_servers_state_at_its_first_token():
    scrapes = []

    async def scrape():
        scrapes.append(1)
        return SCRAPE

    watch = ResumeWatch("cut-resume", "ab" * 16, scrape, every_s=3600)
    watch.first_token()
    watch.first_token()  # later tokens change nothing
    wait = await watch.finish()
    assert len(scrapes) == 1
    assert wait.first_token_s is not None and wait.at_first_token["resumes_queued"] == 3.0
    assert "slots 8/8, in line 3 (resumes 3)" in wait.describe()
    assert "starting 3" in summary([wait])


@pytest.mark.asyncio
async def test_a_resume_without_a_token_says_so():
    async def scrape():
        raise AssertionError("no scrape without a first token or a look")

    wait = await ResumeWatch("cut-resume", "cd" * 16, scrape, every_s=3600).finish()
    assert wait.first_token_s is None and wait.at_first_token == {}
    assert summary([wait]) == "1 resumes, none timed"
