# ctest install_consumer: `cmake --install` this build into BUILD_DIR/consumer-install,
# then configure, build and run tests/consumer against that prefix only (as a
# LibTorch program outside the repository would: find_package(layerstream)).
# cmake -DBUILD_DIR=<build> -DSOURCE_DIR=<tests/consumer> -DGENERATOR=Ninja -DCXX=<c++> -P run.cmake
set(prefix "${BUILD_DIR}/consumer-install")
set(bin "${BUILD_DIR}/consumer-build")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_consumer: failed (${rc}): ${ARGN}")
  endif()
endfunction()
file(REMOVE_RECURSE "${prefix}" "${bin}")  # fresh each run, as on a new machine
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
if(NOT EXISTS "${prefix}/include/layerstream/offload.h" OR EXISTS "${prefix}/include/torch")
  message(FATAL_ERROR "install_consumer: the public headers are not (only) under include/layerstream/")
endif()
# No Torch_DIR, no CUDA flags: the installed config finds the LibTorch it was built with.
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${bin}" -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX}
     -DCMAKE_BUILD_TYPE= -DCMAKE_PREFIX_PATH=${prefix})
step(${CMAKE_COMMAND} --build "${bin}")
step("${bin}/consumer")
