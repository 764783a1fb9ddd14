"""The TensorRT side of the runtime: engine key and lookup, CUDA environment, buffers, arena, graphs, kernels, backend.

Imported lazily (TensorRT and cuda-python are an optional extra); the engine builder in
``lineside.build.tensorrt`` imports from here, never the reverse.
"""
