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


def adopt_whole_edit(param: Tensor, master: Tensor) -> Tensor:
    """Whether ``param``'s weight differs from ``master`` (an fp32 tensor of its own) rounded as the weights are (ties
    away from zero; in the weight's own format if user code gave it data of another); if so, ``master`` takes the
    weight's value, the whole tensor. The flag stays on the device (0-dim): no host sync.

    Example:
        ```python
        master = torch.tensor([1.0 + 2.0**-8, 3.0])  # a tie: its weight rounds away from zero
        weight = split(master)[0]
        assert not adopt_whole_edit(weight, master) and master[0] == 1.0 + 2.0**-8
        weight[1] = 0.5
        assert adopt_whole_edit(weight, master) and master.tolist() == [1.0 + 2.0**-7, 0.5]
        ```
    """
    with torch.no_grad():
        rounded = split(master.detach())[0] if param.dtype == torch.bfloat16 else master.detach().to(param.dtype)
        edited = bits_differ(rounded, param)
        master.copy_(torch.where(edited, param.detach().float(), master))
    return edited


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
        flags += [adopt_whole_edit(p, m).reshape(1) for p, m in others]
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
