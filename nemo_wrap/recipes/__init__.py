"""Complete training jobs built from the library's parts; the command line runs them."""

from nemo_wrap.recipes.sft import SFTConfig, run_sft

__all__ = ["SFTConfig", "run_sft"]
