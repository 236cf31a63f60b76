"""Adapters that let existing model code run under cpattn's context parallelism.

* :mod:`cpattn.integrations.hf`: Hugging Face transformers attention-interface plug-in (optional
  extra ``cpattn[hf]``; transformers is imported lazily, on first use).
"""

__all__ = ["hf"]


def __getattr__(name: str):
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
