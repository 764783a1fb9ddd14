"""TensorRT engine part: op-support check, engine key, profiles, the engine builder."""
