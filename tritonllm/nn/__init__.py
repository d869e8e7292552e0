"""tritonllm.nn"""
