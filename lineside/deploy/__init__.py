"""Deployments lineside does not serve itself: DeepSeek-V4 and the R1-Distill models on datacenter GPUs
through an existing engine (vLLM, SGLang, TensorRT-LLM), sized by the planner's memory math."""
