# shellcheck shell=bash
# Settings shared by every tpu_scripts/ script. Each one can be set in the environment
# (`export PSPEC_TPU_PROJECT=my-project`) or edited here; the environment wins.

# The Google Cloud project that owns the TPU (required, no default).
PSPEC_TPU_PROJECT="${PSPEC_TPU_PROJECT:-}"
# Where the TPU lives; v4 slices are in us-central2-b.
PSPEC_TPU_ZONE="${PSPEC_TPU_ZONE:-us-central2-b}"
# Accelerator type: v4-8 is one host, v4-32 is four hosts (the llama2 configs' preset).
PSPEC_TPU_TYPE="${PSPEC_TPU_TYPE:-v4-32}"
# Name of the TPU VM (and of its queued resource, in queued mode).
PSPEC_TPU_NAME="${PSPEC_TPU_NAME:-pspec}"
# TPU software version (the VM image).
PSPEC_TPU_RUNTIME="${PSPEC_TPU_RUNTIME:-tpu-ubuntu2204-base}"
# 1: create and delete through a queued resource (waits for capacity) instead of directly.
PSPEC_TPU_QUEUED="${PSPEC_TPU_QUEUED:-0}"
# 1: spot capacity (cheaper, can be preempted at any time; training resumes from checkpoints).
PSPEC_TPU_SPOT="${PSPEC_TPU_SPOT:-0}"
# The Python interpreter setup.sh installs with apt and builds the venv from (needs >= 3.11).
PSPEC_TPU_PYTHON="${PSPEC_TPU_PYTHON:-python3.11}"
# The project's directory on every worker, relative to the home directory.
PSPEC_TPU_DIR="${PSPEC_TPU_DIR:-pspec_jax}"
# tmux session that launch.sh starts, stop.sh kills and logs.sh reads (~/pspec_logs/NAME.log).
PSPEC_TPU_SESSION="${PSPEC_TPU_SESSION:-pspec}"
