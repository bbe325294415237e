"""The studio's routes, as a client calls them: every answer, every refusal, and the numbers
against the analyses they come from (``qkv.glass.trace_model``, ``qkv.analysis.explain``)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ..helpers import SUBPROCESS_TIMEOUT, bundled_model_dir

pytest.importorskip("fastapi", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")
bundled_model_dir(module_level=True)

from fastapi.testclient import TestClient  # noqa: E402

from qkv.studio import LIMITS, Studio  # noqa: E402
from qkv.studio.server import MAX_BODY_BYTES, create_app  # noqa: E402

TEXT = "Alice met Bob and she smiled."


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("broken")
    (d / "config.json").write_text("{not json", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def client(broken_dir: Path) -> TestClient:
    return TestClient(create_app(Studio([str(broken_dir)])), base_url="http://127.0.0.1:8765")


def weights(maps: dict) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(maps["data"]), dtype="<u2").astype(np.float64) / 65535.0
    return raw.reshape(maps["shape"])


def test_models_lists_the_given_the_bundled_and_the_toy_and_opens_on_the_first(client: TestClient, broken_dir: Path) -> None:
    got = client.get("/api/models").json()
    given = broken_dir.name.lower().replace("_", "-")
    assert [m["id"] for m in got["models"]] == [given, "minilm", "toy"] and got["default"] == given
    assert got["limits"] == LIMITS
    assert all(set(m) == {"id", "name", "kind", "loaded", "error"} for m in got["models"])
    # without a checkpoint of one's own the page opens on the real model; the toy one is the tutorial's
    assert Studio().default == "minilm" and Studio(bundled=False).default == "toy"


def test_analyze_gives_every_head_its_map_and_statistics_as_explain_does(client: TestClient) -> None:
    from qkv.analysis import explain

    got = client.post("/api/analyze", json={"model": "minilm", "text": TEXT, "focus": 5}).json()
    ex = explain(TEXT, "#5")
    assert got["tokens"] == ex.tokens and got["tokens"][got["focus"]] == "she"
    assert got["tokens"][got["target"]] == "alice"
    maps = weights(got["maps"])
    assert maps.shape == (6, 12, len(ex.tokens), len(ex.tokens))
    assert np.abs(maps - ex.maps).max() <= 1 / 65535  # 16-bit transport, nothing else
    assert len(got["stats"]) == 72 and {"entropy", "mean_distance", "sink", "kind"} <= set(got["stats"][0])
    top = got["top_heads"][0]
    assert (top["layer"], top["head"]) == ex.top_heads(1)[0][:2]


def test_a_head_is_the_glass_box_of_trace_model_exactly(client: TestClient) -> None:
    from qkv.glass import trace_model

    got = client.post("/api/head", json={"model": "minilm", "text": TEXT, "layer": 2, "head": 7, "token": 5}).json()
    t = trace_model(TEXT, layer=2, head=7)
    for step in ("q", "k", "v", "scores", "scaled", "weights", "output"):
        assert np.array_equal(np.array(got["trace"]["steps"][step], dtype=np.float64), getattr(t, step)), step
    assert got["story"] == t.explain("en", token=5)
    zh = client.post("/api/head", json={"model": "minilm", "text": TEXT, "layer": 2, "head": 7, "token": 5, "lang": "zh"}).json()
    assert zh["story"] == t.explain("zh", token=5)


def test_knocking_out_heads_changes_the_output_and_later_maps(client: TestClient) -> None:
    clean = weights(client.post("/api/analyze", json={"model": "minilm", "text": TEXT}).json()["maps"])
    got = client.post("/api/intervene", json={"model": "minilm", "text": TEXT, "heads": [[0, 3], [1, 5]]}).json()
    assert got["output"]["encoder"]["similarity"] < 1.0
    after = weights(got["maps"])
    change = np.array(got["change"])
    assert np.allclose(change[0], 0.0) and np.abs(after[0] - clean[0]).max() <= 1 / 65535  # layer 0 runs before the edit
    assert change[2:].max() > 1e-3  # later layers read what the knocked-out heads no longer write
    none = client.post("/api/intervene", json={"model": "minilm", "text": TEXT, "heads": []})
    assert none.status_code == 400 and "no heads" in none.json()["error"]


def test_patching_from_a_second_text_of_the_same_length(client: TestClient) -> None:
    got = client.post("/api/intervene", json={"model": "minilm", "text": TEXT, "heads": [[1, 0], [2, 2]], "mode": "patch",
                                              "source": "Carol met Dan and he smiled."}).json()
    assert got["mode"] == "patch" and got["output"]["encoder"]["similarity"] < 1.0
    bad = client.post("/api/intervene", json={"model": "minilm", "text": TEXT, "heads": [[1, 0]], "mode": "patch",
                                              "source": "A much longer sentence than the first one here."})
    assert bad.status_code == 400 and "same length" in bad.json()["error"]


def test_compare_two_texts(client: TestClient) -> None:
    a, b = "The trophy did not fit in the case because it was too big.", "The trophy did not fit in the case because it was too small."
    got = client.post("/api/compare", json={"model": "minilm", "text": a, "other": b}).json()
    assert weights(got["a"]["maps"]).shape[:2] == (6, 12) and len(got["alignment"]) >= 14
    assert np.array(got["distance"]).shape == (6, 12) and got["top_changes"]


def test_the_tutorial_is_the_worked_example_first() -> None:
    got = Studio(bundled=False).tutorial("en")
    first = got["steps"][0]["trace"]["steps"]
    assert first["scores"][0] == [112.0, 96.0] and first["scaled"][0] == [14.0, 12.0]
    assert np.round(first["weights"][0], 3).tolist() == [0.881, 0.119]
    assert [s["name"] for s in got["steps"]] == ["worked", "causal", "heads"]


def test_the_toy_model_answers_without_a_pretrained_one() -> None:
    c = TestClient(create_app(Studio(bundled=False)), base_url="http://localhost")
    got = c.post("/api/analyze", json={"model": "toy", "text": "Thinking Machines learn"}).json()
    assert got["tokens"] == ["Thinking", "Machines", "learn"] and weights(got["maps"]).shape == (1, 2, 3, 3)
    head = c.post("/api/head", json={"model": "toy", "text": "Thinking Machines learn", "layer": 0, "head": 1}).json()
    assert np.allclose(np.array(head["trace"]["steps"]["weights"]).sum(-1), 1.0)
    refused = c.post("/api/intervene", json={"model": "toy", "text": "Thinking Machines", "heads": [[0, 0]]})
    assert refused.status_code == 400 and "toy model" in refused.json()["error"]


@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope", "text": TEXT}, 404, "not one of this studio's models"),
    ({"model": "minilm", "text": ""}, 400, "text is empty"),
    ({"model": "minilm", "text": "   "}, 400, "text is empty"),
    ({"model": "minilm", "text": "word " * 2000}, 413, "at most 1000"),
    ({"model": "minilm", "text": "word " * 150}, 413, "at most 128"),
    ({"model": "minilm", "text": 3}, 422, "text"),
    ({"model": "minilm"}, 422, "text is missing"),
    ({"model": "minilm", "text": TEXT, "lang": "fr"}, 422, "lang"),
    ({"model": "minilm", "text": TEXT, "surprise": 1}, 422, "surprise"),
    ({"model": "../../etc/passwd", "text": TEXT}, 404, "not one of this studio's models"),
])
def test_bad_analyze_requests_get_one_clear_line(client: TestClient, body: dict, status: int, words: str) -> None:
    r = client.post("/api/analyze", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text


@pytest.mark.parametrize("route, body, words", [
    ("/api/head", {"model": "minilm", "text": TEXT, "layer": 6, "head": 0}, "layer=6 is out of range"),
    ("/api/head", {"model": "minilm", "text": TEXT, "layer": 0, "head": 0, "token": 40}, "token=40"),
    ("/api/intervene", {"model": "minilm", "text": TEXT, "heads": [[9, 0]]}, "out of range"),
    ("/api/intervene", {"model": "minilm", "text": TEXT, "heads": [[0, 0]], "mode": "patch"}, "needs source"),
    ("/api/intervene", {"model": "minilm", "text": TEXT, "heads": [[0, 0]], "mode": "erase"}, "mode"),
    ("/api/intervene", {"model": "minilm", "text": TEXT, "heads": [[0, 0]], "temperature": 0}, "temperature"),
    ("/api/compare", {"model": "minilm", "text": TEXT, "other": ""}, "the second text is empty"),
])
def test_bad_requests_on_every_route(client: TestClient, route: str, body: dict, words: str) -> None:
    r = client.post(route, json=body)
    assert 400 <= r.status_code < 500 and words in r.json()["error"], r.text


def test_wrong_json_and_oversized_bodies(client: TestClient) -> None:
    r = client.post("/api/analyze", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["error"]
    big = json.dumps({"model": "minilm", "text": "x" * (MAX_BODY_BYTES + 1)})
    r = client.post("/api/analyze", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]


def test_a_model_that_fails_to_load_is_reported_and_the_others_keep_serving(client: TestClient, broken_dir: Path) -> None:
    bad = [m for m in client.get("/api/models").json()["models"] if m["id"] not in ("toy", "minilm")][0]
    r = client.post("/api/analyze", json={"model": bad["id"], "text": TEXT})
    assert r.status_code == 503 and "could not be loaded" in r.json()["error"] and r.json()["model"] == "minilm"
    assert client.get("/api/models").json()["models"][0]["error"]
    assert client.post("/api/analyze", json={"model": "minilm", "text": TEXT}).status_code == 200


def test_other_hosts_and_other_origins_are_refused() -> None:
    app = create_app(Studio(bundled=False))
    assert TestClient(app, base_url="http://attacker.example").get("/").status_code == 400  # DNS rebinding
    local = TestClient(app, base_url="http://127.0.0.1:8765")
    r = local.post("/api/analyze", json={"model": "toy", "text": "a b"}, headers={"origin": "http://attacker.example"})
    assert r.status_code == 403
    assert local.post("/api/analyze", json={"model": "toy", "text": "a b"}, headers={"origin": "http://127.0.0.1:8765"}).status_code == 200
    other_port = local.post("/api/analyze", json={"model": "toy", "text": "a b"}, headers={"origin": "http://127.0.0.1:9999"})
    assert other_port.status_code == 403  # another local server's page is another site
    lan = TestClient(create_app(Studio(bundled=False), hosts=("192.168.1.5",)), base_url="http://192.168.1.5:8765")
    assert lan.post("/api/analyze", json={"model": "toy", "text": "a b"}, headers={"origin": "http://192.168.1.5:8765"}).status_code == 200
    assert lan.post("/api/analyze", json={"model": "toy", "text": "a b"}, headers={"origin": "http://attacker.example"}).status_code == 403


def test_the_page_is_offline_and_strict() -> None:
    r = TestClient(create_app(Studio(bundled=False)), base_url="http://localhost").get("/")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    nonce = csp.split("'nonce-")[1].split("'")[0]
    assert f'<script nonce="{nonce}">' in r.text and "http://" not in r.text and "https://" not in r.text
    assert r.headers["x-content-type-options"] == "nosniff"
    for path in ("/static/../../etc/passwd", "/..%2f..%2fetc/passwd", "/api/../pyproject.toml", "/qkv/studio/engine.py"):
        assert TestClient(create_app(Studio(bundled=False)), base_url="http://localhost").get(path).status_code == 404


def test_concurrent_requests_from_several_tabs_get_their_own_answers(client: TestClient) -> None:
    texts = ["Alice met Bob and she smiled.", "The cat sat on the mat.", "Paris is the capital of France."]
    alone = {t: client.post("/api/analyze", json={"model": "minilm", "text": t}).json()["maps"]["data"] for t in texts}
    cut = {t: client.post("/api/intervene", json={"model": "minilm", "text": t, "heads": [[2, 1]]}).json()["maps"]["data"]
           for t in texts}

    def ask(i: int) -> tuple[str, str, str]:
        t = texts[i % 3]
        if i % 2:
            return t, "cut", client.post("/api/intervene", json={"model": "minilm", "text": t, "heads": [[2, 1]]}).json()["maps"]["data"]
        return t, "alone", client.post("/api/analyze", json={"model": "minilm", "text": t}).json()["maps"]["data"]

    with ThreadPoolExecutor(6) as pool:
        for t, kind, data in pool.map(ask, range(18)):
            assert data == (alone if kind == "alone" else cut)[t], (t, kind)


def test_the_command_names_the_extra_when_it_is_missing(tmp_path: Path) -> None:
    (tmp_path / "uvicorn.py").write_text("raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "qkv", "studio", "--no-browser"], capture_output=True, text=True, env=env,
                          timeout=SUBPROCESS_TIMEOUT, cwd=tmp_path)
    assert done.returncode == 1 and "pip install 'qkv[studio]'" in done.stderr and "Traceback" not in done.stderr


def test_a_taken_port_is_one_clear_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "qkv", "studio", "--no-browser", "--port", str(port)],
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_head_of_a_sentence_pair_is_traced_as_the_pair(client: TestClient) -> None:
    from qkv.glass import trace_model

    body = {"model": "minilm", "text": "Alice met Bob.", "pair": "She smiled at him.", "layer": 3, "head": 4, "token": 6}
    got = client.post("/api/head", json=body).json()
    t = trace_model("Alice met Bob.", layer=3, head=4, pair="She smiled at him.")
    assert got["head"] == 4 and got["trace"]["tokens"] == t.tokens and t.tokens.count("[SEP]") == 2
    assert np.array_equal(np.array(got["trace"]["steps"]["weights"]), t.weights)
    overview = client.post("/api/analyze", json={"model": "minilm", "text": "Alice met Bob.", "pair": "She smiled at him."}).json()
    assert np.abs(weights(overview["maps"])[3, 4] - t.weights).max() < 1e-4  # the map beside it: the same pair
