"""A file attached to a message, read as the text the model reads.

The Responses API's ``input_file`` part and chat completions' ``file`` part carry a file inline
(``file_data``: a ``data:`` URL, base64). The model reads text only, so the file becomes text
in the prompt, as OpenAI gives a model without vision a PDF's extracted text: a PDF's text layer
(pdfminer.six, page by page), a text file's UTF-8. What cannot be read that way is refused with the
part named: a PDF with no text layer (a scan), another type (an image, a word-processor file),
a file referred to by ``file_id`` (there is no files API) or ``file_url`` (the server fetches
nothing a request names: that would let a client reach what only the server can).

Bounded: the body limit bounds the file; at most :data:`MAX_PAGES` pages are read and at most
:data:`MAX_TEXT_CHARS` characters kept (past that the prompt could not fit any context this
server runs: it is refused as too long anyway).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from .errors import ApiError

__all__ = ["MAX_PAGES", "MAX_TEXT_CHARS", "file_text"]

MAX_PAGES = 200
MAX_TEXT_CHARS = 1 << 20

#: Types read as UTF-8 text besides ``text/*``.
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/x-yaml",
        "application/yaml",
        "application/javascript",
        "application/x-python",
        "application/x-sh",
        "application/csv",
    }
)


def file_text(part: dict[str, Any], param: str) -> str:
    """The text a file part stands for in the prompt: its name, then its contents."""
    name = part.get("filename")
    if name is not None and not isinstance(name, str):
        raise _refused(f"{param}.filename must be a string", param, "invalid_type")
    if part.get("file_id") is not None:
        raise _refused(
            f"{param}.file_id: this server has no files API; send the file inline as file_data",
            param,
        )
    if part.get("file_url") is not None:
        raise _refused(
            f"{param}.file_url: this server fetches no URL a request names; send the file "
            "inline as file_data",
            param,
        )
    data = part.get("file_data")
    if not isinstance(data, str):
        raise _refused(f"{param} needs file_data (a base64 data: URL)", param, "invalid_value")
    media_type, content = _data_url(data, param)
    text = _read(media_type, content, name or "", param)
    label = name or "attached file"
    return f"\n\n[{label}]\n{text.strip()}\n[end of {label}]\n\n"


def _data_url(data: str, param: str) -> tuple[str, bytes]:
    """The media type and bytes of a ``data:<type>;base64,<data>`` URL."""
    header, comma, encoded = data.partition(",")
    if not comma or not header.startswith("data:") or not header.endswith(";base64"):
        raise _refused(
            f"{param}.file_data must be a data URL: data:<media type>;base64,<data>",
            param,
            "invalid_value",
        )
    try:
        content = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(f"{param}.file_data is not valid base64", param, "invalid_value") from None
    media_type = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    return media_type, content


def _read(media_type: str, content: bytes, name: str, param: str) -> str:
    if media_type == "application/pdf" or (
        media_type in ("", "application/octet-stream") and content.startswith(b"%PDF-")
    ):
        return _pdf_text(content, param)
    if media_type.startswith("text/") or media_type in _TEXT_TYPES:
        try:
            return content.decode("utf-8")[:MAX_TEXT_CHARS]
        except UnicodeDecodeError:
            raise _refused(f"{param}: the file is not UTF-8 text", param, "invalid_value") from None
    raise _refused(
        f"{param}: a {media_type or 'file'} cannot be read: the model reads text, so only PDF "
        "and text files are accepted",
        param,
    )


def _pdf_text(content: bytes, param: str) -> str:
    # pdfminer.six: pure Python, so a hostile PDF cannot crash the server's process, and it
    # reads files whose cross-reference table is missing or broken (as many generated ones
    # are: the Open Responses suite's fixture has none; pypdf refused it).
    from pdfminer.high_level import extract_text
    from pdfminer.pdfdocument import PDFEncryptionError, PDFPasswordIncorrect

    try:
        text = extract_text(io.BytesIO(content), maxpages=MAX_PAGES)
    except (PDFEncryptionError, PDFPasswordIncorrect):
        raise _refused(f"{param}: the PDF is encrypted", param) from None
    except Exception as exc:  # a parser of untrusted bytes fails in many ways: each is a 400
        raise _refused(f"{param}: the PDF cannot be read ({exc})", param, "invalid_value") from None
    text = "\n\n".join(p.strip() for p in text.split("\f") if p.strip())[:MAX_TEXT_CHARS]
    if not text:
        raise _refused(
            f"{param}: the PDF has no text layer (a scan?): the model reads text only", param
        )
    return text


def _refused(message: str, param: str, code: str = "unsupported_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)
