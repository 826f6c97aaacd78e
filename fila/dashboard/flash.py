"""One-shot notices carried across a POST-redirect-GET in a signed cookie.

After an action the browser is redirected (so a reload does not repeat a purge),
and the outcome has to survive that redirect. Putting the text in the URL would let
anyone craft a link that makes the dashboard say anything; a cookie signed with the
process secret can only hold what this process wrote.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Final, Literal

from starlette.requests import Request
from starlette.responses import Response

FLASH_COOKIE: Final = "fila_dashboard_flash"


@dataclass(frozen=True, slots=True)
class Flash:
    kind: Literal["ok", "error"]
    text: str


class Flasher:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _sign(self, payload: str) -> str:
        return hmac.new(self._secret, b"flash:" + payload.encode(), hashlib.sha256).hexdigest()

    def put(self, response: Response, flash: Flash) -> None:
        # Unpadded URL-safe base64: cookie-safe characters only. Capped to fit a cookie.
        raw = json.dumps([flash.kind, flash.text[:1000]])
        payload = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
        response.set_cookie(
            FLASH_COOKIE,
            f"{payload}.{self._sign(payload)}",
            httponly=True,
            samesite="strict",
            max_age=60,
        )

    def read(self, request: Request) -> Flash | None:
        """The pending notice, if any and genuine (`clear` it on the response showing it)."""
        value = request.cookies.get(FLASH_COOKIE)
        if not value:
            return None
        payload, _, signature = value.rpartition(".")
        if not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return None
        try:
            raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
            kind, text = json.loads(raw)
        except (ValueError, TypeError):
            return None
        if kind not in ("ok", "error") or not isinstance(text, str):
            return None
        return Flash("ok" if kind == "ok" else "error", text)

    @staticmethod
    def clear(response: Response) -> None:
        response.delete_cookie(FLASH_COOKIE, httponly=True, samesite="strict")
