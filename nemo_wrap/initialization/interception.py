"""Route the init functions a model's ``_init_weights`` calls to seeded, shard-aware fills.

Why intercept instead of re-implementing each model's rule: the rule (which module gets which
distribution, GPT-2's depth-scaled projections, Gemma's zero-centred norms, rotary buffers) is the
model's own knowledge and stays in transformers. What is wrong for sharded training is only *how*
each value is produced: torch's ``normal_`` on a DTensor is neither seeded per parameter nor
sharding-independent, and indexed writes land in gathered copies. So while an
:class:`InitSession` is active, ``transformers.initialization.*`` and ``torch.nn.init.*`` (and the
aliases torch's own modules import, the list transformers itself guards) are replaced by functions
that

- resolve the tensor to its fully qualified parameter/buffer name (needed for seeding),
- skip it if it was loaded (by name, since ``fully_shard`` drops attributes), is a tie target
  (it gets its source's values afterwards), or carries transformers' ``_is_hf_initialized`` flag,
- otherwise write the fill through :mod:`tiled_random` / :mod:`deterministic`.

The redirecting wrappers are installed only while some session is active — never at import, never
for the life of the process: the first session to become active installs them (once per function,
under a lock) and the last one to end restores the functions they wrapped, as transformers' own
``guard_torch_init_functions`` restores in a ``finally``. In between, a wrapper asks the ContextVar
for this context's session and, when there is none (another thread), calls the function it wraps,
unchanged; so two threads initializing at once neither see each other's session nor unwind each
other's wrappers. Installation is re-checked at each activation because transformers'
``guard_torch_init_functions`` and ``no_init_weights`` set torch's functions back to what they
saved when they exit.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import chain
from typing import Any

import torch
import transformers.initialization as hf_init
from torch import nn

from nemo_wrap.errors import InvalidInitArgumentError, UnknownInitTargetError, UnsupportedInitFunctionError
from nemo_wrap.initialization.deterministic import constant_fill_, copy_global_
from nemo_wrap.initialization.embedding import zero_padding_row_
from nemo_wrap.initialization.tiled_random import Distribution, Normal, TruncatedNormal, Uniform, random_fill_

_ACTIVE: ContextVar[InitSession | None] = ContextVar("nemo_wrap_init_session", default=None)


class InitSession:
    """State of one initialization pass over a model: seed, names, what must not be touched.

    ``root`` is the module whose qualified names seed the draws. ``loaded_names`` are skipped by
    tensor identity (so every alias of a loaded tensor is skipped); ``tie_targets`` are skipped by
    the name under which the rule reaches them (the embedding rule initializes a tied weight, the
    ``lm_head`` rule does not).
    """

    def __init__(
        self, root: nn.Module, *, seed: int, loaded_names: frozenset[str], tie_targets: frozenset[str]
    ) -> None:
        self.seed = seed
        self._root = root
        self._tie_targets = tie_targets
        self._names: dict[int, str] = {}
        self._loaded_ids: set[int] = set()
        known: set[str] = set()
        for name, tensor in chain(
            root.named_parameters(remove_duplicate=False), root.named_buffers(remove_duplicate=False)
        ):
            known.add(name)
            self._names.setdefault(id(tensor), name)  # first name wins: stable across layouts
            if name in loaded_names:
                self._loaded_ids.add(id(tensor))
        if unknown := sorted(loaded_names - known):
            # A misspelt loaded name would let initialization overwrite the weight it meant to keep.
            raise InvalidInitArgumentError(
                f"loaded_names lists {unknown[:5]} ({len(unknown)} in all), which are not parameters "
                f"or buffers of {type(root).__name__}"
            )
        self._module_names: dict[int, str] | None = None
        self._current: tuple[str, nn.Module] | None = None
        self._written: set[int] = set()

    @staticmethod
    def current() -> InitSession | None:
        """The session active in this context, if any."""
        return _ACTIVE.get()

    @contextmanager
    def active(self) -> Iterator[InitSession]:
        """Make this the active session of this context (thread, task), under ``no_grad``."""
        with _redirections_installed():
            token = _ACTIVE.set(self)
            try:
                with torch.no_grad():
                    yield self
            finally:
                _ACTIVE.reset(token)

    def qualname_of(self, module: nn.Module) -> str:
        """``module``'s qualified name under the root ("" for the root or a detached module)."""
        if self._module_names is None:
            self._module_names = {id(m): n for n, m in self._root.named_modules(remove_duplicate=False)}
        return self._module_names.get(id(module), "")

    def apply_rule(self, rule: Callable[[nn.Module], None], module: nn.Module, qualname: str) -> None:
        """Run a model's per-module ``rule`` on ``module``, with the padding row done shard-aware.

        The rule runs with ``padding_idx`` hidden, so it draws the embedding with its own
        distribution but never indexes the weight (which would gather a DTensor); if the rule wrote
        the weight, the padding row is then zeroed where it lives.
        """
        embedding = module if isinstance(module, nn.Embedding) else None
        padding_idx = embedding.padding_idx if embedding is not None else None
        previous = self._current, self._written
        self._current, self._written = (qualname, module), set()
        if embedding is not None and padding_idx is not None:
            embedding.padding_idx = None
        try:
            rule(module)
            weight_written = embedding is not None and padding_idx is not None and id(embedding.weight) in self._written
        finally:
            if embedding is not None and padding_idx is not None:
                embedding.padding_idx = padding_idx
            self._current, self._written = previous
        if weight_written and embedding is not None and padding_idx is not None:
            zero_padding_row_(embedding.weight, padding_idx, name=_join(qualname, "weight"))

    # -- what the redirected init functions do -------------------------------------------------
    def _target(self, function: str, tensor: torch.Tensor) -> str | None:
        """The name to seed ``tensor`` with, or None when it must be left alone."""
        name = self._contextual_name(tensor) or self._names.get(id(tensor))
        if name is None:
            where = self._current[0] if self._current is not None else "<none>"
            raise UnknownInitTargetError(
                f"{function} was called by the init rule of module '{where}' on a tensor of shape "
                f"{tuple(tensor.shape)} that is not a parameter or buffer of the model (a slice or "
                "copy); writing it would not change the model"
            )
        if id(tensor) in self._loaded_ids or name in self._tie_targets or getattr(tensor, "_is_hf_initialized", False):
            return None
        self._written.add(id(tensor))
        return name

    def _contextual_name(self, tensor: torch.Tensor) -> str | None:
        """The name under which the module being initialized holds ``tensor`` directly, if it does."""
        if self._current is None:
            return None
        qualname, module = self._current
        for attr, own in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if own is tensor:
                return _join(qualname, attr)
        return None

    def _random_(self, function: str, tensor: torch.Tensor, distribution: Distribution) -> torch.Tensor:
        name = self._target(function, tensor)
        if name is not None:
            random_fill_(tensor, distribution, seed=self.seed, name=name)
        return tensor

    def _constant_(self, function: str, tensor: torch.Tensor, value: float) -> torch.Tensor:
        name = self._target(function, tensor)
        if name is not None:
            constant_fill_(tensor, value, name=name)
        return tensor

    def _copy_(self, function: str, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        name = self._target(function, tensor)
        if name is not None:
            copy_global_(tensor, source, name=name)
        return tensor

    def _unsupported(self, function: str, tensor: torch.Tensor) -> torch.Tensor:
        name = self._target(function, tensor)
        if name is not None:
            raise UnsupportedInitFunctionError(
                f"{function} on '{name}' has no sharding-independent implementation in nemo_wrap"
            )
        return tensor


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# Handlers: (session, function name, tensor, the init function's own arguments) -> tensor.
# ``generator`` arguments are ignored on purpose: the draw is seeded per parameter and tile.
_HANDLERS: dict[str, Callable[..., torch.Tensor]] = {
    "normal_": lambda s, f, t, mean=0.0, std=1.0, generator=None: s._random_(f, t, Normal(mean, std)),
    "uniform_": lambda s, f, t, a=0.0, b=1.0, generator=None: s._random_(f, t, Uniform(a, b)),
    "trunc_normal_": lambda s, f, t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None: s._random_(
        f, t, TruncatedNormal(mean, std, a, b)
    ),
    "zeros_": lambda s, f, t: s._constant_(f, t, 0.0),
    "ones_": lambda s, f, t: s._constant_(f, t, 1.0),
    "constant_": lambda s, f, t, val: s._constant_(f, t, val),
    "copy_": lambda s, f, t, other: s._copy_(f, t, other),
}


_REDIRECT_MARK = "_nemo_wrap_redirects"
_INSTALL_LOCK = threading.Lock()
_WRAPPED: list[tuple[object, str, Callable[..., Any]]] = []  # (namespace, name, the function wrapped)
_SESSIONS_USING = [0]  # active sessions across threads: the last one to end restores the functions


def _redirect(function: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``original`` so that, inside a session, it calls the session's handler instead."""
    handler = _HANDLERS.get(function)

    @functools.wraps(original)
    def redirected(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        session = _ACTIVE.get()
        if session is None:  # no session in this context: the wrapped function, unchanged
            return original(tensor, *args, **kwargs)
        if handler is None:
            return session._unsupported(function, tensor)
        return handler(session, function, tensor, *args, **kwargs)

    setattr(redirected, _REDIRECT_MARK, True)
    return redirected


@contextmanager
def _redirections_installed() -> Iterator[None]:
    """Wrappers in place while any session is active; the functions they wrap restored after the last."""
    with _INSTALL_LOCK:
        _install_unlocked()
        _SESSIONS_USING[0] += 1
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            _SESSIONS_USING[0] -= 1
            if _SESSIONS_USING[0] == 0:
                _restore_unlocked()


def _install_unlocked() -> None:
    for namespace, name in _entry_points():
        current = getattr(namespace, name)
        if not getattr(current, _REDIRECT_MARK, False):
            setattr(namespace, name, _redirect(name, current))
            _WRAPPED.append((namespace, name, current))


def _restore_unlocked() -> None:
    for namespace, name, original in reversed(_WRAPPED):
        if getattr(getattr(namespace, name), _REDIRECT_MARK, False):
            setattr(namespace, name, original)
    _WRAPPED.clear()


def _entry_points() -> Iterator[tuple[object, str]]:
    """(namespace, attribute) of every init function a model's rule may call.

    ``lecun_normal_`` and ``default_flax_embed_init_`` need no entry: they call the module-level
    ``trunc_normal_`` / ``normal_`` of ``transformers.initialization``, which are redirected.
    """
    for name in (*hf_init.TORCH_INIT_FUNCTIONS, "copy_"):
        yield hf_init, name
    for module_name in hf_init.TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(module_name)
        for name in hf_init.TORCH_INIT_FUNCTIONS:
            if module is not None and hasattr(module, name):
                yield module, name
