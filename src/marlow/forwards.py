"""A module that computes through marlow's forward instead of its class's, by its class.

:func:`through` swaps a module's class for a subclass whose ``forward`` is a mixin's (the mixin
first in its method order, so that its ``super().forward`` is the class's own), one subclass per
class and mixin, made once and named as the class. :func:`marlow.models.fuse_norms` makes a
loaded base's RMSNorms so for good; :func:`marlow.policy.adapters.lora_in_base_dtype` makes its
LoRA linears so for a ``with`` block and puts their classes back after it.

Why a class and not an object set as the module's ``forward``: ``torch.compile`` guards an
object it finds on a module by its identity, so a compiled decoder layer was compiled again for
each layer (each layer's norms and LoRA linears had their own objects) and for each new object
(one a ``with`` block), until torch's limit of compilations, past which it ran eager; a class is
guarded by its type, which every layer's modules share (``tests/unit/test_compile_layers.py``).
"""

from __future__ import annotations

from torch import nn

_MADE: dict[tuple[type, type], type] = {}
"""(mixin, class) -> their subclass."""


def through(module: nn.Module, mixin: type) -> None:
    """Make ``module`` compute through ``mixin``'s forward (its class becomes the subclass of
    ``mixin`` and its class, :func:`subclass`); nothing where it already does."""
    if not isinstance(module, mixin):
        module.__class__ = subclass(type(module), mixin)


def subclass(cls: type, mixin: type) -> type:
    """The subclass of ``mixin`` and ``cls``, in that order, named as ``cls`` (so that what reads
    a module's class name, a repr, finds the same), made the first time it is asked for."""
    made = _MADE.get((mixin, cls))
    if made is None:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        made = _MADE[(mixin, cls)] = type(cls.__name__, (mixin, cls), names)
    return made
