"""The chat page's files through the one router (no socket, a fake engine), the protocol
header every answer carries, and the test fault switch's bookkeeping. The page itself runs in
real Chromium in tests/browser."""

from __future__ import annotations

import re

import pytest

from quicsrv.apikeys import hash_key
from quicsrv.http.faults import StreamFaults
from quicsrv.http.messages import FullResponse
from quicsrv.http.webui import PAGES
from quicsrv_proto.http3 import PROTOCOL_HEADER
from tests.http.routers import fake_router
from tests.http.test_native import _request


@pytest.mark.asyncio
@pytest.mark.parametrize("http3", [True, False], ids=["h3", "tcp"])
async def test_the_page_and_its_files_need_no_key_and_allow_nothing_foreign(tmp_path, http3):
    router = fake_router(tmp_path, keys=(hash_key("secret"),))
    for path, (_, content_type) in PAGES.items():
        response = await router.handle(_request(path, method="GET", http3=http3))
        assert isinstance(response, FullResponse), path
        assert response.status == 200 and response.content_type == content_type
        headers = dict(response.headers)
        assert headers[b"content-security-policy"].startswith(b"default-src 'self'")
        assert headers[b"x-content-type-options"] == b"nosniff"
        assert headers[PROTOCOL_HEADER] == (b"h3" if http3 else b"http/1.1")
        assert response.body
    # The API behind it still wants the key.
    refused = await router.handle(_request("/v1/models", method="GET", http3=http3))
    assert isinstance(refused, FullResponse) and refused.status == 401


@pytest.mark.asyncio
async def test_the_page_loads_nothing_but_its_own_files_and_inserts_text_as_text(tmp_path):
    router = fake_router(tmp_path)
    page = await router.handle(_request("/", method="GET", http3=False))
    script = await router.handle(_request("/ui/app.js", method="GET", http3=False))
    assert isinstance(page, FullResponse) and isinstance(script, FullResponse)
    html, js = page.body.decode(), script.body.decode()
    linked = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert linked and all(url.startswith("/ui/") for url in linked)
    assert "<script>" not in html and " style=" not in html  # no inline code for the CSP to allow
    for hook in ("prompt", "send", "stop", "output", "status", "protocol"):
        assert f'id="{hook}"' in html or f'id = "{hook}"' in js or f'.id = "{hook}"' in js
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js


@pytest.mark.asyncio
async def test_only_get_serves_the_page(tmp_path):
    router = fake_router(tmp_path)
    response = await router.handle(_request("/", method="POST", http3=False))
    assert isinstance(response, FullResponse) and response.status == 404


def test_armed_cuts_are_taken_once_each_in_order():
    faults = StreamFaults()
    assert faults.take() is None
    faults.cut_next(3, streams=2)
    faults.cut_next(1)
    assert [faults.take(), faults.take(), faults.take(), faults.take()] == [3, 3, 1, None]
    assert faults.cuts_made == 3
    with pytest.raises(ValueError):
        faults.cut_next(0)
