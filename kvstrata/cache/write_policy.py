"""Write policies of the host tier: when device pages are copied to the host (L2).

    write_through            every new leaf is backed up as soon as it is inserted
    write_through_selective  a node is backed up once it has been hit `threshold` times
    write_back               a node is copied to the host only when it leaves the device

Each policy is one object; WRITE_POLICIES is the registry (ServerArgs reads its names for --choices).
A policy decides, the host tier copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.cache.host_tier import HostTier
    from kvstrata.cache.radix_tree import TreeNode


class WritePolicy:
    """Hooks the host tier calls; the default does nothing."""

    name = ""

    def on_insert(self, host: HostTier, leaf: TreeNode) -> None:
        """A new device leaf was inserted."""

    def on_hit(self, host: HostTier, node: TreeNode) -> None:
        """A request's match ends at device node `node` (its ancestors were hit too)."""

    def on_demote(self, host: HostTier, node: TreeNode) -> None:
        """`node` is about to leave the device."""


class WriteThrough(WritePolicy):
    name = "write_through"

    def on_insert(self, host: HostTier, leaf: TreeNode) -> None:
        """Back up every new leaf right away."""
        host.backup(leaf)


class WriteThroughSelective(WritePolicy):
    name = "write_through_selective"
    threshold = 2

    def on_hit(self, host: HostTier, node: TreeNode) -> None:
        """Back up the nodes of the path that have been hit often enough."""
        while not node.is_root:
            if node.hit_count >= self.threshold:
                host.backup(node)
            node = node.parent


class WriteBack(WritePolicy):
    name = "write_back"

    def on_demote(self, host: HostTier, node: TreeNode) -> None:
        """Copy the node to the host now (synchronously): its device pages are about to be freed."""
        host.copy_now(node)


WRITE_POLICIES: dict[str, WritePolicy] = {p.name: p for p in (WriteThrough(), WriteThroughSelective(), WriteBack())}


def write_policy(name: str) -> WritePolicy:
    """The policy named `name`; raises ValueError for an unknown one."""
    try:
        return WRITE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown hicache write policy {name!r}; choose one of {sorted(WRITE_POLICIES)}") from None
