// Registers the MPI transport with the core's registry (cpp/registry.h) while the library
// loads; linked whole (CMake WHOLE_ARCHIVE), so this initialiser is never dropped.
#include "mpi_communicator.h"
#include "registry.h"

namespace gridweave {
namespace {

const bool registered = [] {
  register_transport(Backend::Mpi, [](CommInfo info, std::shared_ptr<Store>, int device_index) {
    return std::static_pointer_cast<Communicator>(std::make_shared<MpiCommunicator>(std::move(info), device_index));
  });
  register_mpi_runtime({&mpi_world, &mpi_finalize});
  return true;
}();

}  // namespace
}  // namespace gridweave
