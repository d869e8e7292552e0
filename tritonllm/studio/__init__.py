"""tritonllm Studio: a local page that follows training runs live and controls them.

``python -m tritonllm.studio [outputs/ multirun/ ...] [--port 8600]`` serves the page
(:mod:`tritonllm.studio.server`); the runs are found and read by :mod:`tritonllm.studio.runs`;
the trainer's side (control file, token, NVML telemetry, samples) is :mod:`tritonllm.studio.hooks`.
"""
