"""A persistent cache of judge answers (SQLite), so a resumed run or a re-score never pays twice.

The key is a SHA-256 over everything that decides the answer: backend, model, system and user
text, every image's bytes (with its group label), temperature and max_tokens. Only answers that
parsed are stored; the raw text is kept (not the scores), so a change of parsing or of field
weights re-reads old answers without new requests. One connection per cache guarded by a lock
(the judge's coroutines run on one thread, the lock covers anything else); WAL mode lets a
training run and a `grouprl judge score` process share one file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

from grouprl.errors import ConfigError
from grouprl.rewards.judges.base import Completion, JudgePrompt

logger = logging.getLogger(__name__)


def cache_key(backend: str, model: str, prompt: JudgePrompt, temperature: float, max_tokens: int) -> str:
    digest = hashlib.sha256()
    header = {
        "backend": backend,
        "model": model,
        "system": prompt.system,
        "user": prompt.user.replace(prompt.nonce, "NONCE") if prompt.nonce else prompt.user,  # drawn per call
        "temperature": temperature,
        "max_tokens": max_tokens,
        "image_groups": [[label, len(images)] for label, images in prompt.image_groups],
    }
    digest.update(json.dumps(header, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    for _, images in prompt.image_groups:
        for image in images:
            digest.update(hashlib.sha256(image.data).digest())
    return digest.hexdigest()


class JudgeCache:
    """key -> Completion, in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            # no fsync per insert (the judge loop must not stall); WAL stays consistent on a crash
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                "prompt_tokens INTEGER, completion_tokens INTEGER, created REAL NOT NULL)"
            )
            self._db.commit()
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(f"cannot open judge cache {self.path}: {e}") from None
        self._lock = threading.Lock()

    def get(self, key: str) -> Completion | None:
        with self._lock:
            row = self._db.execute(
                "SELECT text, prompt_tokens, completion_tokens FROM answers WHERE key = ?", (key,)
            ).fetchone()
        return (
            None if row is None else Completion(text=row[0], prompt_tokens=row[1], completion_tokens=row[2])
        )

    def put(self, key: str, completion: Completion) -> None:
        """Keep an answer; one that cannot be kept (text SQLite cannot store, such as a lone
        surrogate; a locked or full database) is asked again next time, never an error."""
        with self._lock:
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)",
                    (key, completion.text, completion.prompt_tokens, completion.completion_tokens, time.time()),
                )
                self._db.commit()
            except (UnicodeEncodeError, sqlite3.Error) as e:
                logger.warning("judge cache %s: an answer was not kept (%s)", self.path, type(e).__name__)

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"JudgeCache({str(self.path)!r})"
