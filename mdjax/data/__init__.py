"""Corpora on disk and the input pipeline.

`mdjax.data.shards`: the prepared-corpus folder (token shards, manifest, tokenizer) that
`python -m mdjax.prepare_data` writes. `mdjax.data.pipeline`: each process's rows of the
global batch of a step (grain over the shards for a corpus task), the iterator state kept
in checkpoints, held-out batches and the time the loop waits on input.
"""

from mdjax.data.pipeline import (CorpusBatches, GeneratedBatches, InputWait, Windows,
                                 batch_for_step, batch_source, data_options, eval_batch,
                                 shuffle_seed, validation_batches)
from mdjax.data.shards import (CorruptShard, HfTokenizer, Split, load_tokenizer, read_manifest,
                               tokenizer_from_json)

__all__ = ["CorpusBatches", "CorruptShard", "GeneratedBatches", "HfTokenizer", "InputWait",
           "Split", "Windows", "batch_for_step", "batch_source", "data_options", "eval_batch",
           "load_tokenizer", "read_manifest",
           "shuffle_seed", "tokenizer_from_json", "validation_batches"]
