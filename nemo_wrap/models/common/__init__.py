"""Pieces shared by our Llama, Qwen2 and Qwen3 models, one concept per module.

- :mod:`.layouts`: the TP-friendly row layouts of the fused ``qkv_proj`` and ``gate_up_proj``.
- :mod:`.norm`, :mod:`.rope`, :mod:`.attention`, :mod:`.mlp`: the building blocks.
- :mod:`.decoder`: the decoder stack; :mod:`.causal_lm`: the transformers-facing base class.
- :mod:`.state_dict_adapter`: transformers' checkpoint keys ↔ ours, whole or by row range.
- :mod:`.parallelize`: the tensor-parallel plan and its preconditions.

Nothing is imported here, so using one module does not load the others.
"""
