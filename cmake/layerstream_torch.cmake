# The settings find_package(Torch) needs for a CUDA build of LibTorch (the pip
# wheel's), worked out once here: layerstream's own build and the installed
# layerstreamConfig.cmake (find_package(layerstream)) both include this file.
#
#   layerstream_cuda_archs(<archs>)  sets CMAKE_CUDA_ARCHITECTURES and
#       TORCH_CUDA_ARCH_LIST from one list of compute capabilities ("75;80;...";
#       the last also as PTX), unless the caller set them.
#   layerstream_find_torch([REQUIRED|QUIET])  find_package(Torch) after:
#     * CUDA_TOOLKIT_ROOT_DIR: Caffe2's CMake finds CUDA through the old
#       FindCUDA, which ignores CMake's CUDAToolkit: taken from the CUDA
#       compiler found (or /usr/local/cuda);
#     * CUDA_nvrtc_LIBRARY: torch links libnvrtc, which a pip install keeps in
#       site-packages/nvidia/cu<N>/lib next to torch, where no CMake search
#       looks (unfound, every target linking torch fails to generate);
#     * TORCH_CUDA_ARCH_LIST: Caffe2 ignores CMAKE_CUDA_ARCHITECTURES and
#       otherwise compiles CUDA code for every arch torch was built for (some
#       too old for nvcc 13).
# Each is left alone when the caller (or the cache) already set it.
include_guard(GLOBAL)

function(layerstream_cuda_archs archs)
  list(GET archs -1 newest)
  set(cmake_archs "")
  set(torch_archs "")
  foreach(a IN LISTS archs)
    string(REGEX MATCH "^([0-9]+)([0-9])$" ok "${a}")
    if(NOT ok)
      message(FATAL_ERROR "LS_CUDA_ARCHS: '${a}' is not a compute capability such as 75 or 120 "
                          "(list: ${archs})")
    endif()
    set(dotted "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
    if(a STREQUAL newest)
      list(APPEND cmake_archs "${a}")          # SASS and PTX
      list(APPEND torch_archs "${dotted}+PTX")
    else()
      list(APPEND cmake_archs "${a}-real")     # SASS only
      list(APPEND torch_archs "${dotted}")
    endif()
  endforeach()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "${cmake_archs}" PARENT_SCOPE)
  endif()
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "${torch_archs}" PARENT_SCOPE)
  endif()
endfunction()

macro(layerstream_find_torch)
  if(NOT DEFINED CUDA_TOOLKIT_ROOT_DIR)
    set(_ls_cuda_root "")
    if(CMAKE_CUDA_COMPILER)
      get_filename_component(_ls_nvcc "${CMAKE_CUDA_COMPILER}" REALPATH)
      get_filename_component(_ls_cuda_root "${_ls_nvcc}" DIRECTORY)
      get_filename_component(_ls_cuda_root "${_ls_cuda_root}" DIRECTORY)
      # An nvcc that is a wrapper script elsewhere (e.g. /usr/local/bin/nvcc
      # running the toolkit's): not the toolkit's root. A build without the
      # CUDA backend gets the compiler Caffe2 enabled, cached, on a re-run.
      if(NOT EXISTS "${_ls_cuda_root}/include/cuda_runtime.h")
        set(_ls_cuda_root "")
      endif()
    endif()
    if(NOT _ls_cuda_root AND EXISTS /usr/local/cuda/bin/nvcc)
      set(_ls_cuda_root /usr/local/cuda)
    endif()
    if(_ls_cuda_root)
      set(CUDA_TOOLKIT_ROOT_DIR "${_ls_cuda_root}")
    endif()
  endif()
  if(NOT CUDA_nvrtc_LIBRARY)
    find_path(_ls_torch_dir TorchConfig.cmake NO_CACHE NO_DEFAULT_PATH
              PATHS ${Torch_DIR} ${CMAKE_PREFIX_PATH}
              PATH_SUFFIXES Torch share/cmake/Torch)
    if(_ls_torch_dir)
      # <site-packages>/torch/share/cmake/Torch -> <site-packages>/nvidia/cu<N>/lib
      get_filename_component(_ls_site "${_ls_torch_dir}/../../../.." ABSOLUTE)
      file(GLOB _ls_nvrtc "${_ls_site}/nvidia/cu*/lib/libnvrtc.so.*" "${_ls_site}/nvidia/cuda_nvrtc/lib/libnvrtc.so.*")
      list(FILTER _ls_nvrtc EXCLUDE REGEX "alt|builtins")
      if(_ls_nvrtc)
        list(GET _ls_nvrtc 0 _ls_nvrtc)
        # FORCE: FindCUDAToolkit (found first, by the installed config) caches
        # CUDA_nvrtc_LIBRARY-NOTFOUND, which a plain set(CACHE) would keep.
        set(CUDA_nvrtc_LIBRARY "${_ls_nvrtc}" CACHE FILEPATH "libnvrtc (found next to the pip torch)" FORCE)
      endif()
    endif()
  endif()
  find_package(Torch ${ARGN})
endmacro()
