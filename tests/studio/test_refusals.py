"""The studio as an attacker and a newcomer meet it: every bad index, undecodable text, oversized
or foreign request gets a 4xx with words for the page in the request's language (never a 500),
the body limit holds whatever the framing, the Host check holds on every interface, and the
page's notes and refusals speak of the page's own controls."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from ..helpers import SUBPROCESS_TIMEOUT, bundled_model_dir

pytest.importorskip("fastapi", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")
bundled_model_dir(module_level=True)

from fastapi.testclient import TestClient  # noqa: E402

from qkv.locale import messages  # noqa: E402
from qkv.studio import Studio  # noqa: E402
from qkv.studio.server import LOCAL_HOSTS, MAX_BODY_BYTES, create_app, host_name, reachable_hosts  # noqa: E402

TEXT = "Alice met Bob and she smiled."  # 9 word pieces: [CLS] alice met bob and she smiled . [SEP]
LONG = ("The old librarian, who had worked in the small town for forty years, quietly closed the heavy wooden door "
        "and walked home through the rain.")  # 25 words
WAIT_S = 120  # a ceiling for an answer, never a speed check
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Studio()), base_url="http://127.0.0.1:8765", raise_server_exceptions=False)


def refused(r: Any) -> str:
    """The words of a refusal, after checking it is one: a 4xx whose JSON body says why."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    words = r.json()["error"]
    assert isinstance(words, str) and len(words) > 8, words
    return words


# every request that answered 500 before (ValueError, TypeError, UnicodeEncodeError), and their kin
BAD_INDEXES = [
    ("/api/analyze", {"focus": -1}, "focus=-1"),
    ("/api/analyze", {"focus": 999}, "focus=999"),
    ("/api/analyze", {"focus": 10**20}, "focus=100000000000000000000"),
    ("/api/analyze", {"focus": -(10**20)}, "focus=-100000000000000000000"),
    ("/api/analyze", {"target": -1}, "target=-1"),
    ("/api/analyze", {"target": 999}, "target=999"),
    ("/api/analyze", {"target": 10**20}, "target=100000000000000000000"),
    ("/api/analyze", {"target": -(10**20)}, "target=-100000000000000000000"),
    ("/api/analyze", {"pair": "She smiled.", "focus": 14}, "focus=14"),  # the pair has 14 tokens: 0 to 13
    ("/api/intervene", {"heads": [[0, 1]], "focus": 999}, "focus=999"),
    ("/api/intervene", {"heads": [[0, 1]], "focus": 10**20}, "focus=100000000000000000000"),
    ("/api/intervene", {"heads": [[0, 1]], "focus": -1}, "focus=-1"),
    ("/api/intervene", {"heads": [[10**20, 1]]}, "L100000000000000000000 H1"),
    ("/api/intervene", {"heads": [[0, -1]]}, "L0 H-1"),
    ("/api/compare", {"other": "Carol met Dan.", "focus": 999}, "focus=999"),
    ("/api/compare", {"other": "Carol met Dan.", "focus": -1}, "focus=-1"),
    ("/api/head", {"layer": 0, "head": 0, "token": 999}, "token=999"),
    ("/api/head", {"layer": 0, "head": 0, "token": -1}, "token=-1"),
    ("/api/head", {"layer": 10**20, "head": 0}, "layer=100000000000000000000"),
    ("/api/head", {"layer": 0, "head": -1}, "head=-1"),
]


@pytest.mark.parametrize("route, fields, named", BAD_INDEXES, ids=[f"{r[5:]}-{n}" for r, _, n in BAD_INDEXES])
def test_an_index_out_of_range_is_a_4xx_that_names_it_and_the_range(client: TestClient, route: str, fields: dict,
                                                                     named: str) -> None:
    words = refused(client.post(route, json={"model": "minilm", "text": TEXT, **fields}))
    assert named in words and " 0 to " in words, words


def test_a_refusal_speaks_the_requests_language(client: TestClient) -> None:
    zh = refused(client.post("/api/analyze", json={"model": "minilm", "text": TEXT, "focus": 999, "lang": "zh"}))
    assert "focus=999" in zh and "词元编号为 0 到 8" in zh
    # no lang field (a malformed request, a refusal before any route): the page's Accept-Language
    assert "缺少" in refused(client.post("/api/analyze", json={"model": "minilm"}, headers={"Accept-Language": "zh-CN"}))
    assert "字节" in refused(client.post("/api/analyze", content=b"x" * (MAX_BODY_BYTES + 1),
                                         headers={"Accept-Language": "zh", "Content-Type": "application/json"}))
    en = TestClient(create_app(Studio(bundled=False), lang="zh"), base_url="http://evil.example")
    assert "--allow-host evil.example" in en.get("/", headers={"Accept-Language": "en"}).json()["error"]
    assert "不响应名称 evil.example" in en.get("/").json()["error"]  # no header: the server's language


@pytest.mark.parametrize("route, body", [
    ("/api/analyze", '{"model": "minilm", "text": "a \\ud800 b"}'),
    ("/api/analyze", '{"model": "toy", "text": "\\udfff"}'),
    ("/api/analyze", '{"model": "minilm", "text": "Alice met Bob.", "pair": "\\ud83d"}'),
    ("/api/head", '{"model": "minilm", "text": "x \\ud800", "layer": 0, "head": 0}'),
    ("/api/intervene", '{"model": "minilm", "text": "Alice met Bob.", "heads": [[0, 0]], "mode": "patch", "source": "\\udc00 x y"}'),
    ("/api/compare", '{"model": "minilm", "text": "Alice met Bob.", "other": "\\ud800"}'),
])
def test_a_lone_surrogate_is_a_4xx_that_says_which_text(client: TestClient, route: str, body: str) -> None:
    words = refused(client.post(route, content=body.encode(), headers={"Content-Type": "application/json"}))
    assert "not valid Unicode" in words and re.search(r"U\+D[89A-F][0-9A-F]{2}", words), words


@pytest.mark.parametrize("body", [
    '{"model": "\\ud800", "text": "Alice met Bob."}',           # a model id nobody offers, quoted back
    '{"model": "minilm", "text": "Alice", "\\ud800": 1}',       # an unknown field named by a surrogate
    '{"model": "minilm", "text": "Alice", "lang": "\\ud800"}',  # a language that is none
])
def test_a_surrogate_quoted_back_in_a_refusal_does_not_break_it(client: TestClient, body: str) -> None:
    r = client.post("/api/analyze", content=body.encode(), headers={"Content-Type": "application/json"})
    refused(r)
    r.content.decode("ascii")  # the refusal is ASCII JSON: nothing in it can fail to encode


def test_origin_null_and_foreign_origins_are_refused(client: TestClient) -> None:
    body = {"model": "toy", "text": "a b"}
    assert "without an origin" in refused(client.post("/api/analyze", json=body, headers={"Origin": "null"}))
    assert client.post("/api/analyze", json=body, headers={"Origin": "null"}).status_code == 403
    assert client.post("/api/analyze", json=body, headers={"Origin": "http://evil.example"}).status_code == 403
    assert client.post("/api/analyze", json=body, headers={"Origin": "http://127.0.0.1:8765"}).status_code == 200


def test_the_toy_model_refuses_a_long_text_and_offers_the_real_model(client: TestClient) -> None:
    r = client.post("/api/analyze", json={"model": "toy", "text": LONG})
    words = refused(r)
    assert "at most 16 words" in words and "choose all-MiniLM-L6-v2" in words and r.json()["model"] == "minilm"
    for route, body in (("/api/intervene", {"heads": [[0, 0]]}), ("/api/compare", {"other": "a b"})):
        r = client.post(route, json={"model": "toy", "text": "a b", **body})
        assert "all-MiniLM-L6-v2" in refused(r) and r.json()["model"] == "minilm"
    alone = TestClient(create_app(Studio(bundled=False)), base_url="http://localhost")
    r = alone.post("/api/analyze", json={"model": "toy", "text": LONG})
    assert "shorten it" in refused(r) and "model" not in r.json()
    # the real model reads it: every head's map
    got = client.post("/api/analyze", json={"model": "minilm", "text": LONG}).json()
    assert got["maps"]["shape"][:2] == [6, 12] and len(got["tokens"]) > 25


# -- the page's own words ---------------------------------------------------------------------

CLI_WORDS = re.compile(r"--[a-z]|\b(?:focus|target)=|\bablat|\d+\.\d+ \(--")


def test_the_pages_notes_lines_and_reports_name_no_command_line_options(client: TestClient) -> None:
    said = []
    for lang in ("en", "zh"):
        for body in ({}, {"focus": 5}, {"pair": "She smiled at him."}):
            said += client.post("/api/analyze", json={"model": "minilm", "text": TEXT, "lang": lang, **body}).json()["notes"]
        for mode, extra in (("zero", {}), ("mean", {}), ("patch", {"source": "Carol met Dan and he smiled."})):
            iv = client.post("/api/intervene", json={"model": "minilm", "text": TEXT, "heads": [[0, 11], [1, 3]],
                                                     "mode": mode, "lang": lang, **extra}).json()
            said += iv["lines"]
            assert "L0 H11" in iv["lines"][0] and "0.11" not in iv["lines"][0]
            if lang == "zh":  # one word for knocking a head out, in the mode and in the results
                assert "消融" not in "".join(iv["lines"]) and (mode == "patch" or "敲除" in iv["lines"][0])
        cmp = client.post("/api/compare", json={"model": "minilm", "text": TEXT, "other": "Carol met Dan and he smiled.",
                                                "lang": lang}).json()
        said += [cmp["report"], *cmp["notes"]]
    assert len(said) > 20 and not [s for s in said if CLI_WORDS.search(s)], [s for s in said if CLI_WORDS.search(s)]
    assert any("click a token" in s for s in said) and any("点击一个词元" in s for s in said)


def test_every_note_that_names_an_option_has_the_pages_own_wording() -> None:
    for lang in ("en", "zh"):
        notes, page = messages(lang, "note."), messages(lang, "studio.note.")
        with_options = {k for k, v in notes.items() if "--" in v or "=" in v}
        assert with_options and with_options <= set(page), sorted(with_options - set(page))
        assert not [v for v in page.values() if "--" in v or "=" in v]
    mode = messages("zh", "studio.mode_")
    assert "敲除" in mode["zero"] and not [v for k, v in messages("zh", "studio.").items() if "消融" in v]


def test_every_word_the_page_names_is_in_the_catalogue() -> None:
    """studio.js's t("key") and say("key", ...), and the template's data-w attributes, in both languages."""
    from qkv.studio.server import page

    js = (ROOT / "qkv" / "studio" / "templates" / "studio.js").read_text(encoding="utf-8")
    html = (ROOT / "qkv" / "studio" / "templates" / "studio.html.j2").read_text(encoding="utf-8")
    named = set(re.findall(r"\b(?:t|say)\(\"([a-z_]+)\"", js)) | set(re.findall(r"data-w(?:-[a-z]+)?=\"([a-z_]+)\"", html))
    words = json.loads(re.search(r'id="qkv-words">(.*?)</script>', page()).group(1))
    assert len(named) > 60
    for lang in ("en", "zh"):
        assert not named - set(words[lang]), sorted(named - set(words[lang]))
        assert not [k for k in words[lang] if k.startswith(("err.", "note.", "line."))]  # the server's words stay there


# -- the body limit, whatever the framing ------------------------------------------------------

@pytest.fixture(scope="module")
def live() -> Iterator[int]:
    """The app served by uvicorn on 127.0.0.1 and a free port, in a background thread: its port."""
    uvicorn = pytest.importorskip("uvicorn", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")
    server = uvicorn.Server(uvicorn.Config(create_app(Studio(bundled=False)), host="127.0.0.1", port=0,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="qkv-studio-limits", daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            pytest.fail(f"the studio server did not start within {WAIT_S} s")
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


def _readable(sock: socket.socket, wait: float) -> bool:
    return bool(select.select([sock], [], [], wait)[0])


def test_a_chunked_body_past_the_limit_is_refused_while_it_is_still_arriving(live: int) -> None:
    """200 MB announced as chunks from a generator: the server answers 413 after reading a little
    more than the limit, while the client has sent at most 16 times the limit (it then waits, up
    to a ceiling, for the answer, and sends nothing more): nothing past the limit was buffered."""
    total, chunk, most = 200_000_000, 64 * 1024, 16 * MAX_BODY_BYTES
    conn = http.client.HTTPConnection("127.0.0.1", live, timeout=WAIT_S)
    sent, answered_at = 0, None

    def body() -> Iterator[bytes]:
        nonlocal sent, answered_at
        yield b'{"model": "toy", "text": "'
        while sent < total:
            assert conn.sock is not None
            if _readable(conn.sock, 0) or (sent >= most and _readable(conn.sock, WAIT_S)):
                answered_at = sent  # the answer came first: stop sending
                return
            if sent >= most:
                return  # no answer within the ceiling: the server is reading the whole body
            yield b"x" * chunk
            sent += chunk

    try:
        conn.request("POST", "/api/analyze", body=body(), headers={"Content-Type": "application/json",
                                                                     "Accept-Language": "en"})
        r = conn.getresponse()
        got = json.loads(r.read())
    finally:
        conn.close()
    assert answered_at is not None and answered_at <= most, (sent, answered_at)
    assert r.status == 413 and str(MAX_BODY_BYTES) in got["error"], got
    print(f"413 after {answered_at / 1e6:.2f} MB of the 200 MB body")


def test_a_declared_length_past_the_limit_is_refused_before_a_byte_of_body(live: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", live, timeout=WAIT_S)
    try:
        conn.putrequest("POST", "/api/analyze")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", "200000000")
        conn.endheaders()  # the headers only: the answer comes without any of the body
        r = conn.getresponse()
        assert r.status == 413 and str(MAX_BODY_BYTES) in json.loads(r.read())["error"]
    finally:
        conn.close()


def test_the_limit_counts_bodies_in_any_framing(client: TestClient) -> None:
    chunks = (b"x" * 50_000 for _ in range(10))  # TestClient sends a generator without a length
    r = client.post("/api/analyze", content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]
    small = client.post("/api/analyze", content=(p for p in (b'{"model": "toy", ', b'"text": "a b"}')),
                        headers={"Content-Type": "application/json"})
    assert small.status_code == 200, small.text  # under the limit a streamed body is read as any other


# -- the names the server answers to -----------------------------------------------------------

def test_host_names_are_compared_without_port_brackets_or_case() -> None:
    assert [host_name(h) for h in ("[::1]:8765", "[::1]", "::1", "LocalHost:80", "example.org.", "127.0.0.1:1")] == \
        ["::1", "::1", "::1", "localhost", "example.org", "127.0.0.1"]
    app = create_app(Studio(bundled=False))
    for base in ("http://[::1]:8765", "http://localhost:8765", "http://127.0.0.1:8765"):
        assert TestClient(app, base_url=base).get("/api/models").status_code == 200, base


def test_a_wildcard_bind_answers_to_this_machines_names_only() -> None:
    hosts = reachable_hosts("0.0.0.0", ["studio.example"])
    assert set(LOCAL_HOSTS) <= set(hosts) and socket.gethostname().lower() in hosts and "studio.example" in hosts
    assert reachable_hosts("127.0.0.1") == tuple(sorted(LOCAL_HOSTS))  # loopback: the loopback names, nothing else
    app = create_app(Studio(bundled=False), hosts=hosts)
    assert TestClient(app, base_url="http://evil.example:8765").get("/api/models").status_code == 400
    assert TestClient(app, base_url=f"http://{socket.gethostname()}:8765").get("/api/models").status_code == 200
    assert TestClient(app, base_url="http://studio.example:8765").get("/api/models").status_code == 200


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    """``qkv studio --no-browser --port 0 ARGS`` in a subprocess: it and the address it printed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "studio", "--no-browser", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(SUBPROCESS_TIMEOUT)
    if not (line and "serving on " in line[0]):
        proc.kill()
        pytest.fail(f"qkv studio {' '.join(args)} did not start: {line} {proc.communicate()[1]}")
    return proc, line[0].split("serving on ")[1].split()[0]


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0 and "Traceback" not in err, err
    return err


def _status(port: int, host: str, family: int = socket.AF_INET) -> int:
    address = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    conn = http.client.HTTPConnection(address, port, timeout=WAIT_S)
    try:
        conn.request("GET", "/api/models", headers={"Host": host})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow  # starts the command (7 s; the IPv6 one stays in the quick tier); CI's slow tier runs it
def test_the_command_on_every_interface_still_checks_the_host_and_stops_cleanly_on_ctrl_c() -> None:
    proc, url = _serve("--host", "0.0.0.0", "--allow-host", "studio.example")
    try:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        assert url == f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url + "api/models", timeout=WAIT_S) as r:
            assert json.load(r)["default"] == "minilm"  # the page opens on the real model
        assert _status(port, f"evil.example:{port}") == 400  # DNS rebinding: another site's name for this machine
        assert _status(port, f"{socket.gethostname()}:{port}") == 200
        assert _status(port, f"studio.example:{port}") == 200 and _status(port, f"127.0.0.1:{port}") == 200
    finally:
        err = _stop(proc)
    assert "warning: listening on 0.0.0.0 lets other machines reach this studio" in err
    assert "answers to these names only" in err and socket.gethostname().lower() in err and "--allow-host" in err


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_the_command_on_ipv6_loopback_prints_a_url_and_answers_its_own_page() -> None:
    proc, url = _serve("--host", "::1")
    try:
        assert re.fullmatch(r"http://\[::1\]:\d+/", url), url
        port = int(url.rsplit(":", 1)[1].strip("/"))
        assert _status(port, f"[::1]:{port}", socket.AF_INET6) == 200  # the page's own Host header
        assert _status(port, f"evil.example:{port}", socket.AF_INET6) == 400
    finally:
        err = _stop(proc)
    assert "warning" not in err, err  # loopback: this machine only


def test_allow_host_refuses_what_is_not_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    from qkv.cli import main

    assert main(["studio", "--no-browser", "--allow-host", "*"]) == 2  # refused before anything is bound
    assert "--allow-host '*' is not a host name" in capsys.readouterr().err
