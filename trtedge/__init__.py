"""trtedge: checkpoints → W4A16 ONNX/TensorRT bundles → slim runtime and OpenAI-compatible server."""

__version__ = "0.1.0"
