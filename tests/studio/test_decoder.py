"""The studio on a transformers decoder checkpoint (``qkv studio --model DIR``), which runs
through ``attn_implementation="qkv"``: the maps equal eager attention's, the statistics come
from the calls qkv observes, an intervention reports next-token probabilities at the chosen
temperature, and the one-head glass box says why it is not offered."""

from __future__ import annotations

import base64

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="decoder checkpoints run through transformers: pip install 'qkv[hf]'")
pytest.importorskip("fastapi", reason="qkv studio needs the studio extra: pip install 'qkv[studio]'")

from fastapi.testclient import TestClient  # noqa: E402

from qkv.studio import Studio  # noqa: E402
from qkv.studio.server import create_app  # noqa: E402

from ..analysis.test_explain_hf import TEXT, _eager_maps, _save  # noqa: E402  (the tiny checkpoints, built offline)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    _save("gpt2", path)
    client = TestClient(create_app(Studio([str(path)], bundled=False)), base_url="http://127.0.0.1:8765")
    (model_id,) = [m["id"] for m in client.get("/api/models").json()["models"] if m["id"] != "toy"]
    return client, model_id, path


def _weights(maps: dict) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(maps["data"]), dtype="<u2").astype(np.float64) / 65535.0
    return raw.reshape(maps["shape"])


def test_a_decoders_maps_and_statistics(gpt2) -> None:
    client, model_id, path = gpt2
    got = client.post("/api/analyze", json={"model": model_id, "text": TEXT}).json()
    assert got["model"]["kind"] == "decoder" and got["tokens"] == TEXT.split()
    assert np.abs(_weights(got["maps"]) - _eager_maps(path)).max() <= 1e-4  # 16-bit transport of eager's maps
    stats = got["stats"]
    assert len(stats) == 2 * 4 and all(s["entropy"] >= 0 and 0 <= s["sink"] <= 1 for s in stats)
    first = [s for s in stats if s["layer"] == 0]
    assert all(s["mean_distance"] >= 0 for s in first)


def test_a_decoders_intervention_reports_the_next_token_at_a_temperature(gpt2) -> None:
    client, model_id, _ = gpt2
    body = {"model": model_id, "text": TEXT, "heads": [[0, 1], [1, 2]], "focus": len(TEXT.split()) - 1}
    cool = client.post("/api/intervene", json={**body, "temperature": 0.5}).json()["output"]["decoder"]
    warm = client.post("/api/intervene", json={**body, "temperature": 2.0}).json()["output"]["decoder"]
    assert cool["temperature"] == 0.5 and len(cool["clean"]) == 5 and cool["clean"][0]["token"] == warm["clean"][0]["token"]
    assert cool["clean"][0]["p"] > warm["clean"][0]["p"]  # a lower temperature sharpens the same distribution
    assert sum(p["p"] for p in cool["clean"]) <= 1.0 + 1e-9 and cool["kl"] >= 0


def test_a_decoders_head_view_says_why_there_is_no_glass_box(gpt2) -> None:
    client, model_id, _ = gpt2
    r = client.post("/api/head", json={"model": model_id, "text": TEXT, "layer": 0, "head": 0})
    assert r.status_code == 422 and "runs through transformers" in r.json()["error"]
