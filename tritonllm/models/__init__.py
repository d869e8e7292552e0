"""tritonllm.models"""
