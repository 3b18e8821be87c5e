"""Shared fixtures: rank pools for real multi-rank cases (see ``tests/support/multirank.py``)."""

from __future__ import annotations

import pytest

from tests.support.multirank import RankPool


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks, started on first use and shared by every case of the session (restarted
    after a failed case). Per module, its start-up and the ranks' first imports cost ~5 s each time."""
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks (2×2 meshes), started on first use and shared by every case of the session."""
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads; one keeps the shared machine free."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One ``NEMO_WRAP_CACHE`` for the session's slow first-use builds (SmolLM2's conversion)."""
    return tmp_path_factory.mktemp("shared_nemo_wrap_cache")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """``NEMO_WRAP_CACHE`` for the whole module: the embedded default is built once, by its first user."""
    root = tmp_path_factory.mktemp("nemo_wrap_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEMO_WRAP_CACHE", str(root))
        yield root
