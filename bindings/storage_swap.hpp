// The storage swap of DistributedLion's second momentum buffers
// (lionbit.next_momenta): after a step every rank agreed to, each momentum
// takes its second buffer's storage (the next momentum, written in the pass
// that packed the direction) and the buffer takes the old one. Each tensor
// keeps its identity (opt.state, plans and user references stay valid); a
// step of a model of hundreds of tensors is one call, not a Python loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace lionbit {

// Exchanges the storage (and offset, sizes, strides) of as[i] and bs[i] for
// every i, as `old = a.detach(); a.set_(b); b.set_(old)`. Every pair is
// checked first (the same dtype, device and sizes, both contiguous, no
// shared memory): a ValueError naming the pair, and nothing swapped.
void swap_storages(const std::vector<at::Tensor>& as, const std::vector<at::Tensor>& bs);

} // namespace lionbit
