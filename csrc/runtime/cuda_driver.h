#pragma once
// The CUDA driver layer now lives in codegen/cuda/cuda_driver.h (loading what NVRTC compiled is codegen's job),
// and runtime's view of it in runtime/cuda_launch.h. This header only keeps runtime/kernel_graph.cpp's include
// working until that file, being changed on another branch, includes runtime/cuda_launch.h alone; then delete it.
#include "runtime/cuda_launch.h"
