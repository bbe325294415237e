"""The studio's web app: FastAPI routes over :class:`~qkv.studio.engine.Studio`, one offline page.

Routes (JSON in and out; an error is ``{"error": "<words for the page>"}`` with its status, and
``"model": "<id>"`` when another model answers the request)::

    GET  /                 the page (scripts and styles inline, no network)
    GET  /api/models       the models offered, the one the page opens on, the request limits
    POST /api/analyze      {model, text, pair?, focus?, target?, lang}
    POST /api/head         {model, text, pair?, layer, head, token, lang}
    POST /api/intervene    {model, text, heads: [[layer, head], ...], mode, source?, focus?, temperature, lang}
    POST /api/compare      {model, text, other, focus?, lang}
    GET  /api/tutorial     ?lang=en|zh

Every refusal is worded in the request's language: its ``lang`` field, else its
``Accept-Language`` header (the page sends its own), else the server's.

As a local server it trusts nothing it is sent (:class:`Guard`): requests name models by id
(never a path), the Host header must be a name the server can honestly be reached by (no DNS
rebinding), a request from another origin (``null`` included) is refused, bodies are counted as
they arrive and cut at :data:`MAX_BODY_BYTES` whatever their framing, and every text reaches the
page as data, never as markup.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
from typing import Any, List, Literal, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from ..extras import require
from ..locale import LANGUAGES, Note, messages, text
from ..viz.pages import asset, environment, markup, script_json
from .engine import LIMITS, Studio, StudioError, page_words

# the studio extra: importing this module without it raises MissingExtra, which names the extra
fastapi = require("fastapi", "qkv studio")
pydantic = require("pydantic", "qkv studio", "studio")
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import HTMLResponse, Response  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402
from starlette.requests import Request  # noqa: E402

__all__ = ["LOCAL_HOSTS", "MAX_BODY_BYTES", "Guard", "create_app", "host_name", "is_loopback", "machine_names",
           "page", "reachable_hosts"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The names of this machine's loopback interface, which every studio answers to."""
MAX_BODY_BYTES = 256_000
"""Largest request body accepted (a few texts of at most ``LIMITS["max_chars"]`` characters)."""
_SERVER_WORDS = ("err.", "note.", "line.", "field.")  # catalogue entries the server words; the page does not need them


# -- the names a studio answers to ----------------------------------------------------------------

def host_name(value: str) -> str:
    """A Host header's name (or an address, or a --host value) as the studio compares names:
    lower case, no port, no IPv6 brackets or zone, no trailing dot."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1:v.index("]")] if "]" in v else v[1:]
    elif v.count(":") == 1:  # name:port (a bare IPv6 address has several colons and no port)
        v = v.split(":")[0]
    return v.split("%")[0].rstrip(".")


def machine_names() -> set[str]:
    """This machine's names and addresses as other machines may reach it: its host name and
    fully qualified name, their aliases and addresses, and the source address of its default
    route (IPv4 and IPv6). Nothing is sent: a UDP ``connect`` only chooses the route."""
    names: set[str] = set()
    for get in (socket.gethostname, socket.getfqdn):
        try:
            names.add(get())
        except OSError:
            pass
    for name in list(names):
        try:
            main, aliases, addresses = socket.gethostbyname_ex(name)
            names |= {main, *aliases, *addresses}
        except OSError:
            pass
        try:
            names |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    for family, probe in ((socket.AF_INET, ("192.0.2.1", 9)), (socket.AF_INET6, ("2001:db8::1", 9))):
        try:  # documentation addresses (RFC 5737, RFC 3849): a route to them is any default route
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                names.add(s.getsockname()[0])
        except OSError:
            pass
    return {host_name(n) for n in names if n and host_name(n)}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a --host value, e.g. "127.0.0.1", "::1", "localhost") is this machine only."""
    host = host_name(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable_hosts(bind: str, allow: Sequence[str] = ()) -> tuple[str, ...]:
    """The names a Host header may carry for a studio listening on ``bind``: the loopback names,
    the bound address, this machine's names and addresses (:func:`machine_names`) when ``bind``
    is not a loopback address, and ``allow`` (``--allow-host``), sorted."""
    names = set(LOCAL_HOSTS) | {host_name(bind)} | {host_name(a) for a in allow}
    if not is_loopback(bind):
        names |= machine_names()
    names.discard("")
    return tuple(sorted(names))


# -- words -------------------------------------------------------------------------------------

def page(lang: str = "en", nonce: str = "") -> str:
    """The studio's one page: its words in every language, its script and style inline."""
    words = {code: {k: v for k, v in messages(code, "studio.").items() if not k.startswith(_SERVER_WORDS)}
             for code in LANGUAGES}
    return environment("qkv.studio").get_template("studio.html.j2").render(
        lang=lang, nonce=nonce, words_json=script_json(words), limits_json=script_json(LIMITS),
        script=markup(asset("studio.js", "qkv.studio")), style=markup(asset("studio.css", "qkv.studio")),
        title=words[lang]["title"],
    )


def header_lang(headers: Any) -> Optional[str]:
    """The first language of an ``Accept-Language`` header that the catalogue speaks, or None."""
    for part in headers.get("accept-language", "").split(","):
        code = part.split(";")[0].strip().lower().split("-")[0]
        if code in LANGUAGES:
            return code
    return None


def _refusal(words: str, status: int, model: Optional[str] = None) -> Response:
    """An error answer. ASCII JSON: a lone surrogate quoted from the request cannot break it."""
    body = {"error": words, **({"model": model} if model else {})}
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, media_type="application/json")


# -- the guard in front of every route ------------------------------------------------------------

class BodyTooLarge(HTTPException):
    """A request body past the limit, noticed while it arrives (raised inside ``receive``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413)
        self.limit = limit


class Guard:
    """The ASGI middleware in front of every route: the Host check, the same-origin check, the
    body limit (``Content-Length`` checked before anything is read; every body, chunked ones
    included, counted as ``receive`` hands it over and cut with 413 at ``limit``, so nothing past
    the limit is read or parsed), and the security headers of every answer."""

    def __init__(self, app: Any, *, hosts: Sequence[str], lang: str = "en", limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.hosts, self.lang, self.limit = app, frozenset(host_name(h) for h in hosts), lang, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        lang = header_lang(headers) or self.lang
        host, origin, size = headers.get("host", ""), headers.get("origin"), headers.get("content-length")
        refused: Optional[tuple[Note, int]] = None
        if host_name(host) not in self.hosts:  # DNS rebinding: another site's name for this address
            refused = Note("studio.err.host", host=host_name(host)[:100] or "?"), 400
        elif origin == "null":  # a sandboxed frame or a local file: never the studio's own page
            refused = Note("studio.err.origin_null"), 403
        elif origin is not None and urlsplit(origin).netloc.lower() != host.lower():
            # same origin only: the page's own requests carry the address it was loaded from,
            # which is the Host header already checked (also when --host serves another interface)
            refused = Note("studio.err.origin", origin=origin[:100]), 403
        elif size is not None and (not size.isdigit() or int(size) > self.limit):
            refused = Note("studio.err.body", max=self.limit, chars=LIMITS["max_chars"]), 413
        if refused is not None:
            await _refusal(page_words(refused[0], lang), refused[1])(scope, receive, send)
            return
        got = 0

        async def counted() -> Any:
            nonlocal got
            message = await receive()
            if message["type"] == "http.request":
                got += len(message.get("body", b""))
                if got > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        started = False

        async def secured(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-content-type-options", b"nosniff"),
                                                  (b"referrer-policy", b"no-referrer")]}
            await send(message)

        try:
            await self.app(scope, counted, secured)
        except BodyTooLarge:  # only when no handler inside answered it (the app's own handler does)
            if started:
                raise
            words = page_words(Note("studio.err.body", max=self.limit, chars=LIMITS["max_chars"]), lang)
            await _refusal(words, 413)(scope, receive, secured)


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
    layer: int  # ranges are the model's: the engine checks them and names them
    head: int
    token: int = 0
    pair: Optional[Text] = None
    lang: Lang = "en"


class Intervene(Strict):
    model: str = Field(max_length=200)
    text: Text
    heads: List[Tuple[int, int]] = Field(max_length=LIMITS["max_heads"])
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


# pydantic's refusals, in the catalogue's words: the error type -> the message
_INVALID = {"missing": "missing", "extra_forbidden": "extra", "json_invalid": "json", "literal_error": "choice",
            "int_type": "int", "int_parsing": "int", "int_from_float": "int", "string_type": "str",
            "float_type": "float", "float_parsing": "float", "finite_number": "float", "bool_type": "int",
            "greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le",
            "too_long": "too_long", "list_type": "list", "tuple_type": "list", "model_attributes_type": "object",
            "dict_type": "object", "model_type": "object"}


def _invalid(err: dict[str, Any]) -> Note:
    """One of pydantic's validation errors as a note: the field (as the request named it) and what is wrong."""
    where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")[:100] or "request"
    ctx = err.get("ctx") or {}
    kind = _INVALID.get(str(err.get("type")))
    if kind is None:
        return Note("studio.err.v.other", field=where, problem=str(err.get("msg", "invalid")))
    limit = next((ctx[k] for k in ("gt", "ge", "lt", "le", "max_length", "expected") if k in ctx), "")
    return Note(f"studio.err.v.{kind}", field=where, limit=limit)


def create_app(studio: Studio, *, hosts: Sequence[str] = LOCAL_HOSTS, lang: str = "en") -> Any:
    """The ASGI app serving ``studio``. ``hosts``: the names the Host header may carry (see
    :func:`reachable_hosts`); ``lang``: the page's first language, and the words of refusals
    whose request names none."""
    app = fastapi.FastAPI(title="qkv studio", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, hosts=hosts, lang=lang)

    def lang_of(request: Any, body: Any = None) -> str:
        asked = getattr(request.state, "lang", None) or (body.get("lang") if isinstance(body, dict) else None)
        return asked if asked in LANGUAGES else header_lang(request.headers) or lang

    @app.exception_handler(StudioError)
    async def studio_error(request: Any, e: StudioError) -> Any:
        return _refusal(e.text(lang_of(request)), e.status, e.model)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Any, e: BodyTooLarge) -> Any:
        return _refusal(text("studio.err.body", lang_of(request), max=e.limit, chars=LIMITS["max_chars"]), 413)

    @app.exception_handler(Exception)
    async def failed(request: Any, e: Exception) -> Any:  # a bug: the page shows a line, the server keeps serving
        return _refusal(text("studio.err.failed", lang_of(request), error=f"{type(e).__name__}: {e}"[:300]), 500)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Any, e: Any) -> Any:
        words = lang_of(request, getattr(e, "body", None))
        problems = text("list.sep", words).join(page_words(_invalid(err), words) for err in e.errors()[:3])
        return _refusal(text("studio.err.bad_request", words, problems=problems), 422)

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
        return {"models": studio.models(), "default": studio.default, "limits": LIMITS}

    @app.post("/api/analyze")
    def analyze(r: Analyze, request: Request) -> Any:
        request.state.lang = r.lang
        return studio.analyze(r.model, r.text, pair=r.pair, focus=r.focus, target=r.target, lang=r.lang)

    @app.post("/api/head")
    def head(r: Head, request: Request) -> Any:
        request.state.lang = r.lang
        return studio.head(r.model, r.text, layer=r.layer, head=r.head, token=r.token, pair=r.pair, lang=r.lang)

    @app.post("/api/intervene")
    def intervene(r: Intervene, request: Request) -> Any:
        request.state.lang = r.lang
        return studio.intervene(r.model, r.text, heads=r.heads, mode=r.mode, source=r.source, focus=r.focus,
                                temperature=r.temperature, lang=r.lang)

    @app.post("/api/compare")
    def compare(r: Compare, request: Request) -> Any:
        request.state.lang = r.lang
        return studio.compare(r.model, r.text, r.other, focus=r.focus, lang=r.lang)

    @app.get("/api/tutorial")
    def tutorial(request: Request, lang: Lang = "en") -> Any:
        request.state.lang = lang
        return studio.tutorial(lang)

    return app
