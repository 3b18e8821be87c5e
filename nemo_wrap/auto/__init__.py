"""The top of the load: ``NeMoAutoModelForCausalLM`` and the classes it returns.

- :mod:`.auto_model`: the factory (``plan``, ``from_pretrained``, ``from_config``).
- :mod:`.pipeline`: executing a load plan step by step.
- :mod:`.classes`, :mod:`.model_mixin`: the returned classes, with saving, synced generation and
  the load report composed over the resolved architecture's class.
"""

from nemo_wrap.auto.auto_model import NeMoAutoModelForCausalLM

__all__ = ["NeMoAutoModelForCausalLM"]
