# Find NCCL: from the nvidia-nccl-cu13 wheel (nvidia/nccl under site-packages),
# NCCL_ROOT, or the system. Sets NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_LIBRARY_DIR.
set(_nccl_hints "")
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _nccl_hints "$ENV{NCCL_ROOT}")
endif()
find_package(Python 3 COMPONENTS Interpreter QUIET)
if(Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])"
    OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_nccl_wheel)
    list(APPEND _nccl_hints "${_nccl_wheel}")
  endif()
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL DEFAULT_MSG NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND)
  get_filename_component(NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
