"""lineside: checkpoints → W4A16 ONNX/TensorRT bundles → slim runtime and OpenAI-compatible server."""

__version__ = "0.2.0"
