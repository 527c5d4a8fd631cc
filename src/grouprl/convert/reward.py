"""The reward a verl script gets: verl's default scorer for its data's `data_source`
(rewards/verl_scorers.py reproduces them), chosen when the training files can be read here,
else chosen per sample at run time (`verl_default`)."""

from __future__ import annotations

import json
from pathlib import Path

from grouprl.config.translate import Report
from grouprl.errors import ConfigError


def data_sources_of(files: list[str]) -> list[str] | None:
    """The data_source values of the first rows of the readable training files, or None (a
    file not here). A file that cannot be read as its kind is one error line."""
    found: list[str] = []
    for f in files:
        path = Path(f).expanduser()
        if not path.is_file():
            return None
        try:
            found += _sources(path)
        except (OSError, ValueError, UnicodeDecodeError) as e:  # pyarrow's errors are ValueErrors (ArrowInvalid)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"data file {path} cannot be read: {first[:200]}") from None
    return found or None


def _sources(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if "data_source" not in parquet.schema_arrow.names or not parquet.metadata.num_rows:
            return []
        column = parquet.read_row_group(0, columns=["data_source"]).column("data_source").to_pylist()
        return [str(v) for v in column if v]
    found = []
    with path.open(encoding="utf-8") as lines:
        for number, line in zip(range(1, 101), lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number} is not JSON ({e.msg})") from None
            if isinstance(record, dict) and record.get("data_source"):
                found.append(str(record["data_source"]))
    return found


def choose_reward(tree: dict, report: Report, data_sources: list[str] | None) -> None:
    """verl's default scorer by data_source: one rule when the data names sources it knows and
    they share a scorer, else verl_default (chosen per sample)."""
    from grouprl.rewards.verl_scorers import verl_scorer

    sources = sorted(set(data_sources or []))
    rules = {verl_scorer(s) for s in sources}
    if len(rules) == 1 and None not in rules:
        rule = rules.pop()
        why = f"verl's default scorer for data_source {', '.join(sources)}"
    else:
        rule = "verl_default"
        why = "verl's default scorer, chosen per sample by its data_source"
        if None in rules:
            report.notes.append(f"verl has no default scorer for data_source {', '.join(s for s in sources if verl_scorer(s) is None)}: "
                                "set reward.components for it")  # fmt: skip
    components = [{"name": "score", "function": rule, "weight": 1.0}]
    overlong = report.overlong
    if overlong is not None:  # DAPO adds it to the score
        components.append({"name": "overlong", "function": "overlong_penalty", "weight": 1.0, "kwargs": overlong})
    tree.setdefault("reward", {})["components"] = components
    tree["reward"]["val_metric"] = "score"
    report.notes.append(f"reward: {rule} ({why})")
