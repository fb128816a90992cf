"""Training data: HF `datasets` streams and local files -> formatted, loss-masked,
packed, DP-sliced, resumable batches.

    from hfmeg.data import DataConfig, SourceConfig, build_data, build_eval_data
    cfg = DataConfig(sources=[SourceConfig("data/sft_sample.jsonl")], format="alpaca", seq_len=512)
    data = build_data(cfg, tokenizer, dp_rank=r, dp_size=dp, micro_batch_size=2, global_batch_size=16)
    batch = next(data)   # StepBatch(microbatches=[MicroBatch(input_ids, labels, position_ids, segment_ids)], num_tokens)

Modules, in pipeline order: `config` (DataConfig), `sources` (Hub/local readers),
`mixing` (weighted deterministic mixture), `formats` (chat/alpaca/text -> ids +
loss targets), `preference` (preference records -> chosen/rejected documents, TRL's ids),
`validate` (bad-data policy), `packing` (rows), `pairs` (pairs into row pairs,
`PairBatch`), `microbatch` (the `MicroBatch` type: device move, CP split), `batches` (global
batch -> DP slice), `state` (resume), `loader` (the iterators), `prefetch` (the
thread that builds batches ahead).
"""

from .batches import StepBatch
from .config import DataConfig, SourceConfig
from .formats import DEFAULT_CHAT_TEMPLATE
from .loader import EvalData, TrainData
from .microbatch import MicroBatch
from .validate import DataReport

build_data = TrainData
build_eval_data = EvalData

__all__ = ["DEFAULT_CHAT_TEMPLATE", "DataConfig", "DataReport", "EvalData", "MicroBatch", "SourceConfig",
           "StepBatch", "TrainData", "build_data", "build_eval_data"]
