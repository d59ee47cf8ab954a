"""Notice when a wrapped model changes under a data-parallel engine after wrapping.

Nothing here overlaps anything. A data-parallel engine is built for the parameters a model
had when it was wrapped: the gradient buffer (DataParallel, ShardedOptimizer) or FSDP2's
shards (fully_shard) hold exactly those, in that dtype, with those `requires_grad`. A parameter
added later is reduced by nobody, so its copies drift apart across ranks; one frozen on one
rank only makes FSDP2's reduce-scatters differ in size (gloo aborts the process). `ParamWatch`
tells, at the next forward, what changed and where.

Cost: torch's global parameter- and module-registration hooks mark the watch dirty when a
module of the wrapped model gets a new parameter or submodule (so the steady state never walks
the module tree), and each forward compares one (dtype, device index, requires_grad) tuple per
parameter with the one recorded at wrapping.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)


def _remove(handles) -> None:
    for h in handles:
        h.remove()


class ParamWatch:
    """The parameters of `module` as they were when it was wrapped, and what has changed since."""

    def __init__(self, module: nn.Module, engine: str, advice: str) -> None:
        self.module, self.engine, self.advice = module, engine, advice
        self.named = list(module.named_parameters())
        self._params = [p for _, p in self.named]
        self.key = self.now()
        self.dirty = False
        self._members = weakref.WeakSet(module.modules())
        ref = weakref.ref(self)

        def registered(parent, _name, _value) -> None:
            watch = ref()
            if watch is not None and parent in watch._members:
                watch.dirty = True

        handles = [register_module_parameter_registration_hook(registered),
                   register_module_module_registration_hook(registered)]
        weakref.finalize(self, _remove, handles)

    def now(self) -> list:
        """(dtype, device index, requires_grad) of every parameter: cheap to compare at each forward."""
        # Metadata only: no need to go through a parameter's __torch_function__ (a ShardedOptimizer
        # parameter whose gather is in flight has one, and it would cost ~10 us a read).
        with torch._C.DisableTorchFunctionSubclass():
            return [(p.dtype, p.get_device(), p.requires_grad) for p in self._params]

    def problem(self) -> str | None:
        """None if the model is as it was at wrapping; else what changed, naming the parameters."""
        if not self.dirty and self.now() == self.key:
            return None
        parts = self._changes()
        if not parts:
            self.dirty = False  # a registration that changed nothing (the same parameter set again)
            return None
        return f"{self.engine}: {'; '.join(parts)} since the model was wrapped: {self.advice}"

    def changed_requires_grad_only(self) -> bool:
        """True if the only change is `requires_grad` (the same parameters, dtypes and devices)."""
        if self.dirty and self._structure():
            return False
        return all(now[:2] == was[:2] for now, was in zip(self.now(), self.key))

    def accept(self) -> None:
        """Take the current `requires_grad` of every parameter as the new reference."""
        self.key = self.now()

    def _structure(self) -> list[str]:
        before = dict(self.named)
        current = dict(self.module.named_parameters())
        added = [n for n in current if n not in before]
        replaced = [n for n, p in current.items() if n in before and p is not before[n]]
        removed = [n for n in before if n not in current]
        return [f"{_names(names)} {'were' if len(names) > 1 else 'was'} {label}"
                for label, names in (("added", added), ("replaced by a new Parameter", replaced), ("removed", removed))
                if names]

    def _changes(self) -> list[str]:
        parts = self._structure() if self.dirty else []
        groups: dict[str, list[str]] = {}  # one description, the parameters it fits
        for (name, p), (dtype, device, requires_grad), now in zip(self.named, self.key, self.now()):
            if now[2] != requires_grad:
                groups.setdefault(f"requires_grad={now[2]} ({requires_grad} when wrapped)", []).append(name)
            if now[:2] != (dtype, device):
                where = "cpu" if device < 0 else f"device {device}"
                groups.setdefault(f"{p.dtype} on {p.device} ({dtype} on {where} when wrapped: a .to()/.double()/"
                                  ".half())", []).append(name)
        for what, names in groups.items():
            verb = "have" if len(names) > 1 else "has"
            parts.append(f"{_names(names)} {verb} {what}" if what.startswith("requires_grad")
                         else f"{_names(names)} {'are' if len(names) > 1 else 'is'} now {what}")
        return parts


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"parameter{'s' if len(names) > 1 else ''} {shown}"
