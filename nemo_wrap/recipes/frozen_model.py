"""A frozen model beside the one that trains: a distillation teacher, or a DPO run's reference copy.

Loaded through the same audited pipeline and sharded by the same setup, so its parameters are
where the trained model's are — except where the combination table refuses a frozen model under
that setup (plain DDP wraps only modules that train, and holds the whole model on every rank
anyway): there it is held whole on each rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.distributed.combinations import Feature, refusals, setup_arguments
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.training.distillation import freeze_teacher


def load_frozen_model(checkpoint: str | Path, setup: DistributedSetup, options: LoadOptions) -> Any:
    """``checkpoint`` loaded with ``options`` under ``setup`` (whole, where a frozen model cannot be
    sharded by it), in eval mode, no parameter requiring a gradient."""
    whole = bool(refusals({Feature.FROZEN_MODEL, *setup_arguments(setup)}))
    placed = DistributedSetup.single_process() if whole else setup
    return freeze_teacher(
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=placed, options=options)
    )
