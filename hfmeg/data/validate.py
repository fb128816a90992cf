"""Bad-data policy: count and report every unusable record, or fail on the first.

Kinds:
- `malformed_json`: a JSONL line (or array item) that is not a JSON object;
- `missing_field`: a required field absent or of the wrong type;
- `empty_response`: an empty output / assistant message / text, or no assistant turn;
- `invalid_record`: a chat the template rejects, or an unknown ShareGPT role;
- `overlong`: longer than `seq_len`; truncated (kept) or dropped per `DataConfig.overlong`;
- preference pairs (data/preference.py): `truncated_answer` (a sequence cut to `seq_len`, kept),
  `prompt_too_long` (the prompt alone fills `seq_len`: dropped, as TRL drops it), `identical_answers`.
(`overlong: split` cuts long documents into `seq_len` pieces on purpose and is not reported.)

With `bad_data: report` each kind is counted and its first record (file:line,
file[index] or hub-name#index) and message kept; the first case of each kind is
logged once, by one process only (`announce`: global rank 0), and `counts`/`first`
(or `summary()`) give the totals for an end-of-run report. With `bad_data: fail`
the first bad record raises `DataError` naming it. The counts are part of the
resumable data state, so they stay cumulative across restarts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError

log = logging.getLogger(__name__)


@dataclass
class DataReport:
    policy: str = "report"
    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)  # kind -> "where: message"
    documents: int = 0  # documents packed into rows
    announce: bool = True  # log each kind's first case (one process of the run does)

    def bad(self, kind: str, where: str, message: str) -> None:
        line = f"{where}: {message}"
        if self.policy == "fail":
            raise DataError(f"{line} ({kind}; set data.bad_data=report to skip and count such records)")
        if kind not in self.first:
            self.first[kind] = line
            if self.announce:
                log.warning("bad training data (%s), counting further cases: %s", kind, line)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def copy(self) -> DataReport:
        return DataReport(self.policy, dict(self.counts), dict(self.first), self.documents, self.announce)

    def summary(self) -> str:
        if not self.counts:
            return f"{self.documents} documents, no bad records"
        parts = [f"{k}: {n} (first: {self.first[k]})" for k, n in sorted(self.counts.items())]
        return f"{self.documents} documents; bad records: " + "; ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "first": dict(self.first), "documents": self.documents}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.counts, self.first, self.documents = dict(d["counts"]), dict(d["first"]), int(d["documents"])
