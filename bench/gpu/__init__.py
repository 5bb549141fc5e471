"""swarmd's GPU path checked on a real NVIDIA GPU (issue 32): `make gpu-check`.

__main__.py runs the checks (on the lent machine); prepare.py makes what that machine lacks
(.gpu/: wheels for its Python 3.12) here; run.sh is the command given to the device tool;
cuda_job.py, oom_job.py, serve_cuda.py and lora_job.py are the jobs and the service the
checks run through a daemon.
"""
