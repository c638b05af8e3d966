# Sourced (`. bench/device_env.sh`) first by every bench/run_*_gpu.sh, from the repo root on the
# GPU machine: the wheels of `python scripts/gpu_wheels.py` (carried as .whl) installed into
# .site, the repo and .site on the import path, and the card, cores and memory printed.
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
free -g | head -2
