"""Disk faults for tests: an LMDB environment whose write transactions fail to commit on
demand, as ``mdb_txn_commit`` does on a full disk (``Input/output error`` on a full tmpfs)."""

from __future__ import annotations

from typing import Any, Self

import lmdb


class FailingTxn:
    def __init__(self, txn: Any, env: FailingEnv) -> None:
        self._txn, self._env = txn, env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            self._txn.abort()
        else:
            self.commit()

    def commit(self) -> None:
        if self._env.failures:
            self._env.failures -= 1
            self._txn.abort()
            raise lmdb.Error("mdb_txn_commit: Input/output error")
        self._txn.commit()


class FailingEnv:
    """``env`` whose write transactions fail to commit while ``failures`` > 0 (each failure
    counts it down)."""

    def __init__(self, env: Any) -> None:
        self._env, self.failures = env, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *args: Any, **kw: Any) -> Any:
        txn = self._env.begin(*args, **kw)
        return FailingTxn(txn, self) if kw.get("write") else txn


def failing(store: Any) -> FailingEnv:
    env = FailingEnv(store._nvme._env)
    store._nvme._env = env
    return env
