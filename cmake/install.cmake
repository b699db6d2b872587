# `cmake --install <build> --prefix <dir>` installs the C++ library for
# LibTorch programs:
#   <dir>/include/layerstream/   offload.h, engine.h, host_optim.h (the API) and core/ (what they include)
#   <dir>/lib/                   libls_core.a, libls_sim.a, libls_cuda.a (with CUDA), libls_torch.a
#   <dir>/lib/cmake/layerstream/ layerstreamConfig.cmake: find_package(layerstream CONFIG),
#                                then target_link_libraries(app layerstream::torch)
# The config finds the LibTorch layerstream was built against (its Torch_DIR,
# with the CUDA settings of cmake/layerstream_torch.cmake) and refuses another
# torch version. tests/consumer/ is a program built this way (ctest
# install_consumer). The `layerstream` command is installed to <dir>/bin.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LS_EXPORTED ls_core ls_sim)
set_target_properties(ls_core PROPERTIES EXPORT_NAME core)
set_target_properties(ls_sim PROPERTIES EXPORT_NAME sim)
add_library(layerstream::core ALIAS ls_core)
add_library(layerstream::sim ALIAS ls_sim)
if(LS_HAVE_CUDA)
  list(APPEND LS_EXPORTED ls_cuda)
  set_target_properties(ls_cuda PROPERTIES EXPORT_NAME cuda)
  add_library(layerstream::cuda ALIAS ls_cuda)
endif()
if(LS_HAVE_TORCH)
  list(APPEND LS_EXPORTED ls_torch)
  set_target_properties(ls_torch PROPERTIES EXPORT_NAME torch)
  add_library(layerstream::torch ALIAS ls_torch)
endif()

install(TARGETS ${LS_EXPORTED} EXPORT layerstreamTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS layerstream RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(LS_HAVE_TORCH)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/csrc/layerstream/
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/layerstream FILES_MATCHING PATTERN "*.h")
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/csrc/core/
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/layerstream/core FILES_MATCHING PATTERN "*.h")

set(LS_CONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/layerstream)
install(EXPORT layerstreamTargets NAMESPACE layerstream:: DESTINATION ${LS_CONFIG_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/layerstreamConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/layerstreamConfig.cmake INSTALL_DESTINATION ${LS_CONFIG_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/layerstreamConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/layerstreamConfig.cmake ${PROJECT_BINARY_DIR}/layerstreamConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/layerstream_torch.cmake
        DESTINATION ${LS_CONFIG_DIR})

# The consumer test (ctest install_consumer): installs this build into
# <build>/consumer-install, then configures, builds and runs tests/consumer
# against that install only (tests/consumer/run.cmake).
if(LS_HAVE_TORCH AND LS_BUILD_TESTS)
  add_test(NAME install_consumer
           COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR}
                   -DSOURCE_DIR=${PROJECT_SOURCE_DIR}/tests/consumer
                   -DGENERATOR=${CMAKE_GENERATOR} -DCXX=${CMAKE_CXX_COMPILER}
                   -P ${PROJECT_SOURCE_DIR}/tests/consumer/run.cmake)
  set_tests_properties(install_consumer PROPERTIES TIMEOUT 600)
endif()
