"""Every data source opened and its first records read before a run writes anything.

The training stream reads lazily, in the data thread, once the first step asks for a batch: by then the run
holds `--out`'s lock and has written its config, its metrics file and a checkpoint's HF side files, so an
empty file, a damaged Parquet footer, an unreachable Hub dataset or (with `bad_data: fail`) a bad record in
the first batches would leave a started run behind, and some of those errors surfaced as tracebacks from the
reader's library. `check_sources` opens every source the run names (training and eval) as the stream will,
reads its first `read_ahead` records (the first chunk the stream formats and tokenizes), and with
`bad_data: fail` puts that window through the formatter and the overlong policy, so the error is one line
(`DataError`) at start-up instead.
"""

from __future__ import annotations

from itertools import islice

from ..errors import DataError
from .config import DataConfig
from .formats import Formatter
from .loader import documents
from .preference import PairFormatter
from .sources import Source
from .validate import DataReport


def check_sources(cfg: DataConfig, tokenizer) -> None:
    """Raise `DataError` (one line naming the source, file or record) for the first source that cannot be
    opened, holds no record, or (`bad_data: fail`) holds a bad one among its first `read_ahead`."""
    formatter = (PairFormatter if cfg.preference else Formatter)(cfg, tokenizer) if cfg.bad_data == "fail" else None
    for source_cfg in [*cfg.sources, *cfg.eval_sources]:
        source = Source(source_cfg)
        try:
            window = list(islice(source.records(0), cfg.read_ahead))
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - a reader library's failure (network, a damaged file) as one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"data source {source.name}: cannot read its first records ({type(e).__name__}: "
                            f"{first[:200]})") from e
        if not window:
            raise DataError(f"data source {source.name}: no records")
        if formatter is not None:
            report = DataReport("fail", announce=False)
            for item in documents(cfg, formatter, [source], ((0, raw, None) for raw in window)):
                if item.problem:
                    report.bad(item.problem[0], item.where, item.problem[1])  # raises under `fail`
