"""Fine-tuning data: chat, prompt/completion and text rows → labelled tokens → packed rows → batches.

- :mod:`.rows`: load rows with ``datasets`` (local JSONL/JSON/Parquet/CSV or a hub id), detect
  the format, validate every row (errors name the file and row);
- :mod:`.labels`: tokenize with the tokenizer's own chat template, labels only on what the
  assistant says and the token that ends its turn;
- :mod:`.packing`: several examples per row, positions restarting, nothing learned across them;
- :mod:`.order`: which examples each data-parallel rank sees, per epoch, deterministically.
"""

from nemo_wrap.data.labels import LabelledExample, label_conversation, label_prompt_completion, label_text
from nemo_wrap.data.order import epoch_order
from nemo_wrap.data.packing import pack_examples

__all__ = [
    "LabelledExample",
    "epoch_order",
    "label_conversation",
    "label_prompt_completion",
    "label_text",
    "pack_examples",
]
