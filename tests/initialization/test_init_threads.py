"""Init interception is process-wide machinery with per-context state: threads do not disturb each other.

The redirecting wrappers are installed idempotently, under a lock, while any session is active, and
removed after the last; which session (seed, loaded names) a redirected call serves comes from a
ContextVar, so a thread sees only its own session, and a thread with none gets torch's own function.
"""

from __future__ import annotations

import threading

import torch
import transformers.initialization as hf_init

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.initialization.interception import _redirections_installed
from tests.support.tiny_models import tiny_config

BUILDS = (("llama", 1), ("qwen3", 2), ("own-qwen2", 3))


def _build(kind: str, seed: int) -> dict[str, torch.Tensor]:
    model = NeMoAutoModelForCausalLM.from_config(tiny_config(kind), seed=seed)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _build_concurrently(rounds: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each round starts one thread per build behind a barrier, so their init sessions overlap."""
    outcomes = []
    for _ in range(rounds):
        barrier = threading.Barrier(len(BUILDS))
        built: dict[str, dict[str, torch.Tensor]] = {}
        errors: list[BaseException] = []

        def build(kind: str, seed: int) -> None:
            try:
                barrier.wait(timeout=30)
                built[kind] = _build(kind, seed)
            except BaseException as error:  # noqa: BLE001 - surfaced in the main thread below
                errors.append(error)

        threads = [threading.Thread(target=build, args=spec) for spec in BUILDS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        outcomes.append(built)
    return outcomes


def test_threads_building_at_once_get_the_weights_they_get_alone():
    alone = {kind: _build(kind, seed) for kind, seed in BUILDS}
    for built in _build_concurrently(rounds=3):
        assert built.keys() == alone.keys()
        for kind, state in built.items():
            for name, tensor in state.items():
                assert torch.equal(tensor, alone[kind][name]), (kind, name)


def test_a_thread_without_a_session_gets_torchs_own_draw_while_another_initializes():
    expected = torch.empty(1000).normal_(generator=torch.Generator().manual_seed(5))
    stop = threading.Event()
    background = threading.Thread(target=lambda: [_build("llama", 1) for _ in range(3) if not stop.is_set()])
    background.start()
    try:
        draws = [
            torch.nn.init.normal_(torch.empty(1000), generator=torch.Generator().manual_seed(5)) for _ in range(200)
        ]
    finally:
        stop.set()
        background.join(timeout=120)
    assert all(torch.equal(draw, expected) for draw in draws)


def test_installation_is_idempotent():
    with _redirections_installed(), _redirections_installed():  # nested sessions
        for function in (torch.nn.init.normal_, hf_init.normal_, torch.nn.init.zeros_):
            wrapped = function.__wrapped__  # exactly one layer of redirection
            assert not hasattr(wrapped, "_nemo_wrap_redirects"), function
    assert not hasattr(torch.nn.init.normal_, "_nemo_wrap_redirects")


def test_init_functions_are_torchs_own_again_after_every_build(tmp_path):
    """The interception lives only while a model is built and initialized, not in the process."""
    from tests.support.checkpoints import write_checkpoint

    originals = {name: getattr(torch.nn.init, name) for name in hf_init.TORCH_INIT_FUNCTIONS}
    hf_originals = {name: getattr(hf_init, name) for name in hf_init.TORCH_INIT_FUNCTIONS}
    NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=1)
    NeMoAutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, "own-llama", "half", tie=True))
    _build_concurrently(rounds=1)
    for name, function in originals.items():
        assert getattr(torch.nn.init, name) is function, name
        assert not hasattr(getattr(torch.nn.init, name), "_nemo_wrap_redirects"), name
        assert getattr(hf_init, name) is hf_originals[name], name
