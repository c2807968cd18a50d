"""One-sided reads and writes of another process's memory, Monarch's ``monarch.rdma``, with no RDMA hardware:
``from monarch.rdma import RDMABuffer``.

class Learner(Actor):
    @endpoint
    def weights(self):
        return RDMABuffer(self.w.view(torch.uint8).flatten())   # a view: later updates are what readers see

class Generator(Actor):
    @endpoint
    async def update(self, buf):
        await buf.read_into(self.w.view(torch.uint8).flatten())

On one host the bytes move through shared memory (CUDA IPC for GPU tensors), with no help from the owner;
across hosts through the owner process's signed actor transport. Only processes of the same user can open
a buffer's shared memory. ``import monarch.rdma`` imports neither torch nor zmq (they come with the first
buffer). See docs/features/rdma.md.
"""

from monarch.runtime.common.rdma import (
    RDMAAction,
    RDMABuffer,
    RDMAError,
    RDMAFuture,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
)

__all__ = [
    "get_rdma_backend",
    "is_ibverbs_available",
    "is_rdma_available",
    "RDMABuffer",
    "RDMAAction",
    "RDMAReadTransferWarning",
    "RDMATcpFallbackWarning",
    "RDMAWriteTransferWarning",
    "RDMAError",
    "RDMAFuture",
]
