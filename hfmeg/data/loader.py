"""The data pipeline the trainer iterates: records -> documents -> rows -> global batches.

    data = build_data(cfg, tokenizer, dp_rank=ps.dp_rank, dp_size=ps.dp,
                      micro_batch_size=mbs, global_batch_size=gbs,
                      cp_rank=ps.cp_rank, cp_size=ps.cp)  # optional: context parallelism
    for batch in data:            # one StepBatch per optimizer step, forever (sources cycle)
        batch.microbatches        # this DP rank's micro-batches: MicroBatch, [mbs, seq_len / cp] int64 tensors
        batch.num_tokens          # non-ignored labels of the whole global batch (loss normaliser)
    state = data.state_dict()     # JSON-able, identical on every rank; save with the checkpoint
    data.load_state_dict(state)   # the next batch is the one an uninterrupted run would yield
    data.report.counts            # data problems by kind so far ({"overlong": 311, ...}); .first: each one's first case
    data.close()                  # stop the thread that builds batches ahead (data.prefetch)

    data.epoch                    # epochs of training data drawn so far (2.25: a quarter into the third)

    for batch in build_eval_data(...):  # finite: eval_sources once, or the records of the eval split

Every rank of every layout runs the same deterministic pipeline (mixture of
sources -> `Formatter` -> overlong policy -> `Packer`), so global batch k is the
same rows whatever TP/PP/DP; see `batches.py` for the DP slicing. Records are
rendered and tokenized `read_ahead` at a time (one batched tokenizer call); the
state only counts records whose documents were consumed, so read-ahead never
leaks into a resumed stream. With `data.prefetch`, the next batches are built in
a background thread while the step runs (`TrainData`). Each source holds out its eval split and reads its training
records in a new seeded order every epoch (sources.py), mixed across sources by weight (mixing.py).

Preference data (`DataConfig.preference`) takes the same path with `PairFormatter` (data/preference.py: a record
becomes its chosen and rejected documents) and `PairPacker` (data/pairs.py: row pairs) in place of `Formatter` and
`Packer`, and its micro-batches are `PairBatch`es.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import torch.distributed as dist

from ..errors import DataError
from .batches import StepBatch, check_batch_layout, step_batch
from .microbatch import split_chunks
from .config import DataConfig
from .formats import BadRecord, Doc, Formatter
from .mixing import Mixture, Position, progress, single_pass
from .packing import Packer
from .pairs import PairPacker
from .preference import PairFormatter
from .prefetch import Prefetcher
from .sources import Source
from .state import VERSION, check_state, fingerprint, position_in, position_out
from .validate import DataReport


@dataclass
class Item:
    """The outcome of one raw record: its documents (0, 1, or pieces) and/or its problem."""

    source: int
    where: str
    position: Position | None
    docs: list[Doc] = field(default_factory=list)
    problem: tuple[str, str] | None = None  # (kind, message)


def fit(doc: Doc, cfg: DataConfig) -> tuple[list[Doc], tuple[str, str] | None]:
    """Apply the overlong policy; a document without any target token is unusable."""
    n, s = len(doc.ids), cfg.seq_len
    if n > s and cfg.overlong == "split":
        pieces = [Doc(doc.ids[i:i + s], doc.target[i:i + s]) for i in range(0, n, s)]
        return [p for p in pieces if p.target[1:].any()], None
    size = f"{'over ' if doc.cut else ''}{n} tokens > seq_len {s}"
    if n > s and cfg.overlong == "drop":
        return [], ("overlong", f"{size}; dropped")
    problem = None
    if n > s:
        doc = Doc(doc.ids[:s], doc.target[:s])
        problem = ("overlong", f"{size}; truncated")
    if not doc.target[1:].any():
        if problem:
            return [], ("overlong", f"{size}; no response token left after truncation, dropped")
        return [], ("empty_response", "no token to train on")
    return [doc], problem


def documents(cfg: DataConfig, fmt: Formatter, sources: list[Source], raws: Iterator) -> Iterator[Item]:
    fields = [cfg.fields_of(s.cfg) for s in sources]
    limit = None if cfg.overlong == "split" else cfg.seq_len  # truncate and drop need only seq_len + 1 tokens
    while chunk := list(islice(raws, cfg.read_ahead)):
        items, rendered, owners = [], [], []
        for c, raw, pos in chunk:
            item = Item(c, raw.where, pos)
            items.append(item)
            if raw.problem is not None:
                item.problem = ("malformed_json", raw.problem)
                continue
            try:
                rendered.append(fmt.render(raw.record, *fields[c], limit))
                owners.append(item)
            except BadRecord as e:
                item.problem = (e.kind, str(e))
        if not rendered:
            outcomes = []
        elif cfg.preference:  # a pair's two documents, truncated as TRL truncates them
            outcomes = fmt.pairs(rendered, limit)
        else:
            outcomes = [fit(doc, cfg) for doc in fmt.tokenize(rendered, limit)]
        for item, (docs, problem) in zip(owners, outcomes):
            item.docs, item.problem = docs, problem
        yield from items


def consume(item: Item, packer: Packer, report: DataReport) -> None:
    # A bad record is counted once: met again in a later epoch of its source, it is the same record.
    if item.problem and (item.position is None or item.position.epochs[item.source] == 0):
        report.bad(item.problem[0], item.where, item.problem[1])
    packer.add_record(item.docs)
    report.documents += len(item.docs)


def pad_id_of(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if t is not None:
            return int(t)
    return 0


class _Pipeline:
    """What every batch builder shares: config, formatter, sources, this rank's place in the layout."""

    def __init__(self, cfg: DataConfig, tokenizer, sources, dp_rank, dp_size, micro_batch_size, global_batch_size,
                 cp_rank=0, cp_size=1, eval_only: bool = False):
        check_batch_layout(global_batch_size, micro_batch_size, dp_size, dp_rank, cfg.preference)
        if cp_size > 1:
            split_chunks(cfg.seq_len, cp_size, cp_rank)  # refuse a length the split cannot cut, before any data
        self.cfg = cfg
        self.formatter = (PairFormatter if cfg.preference else Formatter)(cfg, tokenizer)
        # training sources carry the eval split and the shuffle; an eval source is read whole, in file order
        split = {} if eval_only else dict(seed=cfg.seed, eval_split=cfg.eval_split, shuffle=cfg.shuffle,
                                          shuffle_buffer=cfg.shuffle_buffer)
        self.sources = [Source(s, c, **split) for c, s in enumerate(sources)]
        self.pad_id = pad_id_of(tokenizer)
        self.layout = (dp_rank, dp_size, micro_batch_size, cp_rank, cp_size)
        self.global_batch_size = global_batch_size
        # every rank meets the same data problems: one process (global rank 0, a DP rank 0) logs them
        self.announce = dp_rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0)

    def batch(self, rows: list[list[Doc]]) -> StepBatch:
        return step_batch(rows, self.cfg.seq_len, self.pad_id, *self.layout, pairs=self.cfg.preference)

    def packer(self) -> Packer | PairPacker:
        return (PairPacker if self.cfg.preference else Packer)(self.cfg.seq_len, self.cfg.packing, self.pad_id)


@dataclass
class Consumed:
    """The stream's resumable state right after one batch was built, kept with that batch."""

    step: int
    position: Position | None  # None until the first record is consumed
    packer: Packer
    report: DataReport


class _Stream:
    """The training stream proper: builds global batch after global batch, single-threaded."""

    def __init__(self, pipe: _Pipeline):
        self.pipe = pipe
        self.state = Consumed(0, None, pipe.packer(),
                              DataReport(pipe.cfg.bad_data, announce=pipe.announce))
        self._items: Iterator[Item] | None = None
        self._epoch: list[tuple[int, bool, int] | None] = [None] * len(pipe.sources)

    def start(self) -> Position:
        """Where training starts, the eval split's records read on the way: their problems are counted and reported
        as training records' are, whether or not eval runs (EvalData does not report them again)."""
        pipe = self.pipe
        held = single_pass(pipe.sources, held_out=True)
        for item in documents(pipe.cfg, pipe.formatter, pipe.sources, held):
            if item.problem:
                self.state.report.bad(item.problem[0], item.where, item.problem[1] + " (eval split)")
        return start_position(pipe.sources)

    def next(self) -> tuple[StepBatch, Consumed]:
        """The next batch and a snapshot of the state right after it."""
        st, pipe = self.state, self.pipe
        if st.position is None:
            st.position = self.start()
        if self._items is None:
            raws = iter(Mixture(pipe.sources, pipe.cfg.seed, st.position))
            self._items = documents(pipe.cfg, pipe.formatter, pipe.sources, raws)
        rows = []
        while len(rows) < pipe.global_batch_size:
            if st.packer.ready:
                rows.append(st.packer.take())
                continue
            item = next(self._items)
            consume(item, st.packer, st.report)
            st.position = item.position
            self._check_epoch(item)
        st.step += 1
        return pipe.batch(rows), Consumed(st.step, st.position, st.packer.copy(), st.report.copy())

    def _check_epoch(self, item: Item) -> None:
        """Fail instead of cycling forever over a source none of whose records is usable."""
        c, pos = item.source, item.position
        epoch, index = pos.epochs[c], pos.index[c]
        seen = self._epoch[c]
        if seen is None or seen[0] != epoch:
            if seen is not None and seen[1] and seen[2] == 0:
                raise DataError(f"data source {self.pipe.sources[c].name}: no usable record in a whole epoch "
                                f"({self.state.report.summary()})")
            seen = (epoch, index == 1, 0)
        self._epoch[c] = (seen[0], seen[1], seen[2] + len(item.docs))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        st = self.state
        st.step = int(d["step"])
        st.position = position_in(d["position"])
        st.packer.load_state_dict(d["packer"])
        st.report.load_state_dict(d["report"])
        self._items = None
        self._epoch = [None] * len(self.pipe.sources)


def start_position(sources: list[Source]) -> Position:
    return Position(0, [0] * len(sources), [0] * len(sources))


def _staged_next(stream: _Stream, stage: Callable[[StepBatch], StepBatch]) -> tuple[StepBatch, Consumed]:
    batch, consumed = stream.next()
    return stage(batch), consumed


class TrainData:
    """Infinite, resumable iterator of this DP rank's `StepBatch`es (see the module docstring).

    With `cfg.prefetch > 0` the batches are built that many ahead in a background
    thread (`prefetch.Prefetcher`). Each batch travels with a snapshot of the
    stream's state right after it, so `state_dict()` and `report` describe the
    batches CONSUMED, never the ones built ahead: the sequence and the saved states
    are the same with and without prefetching. `close()` stops the thread.

    `stage`, if given, is applied to each batch where it is built (in the thread, with prefetch):
    the trainer puts the micro-batches on its device and builds their attention masks there
    (models/staging.py), ahead of the step as the batch itself is.
    """

    def __init__(self, cfg: DataConfig, tokenizer, *, dp_rank: int, dp_size: int, micro_batch_size: int,
                 global_batch_size: int, cp_rank: int = 0, cp_size: int = 1,
                 stage: Callable[[StepBatch], StepBatch] | None = None):
        if not cfg.sources:
            raise DataError("data.sources is empty: name at least one dataset")
        self.cfg = cfg
        pipe = _Pipeline(cfg, tokenizer, cfg.sources, dp_rank, dp_size, micro_batch_size, global_batch_size, cp_rank,
                         cp_size)
        self.formatter = pipe.formatter
        # the producer thread references only the stream, so a dropped TrainData stops it when collected
        self._stream = _Stream(pipe)
        self._produce = self._stream.next if stage is None else partial(_staged_next, self._stream, stage)
        self._consumed = self._snapshot()
        self._ahead: Prefetcher | None = None

    def _snapshot(self) -> Consumed:
        st = self._stream.state
        return Consumed(st.step, st.position, st.packer.copy(), st.report.copy())

    @property
    def report(self) -> DataReport:
        """Data problems and documents up to the last batch consumed: `counts` by kind, `first` case of each."""
        return self._consumed.report

    @property
    def epoch(self) -> float | None:
        """Epochs of training data drawn up to the last batch consumed (`mixing.progress`); None for a streamed
        source of unknown length."""
        return progress(self._stream.pipe.sources, self._consumed.position)

    @property
    def split(self) -> list[tuple[str, int | None, int]]:
        """Each source's (name, training records per epoch (None: a stream of unknown length), held-out records)."""
        return [(s.name, s.train_size, s.held_size) for s in self._stream.pipe.sources]

    @property
    def step(self) -> int:
        """Batches consumed (across resumes)."""
        return self._consumed.step

    def __iter__(self) -> TrainData:
        return self

    def __next__(self) -> StepBatch:
        if not self.cfg.prefetch:
            batch, self._consumed = self._produce()
            return batch
        if self._ahead is None:
            self._ahead = Prefetcher(self._produce, self.cfg.prefetch)
        batch, self._consumed = self._ahead.get()
        return batch

    def close(self) -> None:
        """Stop building ahead (waits for a batch being built); the next `next()` starts again."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def state_dict(self) -> dict[str, Any]:
        c = self._consumed
        return {"version": VERSION, "fingerprint": fingerprint(self.cfg), "step": c.step,
                "position": position_out(c.position or start_position(self._stream.pipe.sources)),
                "packer": c.packer.state_dict(), "report": c.report.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        check_state(d, self.cfg)
        self.close()
        self._stream.load_state_dict(d)
        self._consumed = self._snapshot()


class EvalData(_Pipeline):
    """Finite eval batches: `eval_sources` read once each, else each training source's eval split.

    The last global batch is filled with all-padding rows (no labels), so every DP
    rank gets the same number of micro-batches. Data problems are logged on the
    first pass only (every pass meets the same ones), and not at all for the eval split, whose problems the
    training stream reports; `report` counts the last pass.
    """

    def __init__(self, cfg: DataConfig, tokenizer, *, dp_rank: int, dp_size: int, micro_batch_size: int,
                 global_batch_size: int, cp_rank: int = 0, cp_size: int = 1):
        if not cfg.eval_sources and not cfg.eval_split:
            raise DataError("no eval data: set data.eval_sources or data.eval_split")
        sources = cfg.eval_sources or cfg.sources
        super().__init__(cfg, tokenizer, sources, dp_rank, dp_size, micro_batch_size, global_batch_size, cp_rank,
                         cp_size, eval_only=bool(cfg.eval_sources))
        self.report = DataReport(cfg.bad_data, announce=self.announce and bool(cfg.eval_sources))

    def __iter__(self) -> Iterator[StepBatch]:
        cfg = self.cfg
        packer = self.packer()
        raws = single_pass(self.sources, held_out=not cfg.eval_sources)
        self.report = DataReport(cfg.bad_data, announce=self.report.announce and not self.report.first)
        rows: list[list[Doc]] = []
        for item in documents(cfg, self.formatter, self.sources, raws):
            consume(item, packer, self.report)
            while packer.ready:
                rows.append(packer.take())
                if len(rows) == self.global_batch_size:
                    yield self.batch(rows)
                    rows = []
        packer.flush()
        rows += [packer.take() for _ in range(len(packer.ready))]
        g = self.global_batch_size
        for i in range(0, len(rows), g):
            last = rows[i:i + g]
            yield self.batch(last + [[]] * (g - len(last)))
