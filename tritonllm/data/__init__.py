"""tritonllm.data"""
