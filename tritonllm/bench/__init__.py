"""tritonllm.bench"""
