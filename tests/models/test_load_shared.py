"""qkv.models.load_shared: one copy of each model per process, shared by explain and trace_model."""

from __future__ import annotations

import pytest

from ..helpers import bundled_model_dir

MODEL_DIR = bundled_model_dir(module_level=True)
models = pytest.importorskip("qkv.models")


def test_one_copy_per_directory_however_it_is_named():
    models.clear_loaded()
    first = models.load_shared()
    assert models.load_shared(MODEL_DIR) is first and models.load_shared(str(MODEL_DIR)) is first


def test_analysis_and_glass_share_the_cache():
    from qkv.analysis import load_model
    from qkv.glass.model import resolve_model as glass_model

    assert load_model(None) is models.load_shared()
    assert glass_model(None)[0] is models.load_shared()


def test_build_loads_what_qkv_models_does_not_and_clear_forgets(tmp_path):
    made = []
    built = models.load_shared(tmp_path, build=lambda d: made.append(d) or object())
    assert models.load_shared(tmp_path, build=lambda d: pytest.fail("loaded twice")) is built
    assert made == [str(tmp_path)]
    models.clear_loaded()
    assert models.load_shared(tmp_path, build=lambda d: "again") == "again"
    models.clear_loaded()
