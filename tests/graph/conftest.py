import pytest

from vlmcompile.graph import annotate_memo, export_memo


@pytest.fixture
def memos(monkeypatch):
    """The export and annotate memos on and empty: a test counts its own hits and misses."""
    monkeypatch.setenv(export_memo.MEMO_ENV, "1")
    export_memo.clear()
    annotate_memo.clear()
    yield
    export_memo.clear()
    annotate_memo.clear()
