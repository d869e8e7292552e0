"""tritonllm.optim"""
