"""A session's life as one state (cache.SessionState): each state is reached by what a user does, and
each illegal move raises its own SessionError."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from packcache import SessionError, WeightCache
from packcache.cache import PackKey, SessionState

KEY = PackKey({"packer": "test", "version": 1})


def _ones() -> np.ndarray:
    return np.ones(16, dtype=np.float32)


def test_a_request_before_the_session_is_entered_says_so(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "c.pcache") as cache:
        session = cache.session()
        assert session.state is SessionState.UNOPENED
        with pytest.raises(SessionError, match="outside an active session, before the session was entered"):
            session.get_or_pack("a", _ones, KEY)
        with pytest.raises(SessionError, match="before the session was entered"):
            session.get_many([("a", _ones, KEY)])
        with session as s:  # refused requests did not spoil it: it can still be entered
            assert s.state is SessionState.ACTIVE
            assert s.get_or_pack("a", _ones, KEY).sum() == 16
        assert session.state is SessionState.CLOSED


def test_a_request_after_the_session_ended_and_a_second_entry_say_so(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "c.pcache") as cache:
        with cache.session() as s:
            s.get_or_pack("a", _ones, KEY)
        assert s.state is SessionState.CLOSED
        with pytest.raises(SessionError, match="outside an active session, after the session ended"):
            s.get_or_pack("a", _ones, KEY)
        with pytest.raises(SessionError, match="after the session ended"):
            s.get_many([("a", _ones, KEY)])
        with pytest.raises(SessionError, match=r"entered once \(this one is closed\)"):
            s.__enter__()
        assert cache.stats().stored == 1


def test_a_request_while_the_session_closes_is_refused_and_the_running_one_is_committed(tmp_path: Path) -> None:
    """The exit waits for another thread's running request (CLOSING) and commits what it stores; a request
    that starts during that wait is refused with its own message."""
    path = tmp_path / "c.pcache"
    started, release = threading.Event(), threading.Event()
    served: list[np.ndarray] = []

    def slow() -> np.ndarray:
        started.set()
        assert release.wait(30)
        return np.full(8, 3.0, dtype=np.float32)

    with WeightCache(path) as cache:
        session = cache.session()
        session.__enter__()
        worker = threading.Thread(target=lambda: served.append(session.get_or_pack("slow", slow, KEY)))
        worker.start()
        assert started.wait(30)
        exiting = threading.Thread(target=session.__exit__, args=(None, None, None))
        # __exit__ from another thread than the one that entered: it still waits for the worker's request.
        exiting.start()
        for _ in range(3000):
            if session.state is SessionState.CLOSING:
                break
            threading.Event().wait(0.001)
        assert session.state is SessionState.CLOSING
        with pytest.raises(SessionError, match="while the session is closing"):
            session.get_or_pack("late", _ones, KEY)
        release.set()
        worker.join(30)
        exiting.join(30)
        assert session.state is SessionState.CLOSED
        assert served and served[0].tolist() == [3.0] * 8
    with WeightCache(path) as again, again.session() as s:
        s.get_or_pack("slow", slow, KEY)
        assert again.stats().hits == 1  # the CLOSING session committed the pack it was making


def test_a_failed_entry_ends_the_session(tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "c.pcache")
    cache.close()
    session = cache.session()
    with pytest.raises(SessionError, match="is closed"):
        session.__enter__()
    assert session.state is SessionState.CLOSED
    with pytest.raises(SessionError, match=r"entered once \(this one is closed\)"):
        session.__enter__()


def test_a_session_its_thread_abandoned_is_closed_by_the_next_one(tmp_path: Path) -> None:
    with WeightCache(tmp_path / "c.pcache") as cache:
        left: list[object] = []

        def enter_and_vanish() -> None:
            s = cache.session()
            s.__enter__()  # never exited: the thread ends holding the cache
            left.append(s)

        thread = threading.Thread(target=enter_and_vanish)
        thread.start()
        thread.join(30)
        (abandoned,) = left
        assert abandoned.state is SessionState.ACTIVE  # type: ignore[attr-defined]
        with cache.session() as s:
            assert s.state is SessionState.ACTIVE
        assert abandoned.state is SessionState.CLOSED  # type: ignore[attr-defined]
