"""The studio's web app: FastAPI routes over :class:`~qkv.studio.engine.Studio`, one offline page.

Routes (JSON in and out; an error is ``{"error": "<words for the page>"}`` with its status)::

    GET  /                 the page (scripts and styles inline, no network)
    GET  /api/models       the models offered and the request limits
    POST /api/analyze      {model, text, pair?, focus?, target?, lang}
    POST /api/head         {model, text, pair?, layer, head, token, lang}
    POST /api/intervene    {model, text, heads: [[layer, head], ...], mode, source?, focus?, temperature, lang}
    POST /api/compare      {model, text, other, focus?, lang}
    GET  /api/tutorial     ?lang=en|zh

As a local server it trusts nothing it is sent: requests name models by id (never a path), the
Host header must be the address it serves (no DNS rebinding), a request from another origin is
refused, bodies are capped, and every text reaches the page as data, never as markup.
"""

from __future__ import annotations

import secrets
from typing import Any, List, Literal, Optional, Sequence, Tuple

from ..extras import require
from ..locale import LANGUAGES, messages
from ..viz.pages import asset, environment, markup, script_json
from .engine import LIMITS, Studio, StudioError

# the studio extra: importing this module without it raises MissingExtra, which names the extra
fastapi = require("fastapi", "qkv studio")
pydantic = require("pydantic", "qkv studio", "studio")
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import HTMLResponse, JSONResponse, Response  # noqa: E402
from starlette.middleware.trustedhost import TrustedHostMiddleware  # noqa: E402

__all__ = ["create_app", "LOCAL_HOSTS", "MAX_BODY_BYTES", "page"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
MAX_BODY_BYTES = 256_000
"""Largest request body accepted (a few texts of at most ``LIMITS["max_chars"]`` characters)."""


def page(lang: str = "en", nonce: str = "") -> str:
    """The studio's one page: its words in every language, its script and style inline."""
    words = {code: messages(code, "studio.") for code in LANGUAGES}
    return environment("qkv.studio").get_template("studio.html.j2").render(
        lang=lang, nonce=nonce, words_json=script_json(words), limits_json=script_json(LIMITS),
        script=markup(asset("studio.js", "qkv.studio")), style=markup(asset("studio.css", "qkv.studio")),
        title=words[lang]["title"],
    )


# -- the requests: validated, unknown fields refused ------------------------------------------

Field, ConfigDict = pydantic.Field, pydantic.ConfigDict
Lang = Literal["en", "zh"]
Text = str  # lengths are checked by the engine, whose message names the limit


class Strict(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid")


class Analyze(Strict):
    model: str = Field(max_length=200)
    text: Text
    pair: Optional[Text] = None
    focus: Optional[int] = None
    target: Optional[int] = None
    lang: Lang = "en"


class Head(Strict):
    model: str = Field(max_length=200)
    text: Text
    layer: int = Field(ge=0, le=1000)
    head: int = Field(ge=0, le=1000)
    token: int = 0
    pair: Optional[Text] = None
    lang: Lang = "en"


class Intervene(Strict):
    model: str = Field(max_length=200)
    text: Text
    heads: List[Tuple[int, int]] = Field(max_length=LIMITS["max_heads"] + 1)
    mode: Literal["zero", "mean", "patch"] = "zero"
    source: Optional[Text] = None
    focus: Optional[int] = None
    temperature: float = Field(default=1.0, gt=0, le=100)
    lang: Lang = "en"


class Compare(Strict):
    model: str = Field(max_length=200)
    text: Text
    other: Text
    focus: Optional[int] = None
    lang: Lang = "en"


def create_app(studio: Studio, *, hosts: Sequence[str] = LOCAL_HOSTS, lang: str = "en") -> Any:
    """The ASGI app serving ``studio``; ``hosts``: the names the Host header may carry ("*": any)."""
    app = fastapi.FastAPI(title="qkv studio", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Any, call_next: Any) -> Any:
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            from urllib.parse import urlsplit

            # same origin only: the page's own requests carry the address it was loaded from, which
            # is the Host header already checked (also when --host serves another interface)
            if urlsplit(origin).netloc != request.headers.get("host"):
                return JSONResponse({"error": "requests from other sites are refused"}, status_code=403)
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            return JSONResponse({"error": f"the request is larger than {MAX_BODY_BYTES} bytes"}, status_code=413)
        response = await call_next(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    # added last, so it runs first: a foreign Host header never reaches a route
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=sorted({h.strip("[]") for h in hosts}))

    @app.exception_handler(StudioError)
    async def studio_error(request: Any, e: StudioError) -> Any:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.exception_handler(Exception)
    async def failed(request: Any, e: Exception) -> Any:  # a bug: the page shows a line, the server keeps serving
        return JSONResponse({"error": f"the studio failed on this request ({type(e).__name__}: {e})"}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Any, e: Any) -> Any:
        parts = []
        for err in e.errors()[:3]:
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "request"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return JSONResponse({"error": "bad request: " + "; ".join(parts)}, status_code=422)

    @app.get("/", response_class=HTMLResponse)
    def index() -> Any:
        nonce = secrets.token_urlsafe(16)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src 'self'; "
               "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        return HTMLResponse(page(lang, nonce), headers={"Content-Security-Policy": csp, "Cache-Control": "no-store"})

    @app.get("/favicon.ico")
    def favicon() -> Any:
        return Response(status_code=204)

    @app.get("/api/models")
    def models() -> Any:
        return {"models": studio.models(), "limits": LIMITS}

    @app.post("/api/analyze")
    def analyze(r: Analyze) -> Any:
        return studio.analyze(r.model, r.text, pair=r.pair, focus=r.focus, target=r.target, lang=r.lang)

    @app.post("/api/head")
    def head(r: Head) -> Any:
        return studio.head(r.model, r.text, layer=r.layer, head=r.head, token=r.token, pair=r.pair, lang=r.lang)

    @app.post("/api/intervene")
    def intervene(r: Intervene) -> Any:
        return studio.intervene(r.model, r.text, heads=r.heads, mode=r.mode, source=r.source, focus=r.focus,
                                temperature=r.temperature, lang=r.lang)

    @app.post("/api/compare")
    def compare(r: Compare) -> Any:
        return studio.compare(r.model, r.text, r.other, focus=r.focus, lang=r.lang)

    @app.get("/api/tutorial")
    def tutorial(lang: Lang = "en") -> Any:
        return studio.tutorial(lang)

    return app
