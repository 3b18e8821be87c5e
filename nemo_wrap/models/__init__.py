"""Architectures: one folder per architecture of our own, a spec for each, and the registry.

- :mod:`.spec`: ``ModelSpec``, everything nemo_wrap needs to know about one architecture.
- :mod:`.registry`: ``MODEL_ARCH_MAPPING`` (the list of specs), ``register_architecture`` and the
  resolution of a config to a spec and a class.
- :mod:`.llama`, :mod:`.qwen2`, :mod:`.qwen3`: our fused implementations (``model.py``) and their
  ``SPEC`` (``__init__.py``), on top of :mod:`.common`.
- :mod:`.transformers_classes`: specs that give transformers' own classes a tensor-parallel plan.

Nothing is imported here, so using one architecture does not load the others.
"""
