"""Fine-tuning data: chat, prompt/completion and text rows → labelled tokens → packed rows → batches.

- :mod:`.rows`: load rows with ``datasets`` (local JSONL/JSON/Parquet/CSV or a hub id), detect
  the format, validate every row (errors name the file and row);
- :mod:`.labels`: tokenize with the tokenizer's own chat template, labels only on what the
  assistant says and the token that ends its turn;
- :mod:`.packing`: several examples per row, positions restarting, nothing learned across them;
- :mod:`.examples`: rows → labelled examples of bounded length (truncated or dropped, counted)
  → fixed-length rows, packed or one example each;
- :mod:`.windows`: a plain text file → dense ``seq_len``-token windows → rows that learn every token;
- :mod:`.order` and :mod:`.batches`: which rows each data-parallel rank sees, per epoch,
  deterministically, as resumable steps of micro-batches. The one data-parallel loader: the
  recipes and the notebooks, text windows and data sets alike, go through it.
"""

from nemo_wrap.data.batches import DataParallelBatches
from nemo_wrap.data.examples import PreparedExamples, as_rows, prepare_examples
from nemo_wrap.data.labels import LabelledExample, label_conversation, label_prompt_completion, label_text
from nemo_wrap.data.order import epoch_order
from nemo_wrap.data.packing import pack_examples
from nemo_wrap.data.rows import Rows, load_rows
from nemo_wrap.data.windows import read_token_windows, window_rows

__all__ = [
    "DataParallelBatches",
    "LabelledExample",
    "PreparedExamples",
    "Rows",
    "as_rows",
    "epoch_order",
    "label_conversation",
    "label_prompt_completion",
    "label_text",
    "load_rows",
    "pack_examples",
    "prepare_examples",
    "read_token_windows",
    "window_rows",
]
