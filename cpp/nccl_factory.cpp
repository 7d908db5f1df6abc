// Bridges the Grid to the NCCL transport in cuda/ when it was built.
#include "error.h"
#include "grid.h"

#ifdef GRIDWEAVE_WITH_NCCL
#include "nccl_communicator.h"
#endif

namespace gridweave {

bool nccl_available() {
#ifdef GRIDWEAVE_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<Communicator> make_nccl_communicator(CommInfo info, std::shared_ptr<Store> store, int device_index) {
#ifdef GRIDWEAVE_WITH_NCCL
  return std::make_shared<NcclCommunicator>(std::move(info), std::move(store), device_index);
#else
  (void)info;
  (void)store;
  (void)device_index;
  GW_CHECK(false, "backend 'nccl' requested but gridweave was built without the NCCL transport");
#endif
}

}  // namespace gridweave
