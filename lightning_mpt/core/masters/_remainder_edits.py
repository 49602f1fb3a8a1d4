"""The edits of bf16 remainder masters' weights: found by the checks, taken into the masters as they are found, and
kept, with their parameters, until the decision's host sync reads them and the masters report their names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from lightning_mpt.core.masters._edits import bits_differ
from lightning_mpt.core.masters._remainder_store import split

if TYPE_CHECKING:
    from lightning_mpt.core.masters.remainders import RemainderMasters


class RemainderEdits:
    """Weights edited in place since their masters were last written, found and adopted: a sleeping master takes its
    weight's edit (its remainder zeroed), a woken one the whole edited weight. What the checks find stays on the
    device until :meth:`take` is given the host's answer to whether any was.

    Args:
        owner: the masters checked (their ``stores`` and :meth:`~RemainderMasters.outside_stores`).

    Example:
        ```python
        from torch import nn
        from lightning_mpt.core.masters.remainders import RemainderMasters

        model = nn.Linear(4, 4)
        masters = RemainderMasters()
        masters.convert(model)
        model.weight.data.clamp_(-0.1, 0.1)
        flags = masters.found.check()
        assert masters.found.take([float(flags.any())]) == [model.weight]
        assert masters.found.take([1.0]) == []  # taken once
        ```
    """

    def __init__(self, owner: RemainderMasters) -> None:
        self.owner = owner
        self.flags: Optional[Tensor] = None  # the latest check's: the stores' weights in order, then the rest
        self.params: list[Tensor] = []  # the parameters of those flags
        # edits found outside a check (a master read, a chunk woken for its step): counted in at the next one
        self.noticed: list[tuple[list[Tensor], Tensor]] = []

    def notice(self, params: list[Tensor], flags: Tensor) -> None:
        """Edits of ``params`` found (``flags`` on the device, one per parameter) and adopted already."""
        self.noticed.append((params, flags))

    def check(self, stores: bool = True) -> Optional[Tensor]:
        """Check every weight for an edit since its master was last written, adopt what is found, and return (and keep
        in :attr:`flags`) a flag per weight, on the device, with the edits noticed since the last check; ``None`` when
        there is nothing to check. ``stores=False``: the flat stores' weights are left to the chunks' wakes."""
        owner = self.owner
        flags = [store.check() for store in owner.stores] if stores else []
        params = [p for store in owner.stores for p in store.params] if stores else []
        others = owner.outside_stores()
        with torch.no_grad():
            for p, m in others:
                # a weight given data of another format (an fp32 tensor assigned to .data) is compared in it
                rounded = split(m.detach())[0] if p.dtype == torch.bfloat16 else m.detach().to(p.dtype)
                edited = bits_differ(rounded, p)
                m.copy_(torch.where(edited, p.detach().float(), m))
                flags.append(edited.reshape(1))
        params += [p for p, _ in others]
        noticed, self.noticed = self.noticed, []
        for found, flag in noticed:
            flags.append(flag)
            params += found
        self.params = params
        self.flags = None if not flags else torch.cat([f.to(flags[0].device) for f in flags])
        return self.flags

    def take(self, flags: list[float]) -> list[Tensor]:
        """The parameters whose edits the latest check found, given ``flags`` (host values: whether any was, read
        in the decision's sync); each check's finds are taken once."""
        if self.flags is None or not any(flags):
            return []
        edited = self.flags.tolist()
        self.flags = None
        return [p for p, e in zip(self.params, edited) if e]
