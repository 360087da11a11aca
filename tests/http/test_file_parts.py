"""Files attached to messages, read as text (no model)."""

from __future__ import annotations

import base64
import json

import pytest

from quicsrv.http.errors import ApiError
from quicsrv.http.file_parts import file_text
from quicsrv.http.openai_api import parse_completion
from quicsrv.http.responses_api import parse_create

MODEL = "m"


def pdf(text: str, *, xref: bool = True) -> bytes:
    """A one-page PDF whose text layer says ``text`` (Helvetica, no compression); without
    ``xref``, no cross-reference table (as the Open Responses suite's fixture)."""
    stream = f"BT /F1 12 Tf 72 72 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 144] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    if not xref:
        return bytes(out + b"trailer\n<< /Root 1 0 R >>\n%%EOF")
    where = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        where,
    )
    return bytes(out)


def data_url(media_type: str, content: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(content).decode()}"


def test_a_pdf_is_read_as_its_text_under_its_name() -> None:
    menu = data_url("application/pdf", pdf("Soup of the day"))
    part = {"filename": "menu.pdf", "file_data": menu}
    text = file_text(part, "input[0].content[1]")
    assert "[menu.pdf]\nSoup of the day\n[end of menu.pdf]" in text


def test_a_pdf_without_a_cross_reference_table_is_read_too() -> None:
    part = {"file_data": data_url("application/pdf", pdf("Title: Fixture", xref=False))}
    assert "Title: Fixture" in file_text(part, "p")


def test_a_text_file_is_read_as_utf8() -> None:
    part = {"file_data": data_url("text/markdown", "# Notes\ncafé".encode())}
    assert "# Notes\ncafé" in file_text(part, "p")


@pytest.mark.parametrize(
    ("part", "code", "says"),
    [
        ({"file_id": "file-1"}, "unsupported_value", "no files API"),
        ({"file_url": "http://169.254.169.254/"}, "unsupported_value", "fetches no URL"),
        ({"file_data": data_url("image/png", b"\x89PNG")}, "unsupported_value", "image/png"),
        ({"file_data": "data:text/plain;base64,@@@"}, "invalid_value", "not valid base64"),
        ({"file_data": "aGVsbG8="}, "invalid_value", "data URL"),
        ({"file_data": data_url("text/plain", b"\xff\xfe")}, "invalid_value", "not UTF-8"),
        ({"file_data": data_url("application/pdf", b"%PDF-1.4 garbage")}, "invalid_value", "PDF"),
        ({"file_data": data_url("application/pdf", pdf(""))}, "unsupported_value", "no text"),
        ({}, "invalid_value", "needs file_data"),
    ],
)
def test_what_cannot_be_read_is_refused_with_the_part_named(
    part: dict[str, str], code: str, says: str
) -> None:
    with pytest.raises(ApiError) as caught:
        file_text(part, "input[0].content[1]")
    error = json.loads(caught.value.body())["error"]
    assert (caught.value.status, error["code"], error["param"]) == (
        400,
        code,
        "input[0].content[1]",
    )
    assert says in error["message"]


def test_the_responses_api_and_chat_completions_put_the_file_in_the_message() -> None:
    file = {"filename": "f.txt", "file_data": data_url("text/plain", b"The code is 42.")}
    content = [{"type": "input_text", "text": "What is the code?"}, {"type": "input_file", **file}]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}]}
    request = parse_create(json.dumps(body).encode(), model_id=MODEL)
    (message,) = request.input
    assert message.content.startswith("What is the code?") and "The code is 42." in message.content

    chat = [{"type": "text", "text": "What is the code?"}, {"type": "file", "file": file}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": chat}]}
    completion = parse_completion(json.dumps(body).encode(), chat=True, model_id=MODEL)
    assert completion.generate.messages is not None
    assert "The code is 42." in completion.generate.messages[0].content
